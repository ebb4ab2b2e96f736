"""bench's tests run its scripts as subprocesses: their machine lines measure the read bandwidth
over 16 MB instead of 400 MB (~5 s less a script run); the tests check the lines' form, not the
figure (bench/run.py's READ_BYTES_ENV)."""

import os

os.environ.setdefault("JLLAMA_BENCH_READ_BYTES", "16000000")
