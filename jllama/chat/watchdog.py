"""A chat template's rendering stopped from outside once it runs too long or grows the process
too much: `MAX_TEMPLATE_SECONDS` and `MAX_TEMPLATE_GROWTH`.

Counting each step of a rendering in Python doubles the time a real template takes (measured:
Llama 3.3's template with one tool, 35 -> 90 us a rendering), for limits a real template never
comes near. So time and memory are watched instead: `start()` registers the rendering
thread with one watcher thread (started at the first rendering, a daemon), which looks every
`POLL_SECONDS` while any rendering is registered and, for one past its deadline or whose process
grew past `MAX_TEMPLATE_GROWTH` since it started, raises `Stopped` in the rendering thread
(`PyThreadState_SetAsyncExc`: delivered at the thread's next Python instruction; a template's
loops, macros and filters are Python code, and each single C call a template can make is
bounded in size before it runs by `jllama.chat.limits`). A rendering that ends first costs a
dictionary entry. The watcher is the one piece of process state here: a thread per rendering
would cost more than the rendering.

Memory is the process's resident set (Linux `/proc/self/statm`; elsewhere only time is
watched), read when the watcher first sees a rendering and at each look after: what other
threads allocate in the meantime counts too, which `MAX_TEMPLATE_GROWTH` leaves room for.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

MAX_TEMPLATE_SECONDS = 2.0
"""Wall-clock seconds one rendering may take (real templates take well under 1 ms)."""

MAX_TEMPLATE_GROWTH = 512 << 20
"""Bytes the process's resident set may grow while one rendering runs."""

POLL_SECONDS = 0.01
"""How often the watcher looks while a rendering runs."""


class Stopped(BaseException):
    """Raised in a rendering thread by the watcher. A BaseException, so that no `except
    Exception` in Jinja or a filter swallows it; `watching` turns it into its reason."""


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """The process's resident set, bytes (None where `/proc/self/statm` is not there)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _Rendering:
    __slots__ = ("thread_id", "deadline", "start_rss", "reason", "done")

    def __init__(self, thread_id: int, deadline: float):
        self.thread_id = thread_id
        self.deadline = deadline
        self.start_rss: int | None = None
        self.reason: str | None = None
        self.done = False


class _Watcher:
    """The watcher thread and the renderings it watches.

    Starting and ending a watch take no lock (a dict entry and a flag, each one step under the
    GIL): the lock is taken by the watcher as it decides and raises, and by `stop` only when
    the watcher has raised. The order makes that safe: `stop` sets `done` before it reads
    `reason`, the watcher sets `reason` before it reads `done` and raises under the lock, so
    an exception raised for a rendering is withdrawn under the lock after it is raised, or
    never raised.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._renderings: dict[int, _Rendering] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, seconds: float) -> _Rendering:
        rendering = _Rendering(threading.get_ident(), time.monotonic() + seconds)
        self._renderings[id(rendering)] = rendering
        if not self._wake.is_set():
            if self._thread is None:
                with self._lock:
                    if self._thread is None:
                        self._thread = threading.Thread(
                            target=self._run, name="jllama-template-watcher", daemon=True
                        )
                        self._thread.start()
            self._wake.set()
        return rendering

    def stop(self, rendering: _Rendering) -> None:
        rendering.done = True
        self._renderings.pop(id(rendering), None)
        if rendering.reason is not None:
            with self._lock:
                # Raised, and maybe not yet delivered: withdraw it (NULL clears it).
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(rendering.thread_id), None
                )

    def _run(self) -> None:
        while True:
            self._wake.wait()
            time.sleep(POLL_SECONDS)
            renderings = list(self._renderings.values())
            if not renderings:
                self._wake.clear()
                if self._renderings:  # one started as the flag was cleared
                    self._wake.set()
                continue
            rss = resident_bytes()
            now = time.monotonic()
            for rendering in renderings:
                if rendering.start_rss is None:
                    rendering.start_rss = rss
                reason = None
                if now > rendering.deadline:
                    reason = f"rendering took more than {MAX_TEMPLATE_SECONDS:g} s"
                elif rss is not None and rendering.start_rss is not None and (
                    rss - rendering.start_rss > MAX_TEMPLATE_GROWTH
                ):
                    reason = (f"rendering grew the process by more than "
                              f"{MAX_TEMPLATE_GROWTH >> 20} MiB")
                if reason is None:
                    continue
                rendering.reason = reason
                with self._lock:
                    if not rendering.done:
                        # Raised again at every look until the rendering ends, should a
                        # bare `except` have caught it.
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(rendering.thread_id), ctypes.py_object(Stopped)
                        )


_WATCHER = _Watcher()


def start(seconds: float = MAX_TEMPLATE_SECONDS) -> _Rendering:
    """Registers the calling thread's rendering with the watcher; give the result to `stop`
    once the rendering ends (in a `finally`). The record's `reason` says why the watcher
    stopped it (None while it has not). A function pair rather than a context manager: it
    costs a rendering less."""
    return _WATCHER.start(seconds)


def stop(watch: _Rendering) -> None:
    """Ends the watch `start` began; `Stopped` arriving meanwhile is absorbed (stopping is
    idempotent), so none reaches the code after the rendering."""
    while True:
        try:
            _WATCHER.stop(watch)
            return
        except Stopped:
            continue
