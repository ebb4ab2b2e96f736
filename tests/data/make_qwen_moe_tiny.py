"""Make the tiny Qwen3-MoE files of tests/data/qwen_tiny/ (issue 36, the MoE part):
`qwen_models.MOE_SPEC` (transformers' `Qwen3MoeForCausalLM`, seeded random weights) converted
to GGUF by llama.cpp's own convert_hf_to_gguf.py, quantized by llama-quantize, and llama.cpp's
greedy output on each file.

This is how the committed files were made; CI only reads them:

    python tests/data/make_qwen_moe_tiny.py --llama-cpp /path/to/llama.cpp --bin /path/to/bin

Steps:
  1. the model built by `hf_models.build` (seed 15), saved by save_pretrained (float32, one
     file per expert matrix as transformers writes them), with the tiny Qwen tokenizer and
     Qwen3's tokenizer_config.json (`qwen_models.tokenizer_files`);
  2. convert_hf_to_gguf.py --outtype f32 (with make_qwen_tiny.py's one change: the
     pre-tokenizer named "qwen2"): architecture qwen3moe, experts as 3-D tensors
     blk.N.ffn_{gate,up,down}_exps; gzipped as qwen3moe-tiny-F32.gguf.gz (`gzip -n -9`);
  3. `llama-quantize F32 OUT Q8_0 2`: qwen3moe-tiny-Q8_0.gguf (the router ffn_gate_inp stays
     F32, as llama-quantize keeps it);
  4. `qwen_models.MOE_KQUANT_SPEC` (rows of 256) converted the same way and quantized to
     Q4_K_M (`llama-quantize F32 OUT Q4_K_M 2`: the experts in Q4_K and Q6_K blocks),
     kept as qwen3moe-256-Q4_K_M.gguf (its F32 file is not kept);
  5. transformers' logits for `qwen_models.TOKENS` (one full-sequence forward) in
     moe_oracle.npz; and llama-simple's greedy text (`llama-simple -m FILE -n 32 PROMPT`, its
     stdout as hex) on the F32, Q8_0 and Q4_K_M files in moe_llamacpp.json.
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
sys.path.insert(0, str(HERE))

from make_qwen_tiny import _CONVERT, N_PREDICT, PROMPT  # noqa: E402
from qwen_models import (  # noqa: E402
    DATA, MOE_KQUANT_SPEC, MOE_SPEC, TOKENS, tokenizer_files,
)

STEM = "qwen3moe-tiny"


def main() -> None:
    import numpy as np
    from hf_models import build, hf_logits, save

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--bin", type=Path, required=True,
                        help="llama.cpp's bin/ (llama-quantize, llama-simple)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / STEM
        model = build(MOE_SPEC)
        save(model, MOE_SPEC, folder)
        tokenizer_files(folder, "qwen3")
        np.savez_compressed(DATA / "moe_oracle.npz", tokens=np.array(TOKENS, np.int32),
                            qwen3moe=hf_logits(model, TOKENS))
        f32 = Path(tmp) / f"{STEM}-F32.gguf"
        subprocess.run([sys.executable, "-c", _CONVERT, str(args.llama_cpp), str(folder),
                        "--outtype", "f32", "--outfile", str(f32)], check=True)
        (DATA / f"{STEM}-F32.gguf.gz").write_bytes(gzip.compress(f32.read_bytes(), 9, mtime=0))
        q8 = DATA / f"{STEM}-Q8_0.gguf"
        subprocess.run([str(args.bin / "llama-quantize"), str(f32), str(q8), "Q8_0", "2"],
                       check=True, capture_output=True)
        kfolder = Path(tmp) / "qwen3moe-256"
        save(build(MOE_KQUANT_SPEC), MOE_KQUANT_SPEC, kfolder)
        tokenizer_files(kfolder, "qwen3")
        kf32 = Path(tmp) / "qwen3moe-256-F32.gguf"
        subprocess.run([sys.executable, "-c", _CONVERT, str(args.llama_cpp), str(kfolder),
                        "--outtype", "f32", "--outfile", str(kf32)], check=True)
        kquant = DATA / "qwen3moe-256-Q4_K_M.gguf"
        subprocess.run([str(args.bin / "llama-quantize"), str(kf32), str(kquant), "Q4_K_M",
                        "2"], check=True, capture_output=True)
        outputs = {}
        for stem, path in ((f"{STEM}-F32", f32), (f"{STEM}-Q8_0", q8),
                           ("qwen3moe-256-Q4_K_M", kquant)):
            done = subprocess.run([str(args.bin / "llama-simple"), "-m", str(path), "-n",
                                   str(N_PREDICT), PROMPT], check=True, capture_output=True)
            outputs[stem] = done.stdout.hex()
    about = (f"llama.cpp's llama-simple -m FILE -n {N_PREDICT} PROMPT on each file (its stdout "
             "as hex: the prompt, the greedy tokens' text, a newline); files made by "
             "tests/data/make_qwen_moe_tiny.py")
    (DATA / "moe_llamacpp.json").write_text(json.dumps(
        {"about": about, "prompt": PROMPT, "n_predict": N_PREDICT, "stdout_hex": outputs},
        indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
