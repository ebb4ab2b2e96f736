"""`python -m jllama`: the same as the `jllama` command."""

from jllama.cli import run

run()
