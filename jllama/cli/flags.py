"""The `jllama` command's flags, defined (and their form checked) once.

Values are turned into option dataclasses by `jllama.cli.options`, the one module that reads
`FLAGS`; range checks of the sampler settings are `SamplerConfig`'s, made there too.
"""

from __future__ import annotations

from absl import flags

from jllama.platform import runtime
from jllama.backends import backend_names

FLAGS = flags.FLAGS

flags.DEFINE_string(
    "checkpoint",
    None,
    "Model: a llama2.c checkpoint (.bin, versions 0, 1, 2), a GGUF file (.gguf), a Hugging "
    "Face folder (config.json + safetensors), or the name of a fetched model (smollm2). "
    "Default: the embedded stories260K.",
    short_name="m",
)
flags.DEFINE_string(
    "tokenizer",
    None,
    "Tokenizer file: a llama2.c tokenizer.bin, a tokenizer.json or a GGUF file, for llama2.c "
    "checkpoints and Hugging Face folders without a tokenizer.json (a GGUF file carries its "
    "own); `jllama tokenize --tokenizer=FILE` needs no checkpoint. Default: tok<vocab_size>.bin or tokenizer.bin beside the "
    "checkpoint, else (for vocab_size 512) the embedded tok512.bin.",
)
flags.DEFINE_float(
    "temperature", 1.0, "Sampling temperature; 0 = greedy (argmax)."
)
flags.DEFINE_float(
    "top_p",
    0.9,
    "Nucleus sampling threshold in [0, 1]; 0 or 1 = sample from the whole distribution.",
)
flags.DEFINE_integer(
    "top_k", 0, "Keep only the k most likely tokens before sampling; 0 or less = off "
    "(llama.cpp's --top-k).",
)
flags.DEFINE_float(
    "min_p", 0.0, "Keep only tokens at least min_p times as likely as the most likely one, in "
    "[0, 1]; 0 = off (llama.cpp's --min-p).",
)
flags.DEFINE_float(
    "repeat_penalty", 1.0, "Divide (or, for negative logits, multiply) the logits of tokens "
    "among the last --penalty_last_n by this; 1 = off (llama.cpp's --repeat-penalty).",
)
flags.DEFINE_float(
    "presence_penalty", 0.0, "Subtract this from the logit of every token among the last "
    "--penalty_last_n; 0 = off (OpenAI's presence_penalty).",
)
flags.DEFINE_float(
    "frequency_penalty", 0.0, "Subtract this times its count from the logit of every token "
    "among the last --penalty_last_n; 0 = off (OpenAI's frequency_penalty).",
)
flags.DEFINE_integer(
    "penalty_last_n", 64, "How many of the last tokens (prompt included) the penalties count; "
    "-1 = all, 0 = off (llama.cpp's --repeat-last-n).",
)
flags.DEFINE_list(
    "samplers", "top_k,temperature,top_p,min_p", "Order of the sampler steps, each of top_k, "
    "temperature, top_p, min_p once. The default applies the temperature before top-p (run.c, "
    "transformers); llama.cpp's default is top_k,top_p,min_p,temperature.",
)
flags.DEFINE_integer(
    "steps",
    256,
    "generate: positions to run, prompt included (tokens); < 1 or > seq_len means seq_len. "
    "chat: the most tokens of one reply; < 1 = until the context is full. (llama.cpp's -n "
    "counts generated tokens only.)",
    short_name="n",
)
flags.DEFINE_string(
    "prompt", "", "generate: the text to continue. chat: the first user message (then stdin).",
    short_name="p",
)
flags.DEFINE_enum(
    "mode",
    "generate",
    ["generate", "chat"],
    "generate: raw completion of --prompt. chat: a conversation read from stdin, one message "
    "per line, rendered with the model's chat template; replies stop at the end-of-turn token.",
)
flags.DEFINE_string(
    "system_prompt", "", "chat: the system message (empty: the chat template's default)."
)
flags.DEFINE_enum(
    "reasoning", "show", ["show", "hide"], "chat: a thinking model's reasoning (its <think> "
    "block, Qwen3, DeepSeek-R1): show = print it as the model writes it; hide = print only the "
    "answer after </think>.",
)
flags.DEFINE_bool(
    "enable_thinking", None, "chat and serve: give the chat template enable_thinking=true "
    "(--enable_thinking) or false (--noenable_thinking: Qwen3 answers without thinking); "
    "absent: the template's default (a serve request's chat_template_kwargs overrides it).",
)
flags.DEFINE_enum(
    "reasoning_format", "auto", ["auto", "deepseek", "none"], "serve: where a chat reply's "
    "think block goes (llama.cpp's --reasoning-format): deepseek = message.reasoning_content "
    "(streamed as delta.reasoning_content), none = left in the content; auto = deepseek for "
    "models whose chat template writes <think>, else none. A request's reasoning_format "
    "overrides it.",
)
flags.DEFINE_integer(
    "seq_len",
    0,
    "Context to allocate the KV cache for (tokens), at most the model's; 0 = the model's, "
    "capped at 4096 (as llama.cpp) for a model made for more. perplexity: --ctx, when that "
    "is not given (llama-perplexity's -c).",
    lower_bound=0,
    short_name="c",
)
flags.DEFINE_bool(
    "parse_special",
    False,
    "Let special-token text in --prompt (e.g. <|im_start|>) become the special token, as "
    "llama.cpp's llama-tokenize does; by default it stays plain text.",
)
flags.DEFINE_enum(
    "dtype",
    "auto",
    ["auto", "float32", "bfloat16", "int8", "q4"],
    "Type to hold the weight matrices in: auto = as stored (a GGUF's quantized blocks as they "
    "are, float32 for llama2.c files, the stored type for Hugging Face folders); bfloat16 halves "
    "f32's memory; int8 quarters it (one float32 scale per row; a GGUF's blocks become Q8_0); "
    "q4 is llama.cpp's Q4_0 blocks, about an eighth (docs/formats.md: speed and accuracy).",
)
flags.DEFINE_enum(
    "decode",
    "auto",
    ["auto", "graph", "fused", "loop"],
    "jax backend: graph = three compiled programs per layer; fused = one program for all layers "
    "per token; loop = 16 tokens per program call, sampled on the device (temperature/top_p/"
    "seed sampling only); auto = loop where it can sample (run.c's sampler, a tokenizer that "
    "covers every logit), else graph. docs/speed.md gives the speed of each.",
)
flags.DEFINE_string(
    "draft",
    "none",
    "Speculative decoding: ngram = draft the tokens that followed the latest earlier "
    "occurrence of the last few tokens (prompt lookup); ngram-pool = the same, then from the "
    "n-grams of the run's other sequences (the server's requests share one pool); a "
    "checkpoint (path or known name) = a "
    "smaller model with the same tokenizer drafts greedily; self:q4 / self:int8 = the model's "
    "own weights at that type draft. Up to --draft_tokens drafted tokens are checked in one "
    "call; greedy output is exactly what decoding without drafts gives (each checked "
    "position's logits have its bits), sampled output has exactly its distribution.",
)
flags.DEFINE_integer(
    "draft_tokens",
    15,
    "The most tokens one draft proposes (1..15; --draft): the length adapts to how often "
    "drafts are accepted.",
    lower_bound=1,
    upper_bound=15,
)
flags.DEFINE_enum(
    "matvec",
    "auto",
    ["auto", "xla", "kernel"],
    "jax backend: how decode computes its matrix-vector products and attention, and prefill "
    "its attention. kernel = jllama's CPU kernels (built once with the system's C++ compiler "
    "into $JLLAMA_HOME/kernels; int8 and bfloat16 weights stream at f32's bytes/s instead of "
    "being widened by XLA; prefill's attention only where built with AVX-512 or AVX2); xla = jnp.dot "
    "and XLA's attention; auto = kernel on one CPU device when it builds, else xla.",
)
flags.DEFINE_string(
    "cache_type",
    "auto",
    "KV cache type of the keys and values (llama.cpp's names and block formats): f32, f16, "
    "bf16 (2 bytes a value), q8_0 (34 bytes per 32 values; head_dim a multiple of 32); auto = "
    "f32 for llama2.c files and Hugging Face folders (run.c's arithmetic), f16 for GGUF files "
    "(llama.cpp's default). --cache_type_k / --cache_type_v set one of the two.",
)
flags.DEFINE_string(
    "cache_type_k", None, "KV cache type of the keys (see --cache_type, which it overrides)."
)
flags.DEFINE_string(
    "cache_type_v", None, "KV cache type of the values (see --cache_type, which it overrides)."
)
flags.DEFINE_enum(
    "prefill",
    "chunked",
    ["chunked", "token"],
    "How the prompt goes through the model: chunked = batched chunks of tokens through each "
    "layer (jax backend); token = one position at a time, as run.c.",
)
flags.DEFINE_bool(
    "compile_cache",
    True,
    "jax backend: keep XLA's compiled programs in $JLLAMA_HOME/xla-cache and load them in "
    "later runs instead of compiling again; --nocompile_cache compiles everything and stores "
    "nothing.",
)
flags.DEFINE_bool(
    "weights_cache",
    True,
    "jax backend on the CPU kernels: keep the weights in the kernels' layout in "
    "$JLLAMA_HOME/weights (written once, the size of the model) and map them from there in "
    "later runs instead of building them again; --noweights_cache builds them every run and "
    "writes nothing.",
)
flags.DEFINE_string("host", "127.0.0.1", "serve: the address to listen on.")
flags.DEFINE_integer(
    "port", 8080, "serve: the TCP port to listen on (0 = any free one, printed).",
    lower_bound=0, upper_bound=65535,
)
flags.DEFINE_string(
    "model_name", None, "serve: the name clients give as `model` (default: the checkpoint's "
    "name, e.g. stories260K or smollm2).",
)
flags.DEFINE_multi_string(
    "model", None, "serve: another model to serve as NAME=CHECKPOINT (repeatable), chosen by "
    "a request's `model`; loaded on first use (--checkpoint's model, the default, at start).",
)
flags.DEFINE_integer(
    "models_max_loaded", 0, "serve: with --model, the most models loaded at once; the least "
    "recently used idle one is unloaded to load another (0 = no limit).", lower_bound=0,
)
flags.DEFINE_integer(
    "parallel", 4, "serve, batch: requests generated at once, each in its own KV cache (slot), taking "
    "turns a token at a time; a new request reuses the prompt prefix a free slot holds. 1 = "
    "one at a time, in arrival order.", lower_bound=1, upper_bound=256,
)
flags.DEFINE_integer(
    "max_waiting", 256, "serve: the most requests queued at once; more get HTTP 503.",
    lower_bound=1,
)
flags.DEFINE_bool(
    "webui", True, "serve: the chat page at http://HOST:PORT/ (a static page over the API); "
    "--no_webui leaves it out (404).",
)
flags.DEFINE_multi_string(
    "api_key", None, "serve: a key clients must send ('Authorization: Bearer KEY', or "
    "'x-api-key: KEY') on every route but /health and the chat page; repeat the flag or give "
    "a comma-separated list. Default: none, no key asked for.",
)
flags.DEFINE_string(
    "api_key_file", None, "serve: a file of API keys, one a line (blank lines and lines "
    "starting with # skipped), added to --api_key's (keeps keys out of the process list).",
)
flags.DEFINE_list(
    "cors_origins", [], "serve: the web origins (scheme://host[:port], comma-separated; * = "
    "any) whose pages' scripts may call the API and read its answers (CORS). Default: none.",
)
flags.DEFINE_bool("pieces", False, "tokenize: print each id with its text, one per line.")
flags.DEFINE_bool(
    "force",
    False,
    "fetch: download again even if the cached file verifies. convert: write settings a "
    "llama2.c file cannot hold (norm_eps, rope_theta, rope_scaling), which run.c then ignores.",
)
flags.DEFINE_string("output", None, "convert: the llama2.c checkpoint file to write.")
flags.DEFINE_enum(
    "llama2c_version",
    "1",
    ["0", "1", "2"],
    "convert: llama2.c format version: 0 (legacy, run.c), 1 (float32, export.py), 2 (Q8_0, "
    "runq.c).",
)
flags.DEFINE_integer(
    "group_size", 64, "convert: Q8_0 group size for version 2 (halved until it fits).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "seed",
    None,
    "Seed of run.c's xorshift sampler; absent or 0 = from the clock (printed to stderr).",
    lower_bound=0,
    upper_bound=2**64 - 1,
)
flags.DEFINE_enum("backend", "jax", list(backend_names()), "Model implementation.")
flags.DEFINE_integer(
    "threads",
    0,
    "CPU threads for XLA (the process is pinned to that many cores); 0 = all.",
    lower_bound=0,
    short_name="t",
)
flags.DEFINE_integer(
    "devices",
    0,
    "jax backend: split the model over this many devices, tensor-parallel (each holds a "
    "slice of every layer and its KV heads' cache; must divide n_kv_heads). 0 = one device, "
    "or with --num_processes > 1 every device of every process. On CPU, "
    "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N devices.",
    lower_bound=0,
)
flags.DEFINE_string(
    "coordinator",
    None,
    "Several processes (hosts) running one model: HOST:PORT of process 0, where JAX's "
    "coordinator listens (jax.distributed). Every process runs the same command with its own "
    "--process_id.",
)
flags.DEFINE_integer(
    "num_processes", 1, "How many processes run the model together (see --coordinator).",
    lower_bound=1,
)
flags.DEFINE_integer(
    "process_id", 0, "This process's number, 0 .. --num_processes - 1; process 0 prints.",
    lower_bound=0,
)
flags.DEFINE_bool(
    "verify_checkpoint",
    False,
    "Print shape, min, max, mean and finiteness of every tensor and exit (1 if any value "
    "is not finite).",
)
flags.DEFINE_enum(
    "output_format",
    "text",
    ["text", "json"],
    "text: stream the story as run.c prints it; json: one object with the ids, the text and "
    "the rates (perplexity: the PPL, its error and the rates).",
)
flags.DEFINE_string(
    "json_schema", None, "Constrain the output to JSON valid under this JSON Schema: a path to a "
    "file, or the schema itself as inline JSON (llguidance's subset of JSON Schema). One of "
    "--json_schema, --json, --regex, --grammar.",
)
flags.DEFINE_bool("json", False, "Constrain the output to one JSON value (any).")
flags.DEFINE_string(
    "regex", None, "Constrain the output to text the whole of which matches this regular "
    "expression (Rust regex syntax).",
)
flags.DEFINE_string(
    "grammar", None, "Constrain the output to a grammar file: Lark as llguidance takes it, or "
    "llama.cpp's GBNF (a file whose rules use ::=).",
)
flags.DEFINE_string("file", None, "perplexity: the UTF-8 text file to score. batch: the "
                    "prompts, one per line (text, or JSON with \"prompt\").")
flags.DEFINE_integer(
    "ctx", 512, "perplexity: tokens a chunk (llama-perplexity's -c); the second half of each "
    "is scored.",
)
flags.DEFINE_integer(
    "chunks", -1, "perplexity: the most chunks to evaluate (llama-perplexity's --chunks); "
    "-1 = all.",
)

# llama.cpp's short flags (-m -p -n -c -t, set as short_name= above) and --temp.
flags.DEFINE_alias("temp", "temperature")

flags.register_validator(
    "threads",
    lambda n: n <= runtime.available_cpus(),
    message=f"exceeds the {runtime.available_cpus()} CPUs available",
)
for _name in ("checkpoint", "tokenizer"):
    flags.register_validator(_name, lambda v: v is None or v != "", message="is empty")
# The name clients send as `model`: blank would answer to `"model": ""` only.
flags.register_validator("model_name", lambda v: v is None or v.strip() != "",
                         message="is empty")
