"""The `jllama` command's entry point (also `python -m jllama`).

Kept free of heavy imports: Ctrl-C is handled before JAX starts loading, so an interrupt at
any moment exits with status 130 and no traceback.
"""

import os
import signal


def _interrupted(signum, frame):
    # Output is flushed piece by piece, so nothing printed is lost by exiting at once; exiting
    # from the handler also covers interrupts inside imports and XLA callbacks, where a
    # KeyboardInterrupt could be swallowed or leave the process half-initialized.
    os.write(2, b"\n")
    os._exit(130)


def run() -> None:
    """Console-script entry point."""
    signal.signal(signal.SIGINT, _interrupted)
    from jllama.cli import run as cli_run

    cli_run()


if __name__ == "__main__":
    run()
