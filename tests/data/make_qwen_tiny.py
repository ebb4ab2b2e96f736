"""Make tests/data/qwen_tiny/: tiny Qwen2.5-, Qwen3- and Mistral-style models
(`tests/qwen_models.py`'s SPECS) converted to GGUF by llama.cpp's own convert_hf_to_gguf.py,
with transformers' logits on them as the oracle (issue 36).

This is how the committed files were made; CI only reads them. It needs llama.cpp's source
tree (convert_hf_to_gguf.py with its conversion/ package and gguf-py) besides torch and
transformers:

    python tests/data/make_qwen_tiny.py --llama-cpp /path/to/llama.cpp

Steps:
  1. tokenizer.json: Qwen's byte-level BPE (tests/data/ggml-vocab-qwen2.gguf.gz, llama.cpp's
     copy of Qwen2's vocabulary) cut to its first BASE tokens and the merges among them, with
     Qwen3's added tokens after them (`SPECIAL_TOKENS`), Qwen's pre-tokenizer (Split on Qwen's
     regex, Isolated, + ByteLevel without its regex), NFC normalizer and ByteLevel decoder, as
     Qwen's own tokenizer.json; one tokenizer_config.json per model with its chat template
     (Qwen2.5-7B-Instruct's, Qwen3-0.6B's; none for the base Mistral);
  2. each model built by `hf_models.build` (seeded) and saved by save_pretrained (float32);
  3. convert_hf_to_gguf.py --outtype f32. Its pre-tokenizer check hashes the tokenization of a
     test string, which this cut vocabulary tokenizes otherwise than Qwen's, so only its
     `get_vocab_base_pre` is replaced by one that answers "qwen2" (the name it gives Qwen's
     tokenizer). qwen2 and qwen3 become those architectures, Mistral `llama` (its q/k rows
     permuted by the converter, as for any Llama);
  4. transformers' logits of each model for TOKENS (one full-sequence forward), float32, in
     oracle.npz; the GGUF files gzipped (`gzip -n -9`);
  5. with --bin (a llama.cpp build's bin/ holding llama-quantize and llama-simple): the qwen2
     and qwen3 F32 files quantized to Q8_0 and Q4_K_M (`llama-quantize F32 OUT TYPE 2`; rows
     of 64 and 96 are too short for the K-quants, so Q4_K_M's matrices fall back to Q5_0 and
     Q8_0 as llama-quantize chooses), kept as they are, and llama-simple's greedy output
     (`llama-simple -m FILE -n N_PREDICT PROMPT`: the prompt and N_PREDICT argmax tokens as
     text, then a newline) on each quantized and F32 file, in llamacpp.json; and
     `KQUANT_SPEC`, a Qwen3 with rows of 256 (converted as in step 3, quantized to Q4_K_M:
     Q4_K and Q6_K blocks), its Q4_K_M file and llama-simple's output on it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from qwen_models import (  # noqa: E402
    BASE, DATA, KQUANT_SPEC, SPECIAL_TOKENS, SPECS, TEMPLATES, TOKENS, gguf_path,
    tokenizer_files,
)

QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def vocab() -> tuple[list[str], list[str]]:
    """(Qwen's first BASE tokens, the merges among them)."""
    import gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen2.gguf"
        path.write_bytes(gzip.decompress((HERE / "ggml-vocab-qwen2.gguf.gz").read_bytes()))
        reader = gguf.GGUFReader(path)
        tokens = reader.fields["tokenizer.ggml.tokens"].contents()
        merges = reader.fields["tokenizer.ggml.merges"].contents()
    keep = set(tokens[:BASE])
    kept = [m for m in merges
            if (lambda l, r: l in keep and r in keep and l + r in keep)(*m.split(" ", 1))]
    return tokens[:BASE], kept


def write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    tokens, merges = vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    for name, template in TEMPLATES.items():
        config = {
            "add_bos_token": False, "add_prefix_space": False, "bos_token": None,
            "eos_token": "<|im_end|>" if template else "<|endoftext|>",
            "pad_token": "<|endoftext|>", "errors": "replace", "model_max_length": 131072,
            "clean_up_tokenization_spaces": False, "split_special_tokens": False,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if template:
            config["chat_template"] = (HERE / "templates" / template).read_text(encoding="utf-8")
        (out / f"{name}_tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


_CONVERT = """
import sys, runpy
llama_cpp = sys.argv.pop(1)
sys.path.insert(0, llama_cpp + "/gguf-py")
sys.path.insert(0, llama_cpp)
import conversion.base as base
# The only change: name the pre-tokenizer "qwen2" instead of looking its hash up.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv[0] = llama_cpp + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def main() -> None:
    import numpy as np
    from hf_models import build, hf_logits, save

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--bin", type=Path, help="llama.cpp's bin/ (llama-quantize, llama-simple)")
    parser.add_argument("--only-bin", action="store_true",
                        help="only step 5, on the F32 files already made")
    args = parser.parse_args()
    if args.only_bin:
        llama_cpp_outputs(args.bin, args.llama_cpp)
        return
    DATA.mkdir(parents=True, exist_ok=True)
    write_tokenizer(DATA)
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in SPECS.items():
            folder = Path(tmp) / name
            model = build(spec)
            save(model, spec, folder)
            tokenizer_files(folder, name)
            logits[name] = hf_logits(model, TOKENS)
            out = Path(tmp) / f"{name}.gguf"
            subprocess.run([sys.executable, "-c", _CONVERT, str(args.llama_cpp), str(folder),
                            "--outtype", "f32", "--outfile", str(out)], check=True)
            gguf_path(name).write_bytes(gzip.compress(out.read_bytes(), 9, mtime=0))
    np.savez_compressed(DATA / "oracle.npz", tokens=np.array(TOKENS, np.int32), **logits)
    if args.bin is not None:
        llama_cpp_outputs(args.bin, args.llama_cpp)


PROMPT, N_PREDICT = "Hello world, it's", 32
QUANTS = ("Q8_0", "Q4_K_M")


def llama_cpp_outputs(bin_dir: Path, llama_cpp: Path) -> None:
    """Step 5 (module docstring)."""
    from hf_models import build, save

    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-256"
        save(build(KQUANT_SPEC), KQUANT_SPEC, folder)
        tokenizer_files(folder, "qwen3")
        f32 = Path(tmp) / "qwen3-256-F32.gguf"
        subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp), str(folder),
                        "--outtype", "f32", "--outfile", str(f32)], check=True)
        kquant = DATA / "qwen3-256-Q4_K_M.gguf"
        subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(kquant), "Q4_K_M", "2"],
                       check=True, capture_output=True)
        done = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(kquant), "-n",
                               str(N_PREDICT), PROMPT], check=True, capture_output=True)
        outputs["qwen3-256-Q4_K_M"] = done.stdout.hex()
        for name in ("qwen2", "qwen3"):
            f32 = Path(tmp) / f"{name}-tiny-F32.gguf"
            f32.write_bytes(gzip.decompress(gguf_path(name).read_bytes()))
            files = {"F32": f32}
            for q in QUANTS:
                files[q] = DATA / f"{name}-tiny-{q}.gguf"
                subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(files[q]), q, "2"],
                               check=True, capture_output=True)
            for kind, path in files.items():
                done = subprocess.run([str(bin_dir / "llama-simple"), "-m", str(path), "-n",
                                       str(N_PREDICT), PROMPT], check=True, capture_output=True)
                outputs[f"{name}-tiny-{kind}"] = done.stdout.hex()
    about = (f"llama.cpp's llama-simple -m FILE -n {N_PREDICT} PROMPT on each file (its stdout "
             "as hex: the prompt, the greedy tokens' text, a newline); files made by "
             "tests/data/make_qwen_tiny.py")
    (DATA / "llamacpp.json").write_text(json.dumps(
        {"about": about, "prompt": PROMPT, "n_predict": N_PREDICT, "stdout_hex": outputs},
        indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
