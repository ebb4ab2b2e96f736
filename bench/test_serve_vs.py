"""bench/serve_vs.py's own logic without a server: the two servers' settings (the same context
per slot), the requests (greedy, 64 tokens, end-of-text ignored), the names of its models and
the ratios it reports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import serve_load
import serve_vs
from cli import BenchError


def test_llama_server_gets_each_slot_the_context_of_a_jllama_slot():
    argv = serve_vs.llama_server_argv(Path("/b/llama-server"), Path("/m.gguf"), 8123, 8, 4096, 2)
    assert argv == ["/b/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8123",
                    "-np", "8", "-c", "32768", "-t", "2", "--no-webui"]


def test_requests_are_greedy_fixed_length_chats():
    body = serve_vs.chat_body("m", 5, 64)
    assert body["temperature"] == 0 and body["max_tokens"] == 64 and body["ignore_eos"] is True
    assert body["messages"] == [{"role": "user", "content": serve_vs.CHAT_PROMPTS[1]}]
    assert body["stream_options"] == {"include_usage": True}
    # the client reads a chat chunk's delta as a completion chunk's text
    assert serve_load._piece({"delta": {"content": "Hi"}}) == "Hi"
    assert serve_load._piece({"text": "Hi"}) == "Hi"
    assert serve_load._piece({"delta": {}}) == ""


def test_model_names(tmp_path):
    assert serve_vs.resolve_model("/x/a.gguf", tmp_path) == Path("/x/a.gguf")
    assert serve_vs.resolve_model("smollm2-Q4_K_M", tmp_path) == tmp_path / "smollm2-Q4_K_M.gguf"
    assert serve_vs.resolve_model("1B-Q4_K_M", tmp_path).name == "Llama-3.2-1B-random-Q4_K_M.gguf"
    with pytest.raises(BenchError, match="'2B-Q4_K_M' is not a .gguf path"):
        serve_vs.resolve_model("2B-Q4_K_M", tmp_path)


def test_summaries_pair_repetitions():
    def load(rep, server, tok_s, clients=8):
        return {"metric": "load", "rep": rep, "model": "m", "server": server, "clients": clients,
                "tokens_per_s": tok_s}

    lines = [{"metric": "meta"}, load(1, "jllama", 220.0), load(1, "llama-server", 200.0),
             load(2, "jllama", 180.0), load(2, "llama-server", 200.0),
             load(1, "jllama", 100.0, clients=16)]
    (summary,) = serve_vs.summaries(lines)
    assert summary["clients"] == 8 and summary["ratios"] == [1.1, 0.9]
    assert summary["ratio_median"] == pytest.approx(1.0)
    assert summary["jllama_tokens_per_s"] == 200.0 and summary["llama_server_tokens_per_s"] == 200.0
