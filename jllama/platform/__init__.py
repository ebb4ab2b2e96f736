"""The process and its environment.

`runtime` (threads, devices, RSS), `memory` (the memory plan checked before loading),
`compile_cache` (XLA's persistent compilation cache), `distributed` and `sharding` (several
devices and hosts), `fetch` (known models into the local cache) and `files` (the checks every file reader makes
before it reads: a regular file, its size, its JSON).
"""
