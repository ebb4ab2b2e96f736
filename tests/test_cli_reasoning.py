"""`jllama --mode=chat` with a thinking model: --reasoning=show|hide and --enable_thinking.

Model: the tiny random Llama 3.2 test model (a copy of its folder) with Qwen3-0.6B's real chat
template, changed as Qwen3-Thinking-2507's is to open `<think>` at the end of the prompt, unless
enable_thinking is false (then Qwen3's empty closed block). The reply is made a think block and
an answer by --regex (a random model never writes `</think>` by itself).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from test_cli import REPO, jllama_command

DATA = Path(__file__).parent / "data"
LLAMA32_TINY = DATA / "llama32_tiny" / "hf"
THINKING_TEMPLATE = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text().replace(
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}",
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- else %}\n"
    "        {{- '<think>\\n' }}\n    {%- endif %}", 1)
OPENED = "[a-z]{4,12}\n</think>\n\n[a-z]{3,12}"


def test_the_template_opens_think():
    assert THINKING_TEMPLATE.count("'<think>\\n' }}") == 1


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-thinking-tiny")
    for item in LLAMA32_TINY.iterdir():
        if item.name != "tokenizer_config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((LLAMA32_TINY / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chat(model: Path, regex: str, *flags: str) -> str:
    done = subprocess.run(
        jllama_command() + [f"--checkpoint={model}", "--mode=chat", "--prompt=Two and two?",
                            "--temperature=0", "--seq_len=256", f"--regex={regex}", *flags],
        input="", capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


def test_show_prints_the_block_and_hide_the_answer_alone(thinking_model):
    shown = chat(thinking_model, OPENED)  # --reasoning=show is the default
    match = re.fullmatch("<think>\n([a-z]+)\n</think>\n\n([a-z]+)", shown)
    assert match, shown  # the template's `<think>\n` printed before the reply
    assert chat(thinking_model, OPENED, "--reasoning=hide") == match.group(2)


def test_noenable_thinking_reaches_the_template(thinking_model):
    # Thinking off: the prompt ends with a closed block, so the whole reply is the answer
    # (were the flag lost, the reply would be reasoning, and hidden).
    answer = chat(thinking_model, "[a-z]{3,12}", "--reasoning=hide", "--noenable_thinking")
    assert re.fullmatch("[a-z]{3,12}", answer)


def test_serve_flags(thinking_model):
    """`jllama serve --reasoning_format=none --noenable_thinking`: replies keep their tags in
    the content, and the template gets enable_thinking false unless a request says otherwise."""
    from serving import openai_client

    process = subprocess.Popen(
        jllama_command() + ["serve", "--port=0", f"--checkpoint={thinking_model}",
                            "--seq_len=256", "--parallel=1", "--no_webui",
                            "--reasoning_format=none", "--noenable_thinking"],
        stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        url, lines = None, []
        while process.poll() is None and len(lines) < 50:
            lines.append(process.stderr.readline())
            if "serving " in lines[-1]:
                url = lines[-1].split(" at ")[1].split()[0]
                break
        assert url, lines
        with openai_client(url) as client:
            def ask(**extra):
                return client.chat.completions.create(
                    model=thinking_model.name, messages=[{"role": "user", "content": "Hi"}],
                    temperature=0, extra_body={"structured_outputs": {"regex": "<think>\n"
                                               "[a-z]{4,12}\n</think>\n\n[a-z]{3,12}"},
                                               **extra})

            off = ask()
            assert re.fullmatch("<think>\n[a-z]+\n</think>\n\n[a-z]+",
                                off.choices[0].message.content)
            assert getattr(off.choices[0].message, "reasoning_content", None) is None
            # The server's enable_thinking=false renders Qwen3's empty block; a request's own
            # true opens the block in the prompt instead (this template), a shorter prompt.
            on = ask(chat_template_kwargs={"enable_thinking": True})
            assert on.usage.prompt_tokens < off.usage.prompt_tokens
            parsed = ask(reasoning_format="deepseek").choices[0].message
            assert parsed.reasoning_content and parsed.content
    finally:
        process.terminate()
        assert process.wait(30) == 0
