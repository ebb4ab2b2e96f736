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
        (["--top_k=many"], "--top_k"),
        (["--min_p=2"], "--min_p"),
        (["--repeat_penalty=0"], "--repeat_penalty"),
        (["--decode=loop", "--top_k=3"], "--top_k"),
        (["--decode=loop", "--samplers=top_k,top_p,min_p,temperature"], "--samplers"),
        (["--backend=numpy", "--decode=fused"], "--decode=fused"),
    ]:
        done = run(*args)
        assert done.returncode == 1, args
        assert done.stderr.count("\n") == 1 and name in done.stderr, done.stderr


def test_auto_decode_samples_on_the_host_with_another_order():
    """top_p before temperature (llama.cpp's order) is not run.c's rule, so --decode=auto
    must not pick the device loop: the story equals --decode=graph's, not the loop's."""
    common = ["--temperature=0.6", "--top_p=0.8", "--seed=11", "--steps=120"]
    args = ["--samplers=top_k,top_p,min_p,temperature", *common]
    auto, graph = run(*args), run(*args, "--decode=graph")
    assert auto.returncode == 0 and auto.stdout == graph.stdout
    assert run(*common).stdout != graph.stdout  # the order matters at this temperature
