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

Memory is the process's resident set (`jllama.platform.runtime.rss_bytes`, Linux's VmRSS; elsewhere
only time is watched), read when the watcher first sees a rendering and at each look after: what other
threads allocate in the meantime counts too, which `MAX_TEMPLATE_GROWTH` leaves room for.
"""

from __future__ import annotations

import ctypes
import threading
import time
from threading import get_ident

from jllama.platform.runtime import rss_bytes

MAX_TEMPLATE_SECONDS = 2.0
"""Wall-clock seconds one rendering may take (real templates take well under 1 ms)."""

MAX_TEMPLATE_GROWTH = 512 << 20
"""Bytes the process's resident set may grow while one rendering runs."""

POLL_SECONDS = 0.01
"""How often the watcher looks while a rendering runs."""


class Stopped(BaseException):
    """Raised in a rendering thread by the watcher. A BaseException, so that no `except
    Exception` in Jinja or a filter swallows it; the renderer turns it into its reason."""


# A rendering's record: a list, not an object, so that registering one is a few C calls.
# SECONDS is what `start` was given; the watcher sets DEADLINE and START_RSS when it first
# sees the rendering (at most `POLL_SECONDS` after it starts: no clock is read per rendering).
THREAD, SECONDS, DEADLINE, START_RSS, REASON, DONE = range(6)

class _Watcher:
    """The watcher thread and the renderings it watches (`renderings`: id(record) -> record).

    Starting and ending a watch take no lock (a dict entry and a flag, each one step under the
    GIL): the lock is taken by the watcher as it decides and raises, and by `stop` only when
    the watcher has raised. The order makes that safe: `stop` sets DONE before it reads
    REASON, the watcher sets REASON before it reads DONE and raises under the lock, so an
    exception raised for a rendering is withdrawn under the lock after it is raised, or never
    raised. Going idle is safe the same way: the watcher sets `idle` before it reads
    `renderings`, `start` adds to `renderings` before it reads `idle`, so one of them sees
    the other (the watcher does not wait, or `start` wakes it).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.renderings: dict[int, list] = {}
        self.idle = True  # waiting for `wake`: a rendering that starts must set it
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def start_thread(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, name="jllama-template-watcher", daemon=True
                )
                self.thread.start()
        self.wake.set()

    def withdraw(self, rendering: list) -> None:
        with self.lock:
            # Raised, and maybe not yet delivered: withdraw it (NULL clears it).
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(rendering[THREAD]), None)

    def _run(self) -> None:
        while True:
            # Idle as soon as no rendering is registered: looking every POLL_SECONDS while
            # renderings come and go costs each of them more (the GIL handed to this thread
            # at each look) than being woken when one starts after a quiet spell.
            self.idle = True
            if not self.renderings:
                self.wake.wait()
            self.idle = False
            self.wake.clear()
            time.sleep(POLL_SECONDS)
            renderings = list(self.renderings.values())
            if not renderings:
                continue
            now = time.monotonic()
            rss = rss_bytes() or None  # 0: not readable here
            for rendering in renderings:
                if rendering[DEADLINE] is None:
                    rendering[DEADLINE] = now + rendering[SECONDS]
                    rendering[START_RSS] = rss
                reason = None
                if now > rendering[DEADLINE]:
                    reason = f"rendering took more than {rendering[SECONDS]:g} s"
                elif rss is not None and rendering[START_RSS] is not None and (
                    rss - rendering[START_RSS] > MAX_TEMPLATE_GROWTH
                ):
                    reason = (f"rendering grew the process by more than "
                              f"{MAX_TEMPLATE_GROWTH >> 20} MiB")
                if reason is None:
                    continue
                rendering[REASON] = reason
                with self.lock:
                    if not rendering[DONE]:
                        # Raised again at every look until the rendering ends, should a
                        # bare `except` have caught it.
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(
                            ctypes.c_ulong(rendering[THREAD]), ctypes.py_object(Stopped)
                        )


_WATCHER = _Watcher()
_RENDERINGS = _WATCHER.renderings


def start(seconds: float = MAX_TEMPLATE_SECONDS) -> list:
    """Registers the calling thread's rendering with the watcher; give the record to `stop`
    once the rendering ends (in a `finally`). `record[REASON]` says why the watcher stopped
    it (None while it has not). Functions rather than a context manager: they cost a
    rendering less (a fraction of a microsecond)."""
    rendering = [get_ident(), seconds, None, None, None, False]
    _RENDERINGS[id(rendering)] = rendering
    if _WATCHER.idle:
        _WATCHER.start_thread() if _WATCHER.thread is None else _WATCHER.wake.set()
    return rendering


def stop(rendering: list) -> None:
    """Ends the watch `start` began; `Stopped` arriving meanwhile is absorbed (stopping is
    idempotent), so none reaches the code after the rendering."""
    try:
        rendering[DONE] = True
        _RENDERINGS.pop(id(rendering), None)
        if rendering[REASON] is not None:
            _WATCHER.withdraw(rendering)
    except Stopped:
        stop(rendering)
