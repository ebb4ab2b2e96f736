"""Generation: turning a prepared model into tokens.

`session` (a model + backend + tokenizer, prepared once; every generation the CLI and the
server run is assembled here), `session_slots` (its KV-cache slots), `generate` (the token
loop: prefill, then decode one position at a time), `device_loop` (the same loop kept on the
device), `streaming` (bytes to UTF-8 text pieces), `stop` (stop strings), `conversation`
(multi-turn chat over one KV cache) and `perplexity` (a generation scored, not sampled).
"""
