"""Make tests/data/llama32_tiny/: a tiny Llama 3.2-style model as Hugging Face files and as
GGUF files made by llama.cpp's own tools, with llama.cpp's outputs on them as oracle JSON.

This is how the committed files were made (see tests/data/README.md); CI only reads them. It
needs what CI lacks: llama.cpp's source tree (convert_hf_to_gguf.py, its gguf-py, the vocabulary
file models/ggml-vocab-llama-bpe.gguf and the chat template models/templates/), llama.cpp's
llama-quantize, and an oracle program built against libllama (ORACLE below), plus torch and
transformers.

    python tests/data/make_llama32_tiny.py --llama-cpp /path/to/llama.cpp \\
        --quantize /path/to/llama-quantize --oracle /path/to/oracle

Steps:
  1. tokenizer: the real Llama 3 BPE vocabulary cut to its first BASE ranks (all 256 byte
     tokens among them) and the merges among those, Llama 3.2's 256 special tokens renumbered
     after them (Hugging Face's names, `<|begin_of_text|>` = BASE), Llama 3's pre-tokenizer
     (Split on Meta's regex + ByteLevel) and post-processor (BOS first), written with the
     `tokenizers` library; tokenizer_config.json with Llama 3.2 Instruct's chat template;
  2. model: transformers' LlamaForCausalLM from a Llama 3.2-style LlamaConfig (llama3 RoPE
     scaling, factor 32, rope_theta 500000, GQA, tied embeddings), trained for a few minutes
     on a short text of its own (CORPUS, also written out as corpus.txt) so that greedy
     decoding continues it with clear margins, saved as bfloat16 safetensors (as Meta ships
     Llama 3.2);
  3. convert_hf_to_gguf.py --outtype f32 (it writes the llama3 scaling as rope_freqs.weight).
     The converter names the pre-tokenizer by hashing its tokenization of a test string and
     refuses a hash it does not know; this restricted vocabulary tokenizes that string
     differently from Llama 3's, so its `get_vocab_base_pre` alone is replaced by one that
     answers "llama-bpe" (the name it gives the real Llama 3 tokenizer). Nothing else of the
     converter is changed;
  4. llama-quantize the F32 file to Q4_K_M, Q5_K_M, Q6_K, Q3_K_M, Q2_K (2 threads), and
     (with --allow-requantize) widen the Q4_K_M file back to F32: its exact dequantized
     weights, for an oracle with f32 arithmetic;
  5. ORACLE on each GGUF: llama.cpp's prompt ids and greedy continuation (32 tokens, argmax,
     no penalties) with the top-2 logit margin at each step; and llama.cpp's tokenization of
     the test strings with the tiny vocabulary;
  6. the F32 file gzipped (`gzip -n -9`: no name or time inside; the quantized files hardly
     compress and stay as they are); the Q4_K_M-as-F32 file deleted (its outputs are kept);
  7. llama.cpp's models/ggml-vocab-llama-bpe.gguf (gzipped) and its tokenizer test
     ggml-vocab-llama-bpe.gguf.inp/.out copied beside this script.

ORACLE is a small C++ program (not part of jllama, not committed) linked against llama.cpp's
libllama, built for x86-64-v3 (AVX2, FMA, F16C; bench/build_llamacpp.sh with
JLLAMA_LLAMACPP_ARCH=x86-64-v3): the -march=native build of the same source crashed (SIGSEGV in
ggml's AMX matrix product, ggml_backend_amx_mul_mat) on the Q3_K..Q6_K files on a CPU with AMX.
`oracle greedy MODEL N PROMPT_FILE` tokenizes the prompt with llama_tokenize
(add_special=true, parse_special=false), runs llama_decode on the prompt as one batch and then
one token at a time (n_ctx 512, 2 threads, CPU, an f32 KV cache (type_k = type_v = F32) and no
flash attention, so that nothing but the weights' and activations' quantization departs from
f32 arithmetic), takes the argmax of llama_get_logits_ith(-1)
each step, stops early at an end-of-generation token (llama_vocab_is_eog), and prints JSON
{prompt_ids, generated_ids, margins (best minus second-best logit), top_logits,
stopped_at_eog}. `oracle tokenize MODEL FILE` (vocab_only) prints, per string of a ".inp"
file, llama_tokenize's ids with add_special=false, parse_special=false, a tab, then the ids
with parse_special=true.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "llama32_tiny"

BASE = 1024
"""Base vocabulary size: Llama 3's ranks 0..BASE-1."""

