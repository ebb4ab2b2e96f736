"""`jllama perplexity` and `jllama.generation.perplexity`, against references that do not use them:

  - a tiny random Llama built and saved by transformers, with a byte-level BPE tokenizer
    trained by `tokenizers`: the perplexity worked out here with torch (transformers' logits,
    log_softmax, llama-perplexity's chunks and second-half rule, the error formula written
    out) on `tokenizers`' own ids, compared with the command's JSON;
  - llama.cpp's llama-perplexity on SmolLM2 (tests/data/smollm2_perplexity_llamacpp.json);
  - the chunking rules and the statistics on examples worked out by hand;
  - one-line errors with a non-zero exit for bad input.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import load_json
from hf_models import Spec, build, save
from test_cli import REPO, run

from jllama.generation import perplexity as ppl

tokenizers = pytest.importorskip("tokenizers")

TEXT_FILE = REPO / "bench" / "data" / "alice_wonderland_ch1-4.txt"
# The HF model's text: the first paragraphs of the benchmark text, newline-terminated (the
# command drops one final newline, as llama-perplexity's -f does).
TEXT = TEXT_FILE.read_text()[:600].rsplit(" ", 1)[0] + "\n"


def _train_tokenizer(with_bos: bool) -> tokenizers.Tokenizer:
    """A GPT-2 style byte-level BPE trained on TEXT, "<s>" and "</s>" its specials; with_bos:
    a post-processor that puts <s> first, as Llama's tokenizer.json files do."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    if with_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def _llama_spec(vocab_size: int) -> Spec:
    return Spec("ppl", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab_size,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
    }, seed=5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"bos": ..., "nobos": ...}: (folder, transformers model, tokenizers.Tokenizer); the
    same weights, one vocabulary adding BOS and one not."""
    out, model = {}, None
    for name, with_bos in (("bos", True), ("nobos", False)):
        tok = _train_tokenizer(with_bos)
        spec = _llama_spec(tok.get_vocab_size())
        model = model or build(spec)
        folder = save(model, spec, tmp_path_factory.mktemp(name))
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": with_bos}
        ))
        out[name] = (folder, model, tok)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT)
    return path


def reference(model, ids: list[int], ctx: int, bos: int | None, chunks: int = -1) -> dict:
    """llama-perplexity's procedure on transformers' logits: chunks of ctx ids (as many as
    fit, or `chunks`), each run from position 0 with its first id replaced by bos, the
    predictions at positions ctx//2 .. ctx-2 scored by log_softmax in float64; PPL =
    exp(mean NLL), error = sqrt((mean(NLL^2) - mean^2) / (count - 1)) * PPL."""
    n = len(ids) // ctx if chunks == -1 else min(chunks, len(ids) // ctx)
    first = ctx // 2
    nlls, running = [], []
    for i in range(n):
        chunk = ids[i * ctx:(i + 1) * ctx]
        fed = ([bos] + chunk[1:]) if bos is not None else chunk
        with torch.no_grad():
            logits = model(torch.tensor([fed])).logits[0].to(torch.float64)
        logp = torch.log_softmax(logits, dim=-1)
        nlls += [-float(logp[j, chunk[j + 1]]) for j in range(first, ctx - 1)]
        running.append(math.exp(sum(nlls) / len(nlls)))
    nll = torch.tensor(nlls, dtype=torch.float64)
    mean = float(nll.mean())
    spread = float((nll * nll).mean()) - mean * mean
    value = math.exp(mean)
    return {"ppl": value, "ppl_error": math.sqrt(spread / (len(nlls) - 1)) * value,
            "mean_nll": mean, "chunks": n, "tokens_scored": len(nlls), "chunk_ppl": running}


def _rounded_to_bf16(model):
    """A copy of `model` with its matrices rounded to bfloat16 (the norm gains kept, as
    --dtype=bfloat16 keeps them float32)."""
    import copy

    twin = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in twin.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(param.to(torch.bfloat16).to(torch.float32))
    return twin


@pytest.mark.parametrize("vocab, backend, ctx, chunks, dtype", [
    ("bos", "jax", 16, -1, "auto"),  # 8-token chunk programs only
    ("bos", "jax", 15, -1, "bfloat16"),  # a chunk program + 7 tokens through forward; odd ctx
    ("nobos", "numpy", 15, 3, "auto"),
], ids=["bos-jax-16", "bos-jax-15-bf16", "nobos-numpy-15-chunks3"])
def test_matches_transformers_by_hand(folders, text_file, vocab, backend, ctx, chunks, dtype):
    folder, model, tok = folders[vocab]
    ids = tok.encode(TEXT.removesuffix("\n")).ids
    bos = tok.token_to_id("<s>") if vocab == "bos" else None
    assert (ids[0] == bos) == (vocab == "bos")
    oracle = reference(_rounded_to_bf16(model) if dtype == "bfloat16" else model, ids, ctx, bos,
                       chunks)
    assert oracle["chunks"] >= 3
    done = run("perplexity", f"--checkpoint={folder}", f"--file={text_file}", f"--ctx={ctx}",
               f"--chunks={chunks}", f"--backend={backend}", f"--dtype={dtype}",
               "--output_format=json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["tokens"] == len(ids)
    assert (out["ctx"], out["chunks"], out["tokens_scored"]) == (
        ctx, oracle["chunks"], oracle["chunks"] * (ctx - 1 - ctx // 2))
    assert out["ppl"] == pytest.approx(oracle["ppl"], rel=1e-4)
    assert out["ppl_error"] == pytest.approx(oracle["ppl_error"], rel=1e-3)
    assert out["mean_nll"] == pytest.approx(oracle["mean_nll"], rel=1e-4)
    assert out["chunk_ppl"] == pytest.approx(oracle["chunk_ppl"], rel=1e-4)
    assert out["dtype"] == ("bfloat16" if dtype == "bfloat16" else "float32")
    assert out["backend"] == backend and out["file"] == str(text_file)
    assert out["seconds"] > 0 and out["tokens_per_second"] > 0


def test_text_output_is_llama_perplexity_final_line(folders, text_file):
    folder, model, tok = folders["bos"]
    oracle = reference(model, tok.encode(TEXT.removesuffix("\n")).ids, 16,
                       tok.token_to_id("<s>"), chunks=2)
    done = run("perplexity", f"--checkpoint={folder}", f"--file={text_file}", "--ctx=16",
               "--chunks=2")
    assert done.returncode == 0, done.stderr
    import re

    found = re.fullmatch(r"Final estimate: PPL = ([0-9]+\.[0-9]{4}) \+/- ([0-9]+\.[0-9]{5})\n",
                         done.stdout)
    assert found, done.stdout
    assert float(found[1]) == pytest.approx(oracle["ppl"], rel=1e-4)
    assert float(found[2]) == pytest.approx(oracle["ppl_error"], rel=1e-3)
    # and llama-perplexity's running values on stderr: [1]x,[2]y,
    running = re.search(r"^\[1\]([0-9.]+),\[2\]([0-9.]+),$", done.stderr, re.MULTILINE)
    assert running, done.stderr
    assert [float(v) for v in running.groups()] == pytest.approx(oracle["chunk_ppl"], rel=1e-4)


SMOLLM2_PPL = "smollm2_perplexity_llamacpp.json"


def test_smollm2_matches_llama_perplexity(smollm2_gguf):
    """SmolLM2's Q4_1 weights dequantized to f32 against llama-perplexity on the same weights
    widened to F32, with f32 attention and cache (see the oracle's `about`)."""
    from jllama.backends import make_backend
    from jllama.model.loading import open_model

    oracle = load_json(SMOLLM2_PPL)
    assert (REPO / oracle["text"]) == TEXT_FILE
    # ctx 128: two 64-token chunk programs; 65: one and a token through forward, odd ctx
    # (the oracle's ctx 101 case, four 8-token chunks and 5 forwards, is slow on 2 cores)
    cases = [case for case in oracle["f32"] if case["ctx"] in (128, 65)]
    assert len(cases) == 2
    longest = max(case["ctx"] for case in cases)
    model = open_model(smollm2_gguf, seq_len=longest, dtype="float32")  # the widened weights
    backend = make_backend("jax", decode="graph")
    backend.prepare(model.config, model.weights)
    tokens = model.tokenizer.encode(ppl.read_text(TEXT_FILE))
    assert not model.tokenizer.add_bos
    for case in cases:
        got = ppl.perplexity(backend.prefill_logits, tokens, case["ctx"], bos_id=None,
                             chunks=case["chunks"], n_vocab=model.tokenizer.vocab_size)
        assert got.chunks == case["chunks"]
        # llama.cpp prints 4 and 5 decimals; beyond that rounding, f32 sums in another order
        # (XLA's CPU codegen differs by machine: CI's gave 68.31409 for 68.3143) move a
        # perplexity by a few parts per million, so the bound is the larger of the two
        assert got.estimate.ppl == pytest.approx(case["ppl"], rel=5e-6, abs=2e-4), case
        assert got.estimate.ppl_error == pytest.approx(case["ppl_error"], rel=5e-6,
                                                       abs=2e-5), case
        assert got.chunk_ppl == pytest.approx(case["chunk_ppl"], rel=5e-6, abs=2e-4), case


# ---------------------------------------------------------------- the rules, worked by hand

def test_chunks_of_a_hand_worked_example():
    tokens = list(range(100, 123))  # 23 tokens
    # ctx 5: 23 // 5 = 4 chunks (the last 3 tokens unused); first = 2, positions 2..3 scored,
    # predicting the chunk's tokens at 3 and 4.
    assert ppl.chunk_count(23, 5) == 4
    assert ppl.chunk_count(23, 5, chunks=2) == 2
    assert ppl.chunk_count(23, 5, chunks=9) == 4
    assert ppl.first_scored(5) == 2 and ppl.first_scored(6) == 3 and ppl.first_scored(3) == 1
    assert ppl.chunk_inputs(tokens, 5, 1, bos_id=1) == [1, 106, 107, 108, 109]
    assert ppl.chunk_inputs(tokens, 5, 1, bos_id=None) == [105, 106, 107, 108, 109]
    assert ppl.chunk_targets(tokens, 5, 1) == [108, 109]
    # ctx 6: first = 3, positions 3..4 scored, predicting the tokens at 4 and 5
    assert ppl.chunk_targets(tokens, 6, 2) == [116, 117]
    # the first chunk's first token is the BOS itself: the replaced token is never a target
    assert ppl.chunk_inputs(tokens, 3, 0, bos_id=7) == [7, 101, 102]
    assert ppl.chunk_targets(tokens, 3, 0) == [102]
    # at least 2 * ctx tokens
    assert ppl.chunk_count(10, 5) == 2
    with pytest.raises(ppl.PerplexityError, match=r"^the text is 9 tokens, fewer than the 10 "):
        ppl.chunk_count(9, 5)


def test_the_driver_feeds_each_chunk_from_position_0_with_bos():
    calls = []

    def uniform(tokens, start_pos, first):  # logits equal over 4 ids: every NLL is log 4
        calls.append((list(tokens), start_pos, first))
        return np.zeros((len(tokens) - first, 4), np.float32)

    tokens = [i % 4 for i in range(1, 24)]  # 1 2 3 0 1 | 2 3 0 1 2 | 3 0 1 2 3 | ...
    got = ppl.perplexity(uniform, tokens, ctx=5, bos_id=0, chunks=3)
    assert calls == [([0, 2, 3, 0, 1], 0, 2), ([0, 3, 0, 1, 2], 0, 2),
                     ([0, 0, 1, 2, 3], 0, 2)]
    assert (got.chunks, got.ctx, got.tokens, got.estimate.count) == (3, 5, 23, 6)
    assert got.estimate.ppl == pytest.approx(4.0, rel=1e-12)
    assert got.estimate.mean_nll == pytest.approx(math.log(4), rel=1e-12)
    assert got.estimate.ppl_error == pytest.approx(0.0, abs=1e-6)  # no spread but rounding


def test_n_vocab_leaves_padding_logits_out():
    def padded(tokens, start_pos, first):  # ids 0..1 equal, 2..3 padding that would weigh in
        rows = np.zeros((len(tokens) - first, 4), np.float32)
        rows[:, 2:] = 5.0
        return rows

    got = ppl.perplexity(padded, [0, 1, 0, 1, 0, 1], ctx=3, n_vocab=2)
    assert got.estimate.ppl == pytest.approx(2.0, rel=1e-12)


def test_token_nlls_by_hand_and_against_torch():
    # softmax of [0, log 3] is [1/4, 3/4]
    got = ppl.token_nlls(np.array([[0.0, math.log(3)], [0.0, math.log(3)]], np.float32), [1, 0])
    assert got.dtype == np.float64
    assert got == pytest.approx([-math.log(0.75), -math.log(0.25)], rel=1e-6)
    logits = np.random.default_rng(3).normal(0, 8, (5, 1000)).astype(np.float32)
    targets = [0, 17, 999, 500, 3]
    expected = -torch.log_softmax(torch.from_numpy(logits).double(), -1)[range(5), targets]
    assert ppl.token_nlls(logits, targets) == pytest.approx(expected.numpy(), rel=1e-6)


def test_estimate_by_hand():
    # NLLs 1, 2, 3: mean 2, mean of squares 14/3, variance 2/3, error sqrt(1/3) e^2
    got = ppl.estimate([1.0, 2.0, 3.0])
    assert got.ppl == pytest.approx(math.exp(2), rel=1e-12)
    assert got.ppl_error == pytest.approx(math.sqrt(1 / 3) * math.exp(2), rel=1e-12)
    assert (got.mean_nll, got.count) == (2.0, 3)
    assert math.isnan(ppl.estimate([2.0]).ppl_error)  # one token: no error estimate
    with pytest.raises(ValueError):
        ppl.estimate([])


def test_read_text_drops_one_final_newline(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"ab\n\n")
    assert ppl.read_text(path) == "ab\n"
    path.write_bytes("caf\u00e9\r\n".encode())
    assert ppl.read_text(path) == "caf\u00e9\r"


@pytest.mark.parametrize("data, message", [
    (b"", r"^--file=T: the text is empty$"),
    (b"\n", r"^--file=T: the text is empty$"),
    (b"ab\xff\xfe", r"^--file=T: not UTF-8 text \(invalid start byte at byte 2\)$"),
    (None, r"^--file=T: is a directory, not a file$"),
])
def test_read_text_errors(tmp_path, data, message):
    path = tmp_path / "t.txt"
    if data is None:
        path.mkdir()
    else:
        path.write_bytes(data)
    with pytest.raises(ppl.PerplexityError, match=message):
        ppl.read_text(path, what="--file=T")


@pytest.mark.parametrize("ctx, context, match", [
    (2, 64, r"^ctx=2 must be at least 3"),
    (65, 64, r"^ctx=65 is more than the model's context \(64 tokens\)$"),
])
def test_check_ctx(ctx, context, match):
    with pytest.raises(ppl.PerplexityError, match=match):
        ppl.check_ctx(ctx, context)
    assert ppl.check_ctx(3, 64) == 3 and ppl.check_ctx(64, 64) == 64


@pytest.mark.parametrize("chunks", [0, -2])
def test_check_chunks(chunks):
    with pytest.raises(ppl.PerplexityError, match=rf"^chunks={chunks} must be at least 1"):
        ppl.check_chunks(chunks)


def test_a_line_per_chunk_where_stderr_is_not_a_terminal():
    """Without a terminal (a log, a pipe: here a captured stderr) the progress bar stays off,
    so each chunk says its running PPL in a line of its own, as llama-perplexity prints each
    chunk's value as it goes; the values are those of the final [1]x,[2]y,[3]z, line."""
    import re

    done = run("perplexity", f"--file={TEXT_FILE}", "--ctx=64", "--chunks=3", "--backend=numpy")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    chunks = [re.fullmatch(r"jllama: chunk (\d+)/3: PPL so far ([0-9.]+) \([0-9.]+ s\)", line)
              for line in lines]
    found = [m for m in chunks if m]
    assert [int(m[1]) for m in found] == [1, 2, 3], done.stderr
    summary = lines.index(next(line for line in lines if line.startswith("[1]")))
    assert all(lines.index(m[0]) < summary for m in found)  # as they come, before the summary
    values = re.findall(r"\[\d\]([0-9.]+),", lines[summary])
    assert [m[2] for m in found] == values


# ------------------------------------------------------------------------- bad input, CLI

@pytest.mark.parametrize("make, args, message", [
    (None, [], r"perplexity needs --file=TEXT"),
    (None, ["--file={tmp}/absent.txt"], r"--file=\S+/absent.txt: no such file"),
    (b"Once upon a time.\n", ["--file={file}", "--ctx=16"],
     r"--file=\S+ is 6 tokens, fewer than the 32 that --ctx=16 needs \(2 \* --ctx, as "
     r"llama-perplexity\): give a longer text or a smaller --ctx$"),
    (b"x", ["--file={file}", "--ctx=513"], r"--ctx=513 is more than the model's context \(512"),
    (b"x", ["--file={file}", "--chunks=0"], r"--chunks=0 must be at least 1, or -1 for all"),
], ids=["no-file", "missing", "too-short", "ctx-513", "chunks-0"])
def test_bad_input_is_one_line(tmp_path, make, args, message):
    import re

    file = tmp_path / "text.txt"
    if make is not None:
        file.write_bytes(make)
    done = run("perplexity", *[a.format(tmp=tmp_path, file=file) for a in args])
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"jllama: error: .*", lines[0]), done.stderr
    assert re.search(message, lines[0]), lines[0]
