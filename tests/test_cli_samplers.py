"""The command's llama.cpp sampler flags, checked against the command's own greedy output."""

from __future__ import annotations

from test_cli import run


def test_top_k_1_is_greedy_whatever_the_temperature():
    greedy = run("--temperature=0", "--steps=60")
    top1 = run("--temperature=1.5", "--top_k=1", "--seed=77", "--steps=60")
    assert greedy.returncode == 0 and top1.returncode == 0, top1.stderr
    assert top1.stdout == greedy.stdout


def test_min_p_1_is_greedy_and_a_penalty_changes_the_greedy_story():
    greedy = run("--temperature=0", "--steps=80")
    assert run("--temperature=1", "--min_p=1", "--seed=3", "--steps=80").stdout == greedy.stdout
    penalized = run("--temperature=0", "--steps=80", "--repeat_penalty=1.5")
    assert penalized.returncode == 0 and penalized.stdout != greedy.stdout


def test_bad_sampler_flags_are_one_line_errors():
    for args, name in [
        (["--samplers=top_k,top_p"], "--samplers"),
        (["--top_k=-1"], "--top_k"),
        (["--min_p=2"], "--min_p"),
        (["--repeat_penalty=0"], "--repeat_penalty"),
        (["--decode=loop", "--top_k=3"], "--top_k"),
    ]:
        done = run(*args)
        assert done.returncode == 1, args
        assert done.stderr.count("\n") == 1 and name in done.stderr, done.stderr
