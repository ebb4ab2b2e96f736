"""Turning logits into the next token id, as llama2.c run.c does it, with llama.cpp's chain.

A sampler sees one vector of logits (`f32[vocab_size]`) per generated token and knows nothing of
the model. One module per job:

- `rng`: run.c's xorshift64* generator (`XorShiftRng`, `xorshift_step`, `u32_to_f32`) and
  `seed_from_clock`;
- `runc`: run.c's functions on whole vectors, bit for bit (`argmax`, `softmax`, `sample_mult`,
  `sample_topp`), and `log_softmax` for reported log-probabilities;
- `chain`: llama.cpp's samplers: `apply_logit_bias` and `apply_penalties` on the logits, then
  `top_k_filter`, `temperature_scale`, `top_p_filter`, `min_p_filter` on `Candidates`, and
  `sample_candidates`;
- `config`: `SamplerConfig` and the one set of range checks for its fields (`check_setting`,
  `SamplerSettingError`), which the CLI and the server both use;
- `sampler`: `Sampler`, which builds the chain for a config once and runs it per token, and
  `restrict_to_vocabulary` for a vocabulary padded past its tokenizer.

    logits --(/ temperature)--> softmax --> probs --+-- sample_mult(probs, coin)
                                                    +-- sample_topp(probs, top_p, coin)
    logits --(temperature 0)--> argmax

With the llama.cpp steps off, `Sampler` does exactly run.c's `sample()`: the same seed gives
run.c's tokens (see `runc` for how float32 sums and `expf` are matched). The default order puts
temperature before top-p and min-p as run.c, Hugging Face transformers and vLLM do; llama.cpp's
default puts it last (`LLAMA_CPP_ORDER`).
"""

from jllama.errors import SamplerError
from jllama.sampling.chain import (
    Candidates,
    apply_logit_bias,
    apply_penalties,
    min_p_filter,
    sample_candidates,
    temperature_scale,
    top_k_filter,
    top_p_filter,
)
from jllama.sampling.config import (
    FILTERS,
    LLAMA_CPP_ORDER,
    SamplerConfig,
    SamplerSettingError,
    check_seed,
    check_setting,
)
from jllama.sampling.rng import XorShiftRng, seed_from_clock, u32_to_f32, xorshift_step
from jllama.sampling.runc import argmax, log_softmax, sample_mult, sample_topp, softmax
from jllama.sampling.runc import sort_descending as _sort_descending  # noqa: F401  (tests)
from jllama.sampling.sampler import (
    CandidateStep,
    HistorySampler,
    LogitStep,
    Sampler,
    restrict_to_vocabulary,
)

__all__ = [
    "FILTERS",
    "LLAMA_CPP_ORDER",
    "CandidateStep",
    "Candidates",
    "HistorySampler",
    "LogitStep",
    "Sampler",
    "SamplerConfig",
    "SamplerError",
    "SamplerSettingError",
    "XorShiftRng",
    "apply_logit_bias",
    "apply_penalties",
    "argmax",
    "check_seed",
    "check_setting",
    "log_softmax",
    "min_p_filter",
    "restrict_to_vocabulary",
    "sample_candidates",
    "sample_mult",
    "sample_topp",
    "seed_from_clock",
    "softmax",
    "temperature_scale",
    "top_k_filter",
    "top_p_filter",
    "u32_to_f32",
    "xorshift_step",
]