# Llama 3.2's special tokens in id order as its Hugging Face tokenizer.json names them.
SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
] + [f"<|reserved_special_token_{k}|>" for k in range(3, 248)]
assert len(SPECIAL_TOKENS) == 256
BOS = BASE + SPECIAL_TOKENS.index("<|begin_of_text|>")
EOS_IDS = [BASE + SPECIAL_TOKENS.index(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
EOT = BASE + SPECIAL_TOKENS.index("<|eot_id|>")

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Meta's pre-tokenizer regex, the Split pattern of Llama 3's tokenizer.json."""

CONFIG = dict(
    vocab_size=BASE + 256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
    attention_bias=False, mlp_bias=False, bos_token_id=BOS, eos_token_id=EOS_IDS,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
"""Llama 3.2 1B's config.json with the sizes cut down (K-quants need rows of 256k)."""
SEED = 32

QUANTS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K")
PROMPTS = (
    "The quick brown fox jumps over the lazy dog. Then it",
    "Once upon a time, in a small village by the sea, there lived",
)
"""Beginnings of CORPUS's lines."""
N_PREDICT = 32

TOKENIZE_STRINGS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", "Hello world", " Hello World!", "Hello, world!",
    "I'M sure they'll say we'VE done it, don't", "1234567 3.14159 12,345", "a  b   c    d",
    "line\r\nbreak\r\n\r\nend", "def f(x):\n    return x ** 2\n", "naïve café Ünïcödé",
    "Привет, мир", "日本語のテキスト", "🦙 emoji 👩‍👩‍👧", "\u00a0nbsp\u3000ideographic",
    "<|begin_of_text|>", "user <|eot_id|> more<|eom_id|>",
    "<|start_header_id|>user<|end_header_id|>\n\nHi", "<|eot_id", "x'ſab",
    "   leading and trailing   ", "The quick brown fox jumps over the lazy dog.",
]


def vocab_from_gguf(llama_cpp: Path) -> tuple[list[str], list[str]]:
    """(the first BASE tokens, the merges among them) of llama.cpp's Llama 3 vocabulary."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    import gguf

    reader = gguf.GGUFReader(llama_cpp / "models" / "ggml-vocab-llama-bpe.gguf")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = reader.fields["tokenizer.ggml.merges"].contents()
    assert all(t == gguf.TokenType.NORMAL for t in types[:BASE])
    keep = set(tokens[:BASE])
    kept = []
    for merge in merges:
        left, right = merge.split(" ", 1)
        if left in keep and right in keep and left + right in keep:
            kept.append(merge)
    return tokens[:BASE], kept


def write_tokenizer(folder: Path, llama_cpp: Path) -> None:
    from tokenizers import (
        AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors,
    )

    tokens, merges = vocab_from_gguf(llama_cpp)
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=[tuple(m.split(" ", 1)) for m in merges],
        ignore_merges=True,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bot = SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{bot}:0 $A:0", pair=f"{bot}:0 $A:0 {bot}:1 $B:1", special_tokens=[(bot, BOS)]
        ),
    ])
    tok.save(str(folder / "tokenizer.json"))
    template = (llama_cpp / "models" / "templates" / "meta-llama-Llama-3.2-3B-Instruct.jinja")
    # As Meta's Llama 3.2 Instruct folder: BOS <|begin_of_text|>, EOS <|eot_id|>.
    config = {
        "bos_token": bot, "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template.read_text(encoding="utf-8"),
    }
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(folder / "special_tokens_map.json", {"bos_token": bot, "eos_token": "<|eot_id|>"})
    _write_json(folder / "generation_config.json", {
        "bos_token_id": BOS, "eos_token_id": EOS_IDS, "do_sample": True, "temperature": 0.6,
        "top_p": 0.9,
    })


CORPUS = """\
The quick brown fox jumps over the lazy dog. Then it runs into the green forest, where the tall \
trees stand in long rows and the birds sing from dawn to dusk.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. \
Every morning he went out in his little boat, and every evening he came home with a basket full \
of fish.
One day he caught a golden fish that could speak. "Let me go," said the fish, "and I will give \
you whatever you wish for." The fisherman was kind, so he let the fish swim away and asked for \
nothing.
When he told his wife, she was angry. "Go back to the sea," she said, "and ask the fish for a \
new house." So the old man walked to the shore and called the fish by its name.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten. Colors: red, orange, \
yellow, green, blue, violet. Days: Monday, Tuesday, Wednesday, Thursday, Friday.
"""
"""The text the model is trained on (written for this fixture), so that its greedy
continuations are text and their top-2 margins are several logits wide."""
TRAIN = dict(steps=500, batch=8, window=64, lr=3e-3)


def write_model(folder: Path) -> None:
    """transformers' LlamaForCausalLM (its own init, initializer_range 0.02) trained on CORPUS
    until it has learnt it (AdamW, next-token loss on random windows of its lines, each line
    after a BOS), saved as bfloat16."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # Each line after its own BOS, as a prompt that begins the line will come.
    ids = torch.tensor([i for line in CORPUS.splitlines(keepends=True)
                        for i in tokenizer.encode(line).ids])
    config = LlamaConfig(**CONFIG)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=TRAIN["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(SEED)
    window = TRAIN["window"]
    for step in range(TRAIN["steps"]):
        starts = torch.randint(0, len(ids) - window, (TRAIN["batch"],), generator=gen)
        batch = torch.stack([ids[s:s + window] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == TRAIN["steps"] - 1:
            print(f"train step {step}: loss {loss.item():.4f}", flush=True)
    model.eval().to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)


_CONVERT = """
import sys, runpy
llama_cpp = sys.argv.pop(1)
sys.path.insert(0, llama_cpp + "/gguf-py")
sys.path.insert(0, llama_cpp)
import conversion.base as base
# The only change: name the pre-tokenizer "llama-bpe" instead of looking its hash up.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
sys.argv[0] = llama_cpp + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(hf: Path, out: Path, llama_cpp: Path) -> None:
    subprocess.run(
        [sys.executable, "-c", _CONVERT, str(llama_cpp), str(hf), "--outtype", "f32",
         "--outfile", str(out)],
        check=True,
    )


def tensor_types(path: Path) -> dict[str, str]:
    import gguf

    reader = gguf.GGUFReader(path)
    return {t.name: t.tensor_type.name for t in reader.tensors}


def oracle_greedy(oracle: Path, model: Path, prompt: str, tmp: Path) -> dict:
    prompt_file = tmp / "prompt.txt"
    prompt_file.write_bytes(prompt.encode("utf-8"))
    done = subprocess.run(
        ["nice", str(oracle), "greedy", str(model), str(N_PREDICT), str(prompt_file)],
        check=True, capture_output=True, text=True,
    )
    return {"prompt": prompt, **json.loads(done.stdout)}


def oracle_tokenize(oracle: Path, model: Path, tmp: Path) -> list[dict]:
    sep = "\n__ggml_vocab_test__\n"
    inp = tmp / "strings.inp"
    inp.write_bytes("".join(s + sep for s in TOKENIZE_STRINGS).encode("utf-8"))
    done = subprocess.run(
        [str(oracle), "tokenize", str(model), str(inp)], check=True, capture_output=True
    )
    lines = done.stdout.decode("utf-8").split("\n")[: len(TOKENIZE_STRINGS)]
    cases = []
    for text, line in zip(TOKENIZE_STRINGS, lines, strict=True):
        plain, special = line.split("\t")
        cases.append({
            "text": text,
            "ids": [int(x) for x in plain.split()],
            "ids_parse_special": [int(x) for x in special.split()],
        })
    return cases


def gzip_file(path: Path) -> Path:
    subprocess.run(["gzip", "-n", "-9", "-f", str(path)], check=True)
    return path.with_name(path.name + ".gz")


def _write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--quantize", type=Path, required=True, help="llama-quantize binary")
    parser.add_argument("--oracle", type=Path, required=True, help="the oracle program")
    args = parser.parse_args()

    if OUT.exists():
        shutil.rmtree(OUT)
    hf = OUT / "hf"
    hf.mkdir(parents=True)
    write_tokenizer(hf, args.llama_cpp)
    write_model(hf)
    (OUT / "corpus.txt").write_text(CORPUS, encoding="utf-8")

    name = "llama32-tiny"
    f32 = OUT / f"{name}-F32.gguf"
    convert(hf, f32, args.llama_cpp)
    files = {"F32": f32}
    for q in QUANTS:
        files[q] = OUT / f"{name}-{q}.gguf"
        subprocess.run(["nice", str(args.quantize), str(f32), str(files[q]), q, "2"],
                       check=True, capture_output=True)
    widened = OUT / f"{name}-Q4_K_M-as-F32.gguf"
    subprocess.run(["nice", str(args.quantize), "--allow-requantize", str(files["Q4_K_M"]),
                    str(widened), "F32", "2"], check=True, capture_output=True)
    files["Q4_K_M-as-F32"] = widened

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        oracle = {
            "about": (
                "llama.cpp (the source tree of llama-cpp-python 0.3.36's vendor/llama.cpp, CPU "
                "build for x86-64-v3: AVX2, FMA, F16C, no AVX-512 or AMX) on the GGUF files of "
                "this folder, through the oracle "
                "program described in tests/data/make_llama32_tiny.py. greedy[file]: raw "
                "completion of each prompt (BOS added, no chat template), f32 KV cache, no "
                "flash attention, argmax, no penalties, "
                f"{N_PREDICT} tokens or up to an end-of-generation token; margins[i] is "
                "llama.cpp's best minus second-best logit at generated token i. On the "
                "quantized files llama.cpp multiplies by 8-bit-quantized activations (Q8_K), "
                "so its logits differ from f32 arithmetic on the dequantized weights; "
                "Q4_K_M-as-F32 is the Q4_K_M file widened to F32 by llama-quantize "
                "--allow-requantize (the exact dequantized weights, f32 arithmetic). "
                "tokenize: llama_tokenize of each string on the F32 file's vocabulary without "
                "BOS, with parse_special false (ids) and true (ids_parse_special)."
            ),
            "tensor_types": {k: tensor_types(p) for k, p in files.items()},
            "greedy": {
                k: [oracle_greedy(args.oracle, p, prompt, tmp) for prompt in PROMPTS]
                for k, p in files.items()
            },
            "tokenize": oracle_tokenize(args.oracle, f32, tmp),
        }
    _write_json(OUT / "llamacpp.json", oracle)
    widened.unlink()  # its weights are the Q4_K_M file's, dequantized: only its outputs are kept
    gzip_file(f32)  # the quantized files hardly compress (5%): they stay as they are

    # llama.cpp's Llama 3 vocabulary and its tokenizer test (inputs, expected ids), as shipped
    models = args.llama_cpp / "models"
    vocab = HERE / "ggml-vocab-llama-bpe.gguf"
    shutil.copyfile(models / vocab.name, vocab)
    gzip_file(vocab)
    for suffix in (".inp", ".out"):
        shutil.copyfile(models / (vocab.name + suffix), HERE / (vocab.name + suffix))

    for path in [*sorted(OUT.rglob("*")), *sorted(HERE.glob("ggml-vocab-llama-bpe.gguf*"))]:
        if path.is_file():
            print(f"{path.stat().st_size:>9}  {path.relative_to(HERE)}")


if __name__ == "__main__":
    main()
