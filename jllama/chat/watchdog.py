"""A chat template's rendering stopped from outside once it runs too long or grows the process
too much: `MAX_TEMPLATE_SECONDS` and `MAX_TEMPLATE_GROWTH`.

Counting each step of a rendering in Python doubles the time a real template takes (measured:
Llama 3.3's template with one tool, 35 -> 90 us a rendering), for limits a real template never
comes near. So time and memory are watched instead: `start()` registers the rendering
thread with one watcher thread (started at the first rendering, a daemon), which looks now and
then while renderings come and, for one past its deadline or whose process grew past
`MAX_TEMPLATE_GROWTH` since it started, raises `Stopped` in the rendering thread
(`PyThreadState_SetAsyncExc`: delivered at the thread's next Python instruction; a template's
loops, macros and filters are Python code, and each single C call a template can make is
bounded in size before it runs by `jllama.chat.limits`). A rendering that ends first costs a
dictionary entry. The watcher is the one piece of process state here: a thread per rendering
would cost more than the rendering.

What a look costs a rendering is the GIL: the watcher takes it from the rendering thread at
each look (on a busy machine that hand-over, and the one back, wait for the scheduler: 0.1-0.3
ms measured on 2 loaded cores), so it looks as seldom as the limits allow. While the renderings
it sees all end between two looks (real templates render in well under a millisecond) it looks
every `QUIET_SECONDS`; once one has run past a look it looks every `POLL_SECONDS`; after
`IDLE_SECONDS` without a rendering it waits to be woken by the next one. A look reads the
resident set without letting go of the GIL (a file read would hand it over twice more).

Memory is the process's resident set (Linux's VmRSS, from /proc/self/statm; elsewhere only time
is watched). A rendering's growth counts from the reading taken at the look before it was first
seen, so before it started (or when the watcher was woken for it): a rendering is checked at the
first two looks that see it, at most `QUIET_SECONDS` apart, then every `POLL_SECONDS`; what
other threads allocate in the meantime counts too, which `MAX_TEMPLATE_GROWTH` leaves room for.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from threading import get_ident

from jllama.platform.runtime import rss_bytes

MAX_TEMPLATE_SECONDS = 2.0
"""Wall-clock seconds one rendering may take (real templates take well under 1 ms)."""

MAX_TEMPLATE_GROWTH = 512 << 20
"""Bytes the process's resident set may grow while one rendering runs."""

POLL_SECONDS = 0.01
"""How often the watcher looks while a rendering it has seen before still runs."""

QUIET_SECONDS = 0.05
"""How often it looks while every rendering it sees is new (a look costs a rendering the GIL;
a rendering that grows the process at 4 GB/s reaches 200 MB in the two looks before the
watcher looks every `POLL_SECONDS`)."""

IDLE_SECONDS = 1.0
"""How long the watcher goes on looking with no rendering registered before it waits to be
woken (waking it costs the next rendering the GIL, twice)."""


class Stopped(BaseException):
    """Raised in a rendering thread by the watcher. A BaseException, so that no `except
    Exception` in Jinja or a filter swallows it; the renderer turns it into its reason."""


# A rendering's record: a list, not an object, so that registering one is a few C calls.
# SECONDS is what `start` was given; the watcher sets DEADLINE and START_RSS when it first
# sees the rendering (no clock is read per rendering).
THREAD, SECONDS, DEADLINE, START_RSS, REASON, DONE = range(6)


def _statm_reader():
    """A function returning the resident set in bytes (0 where it cannot be read) that keeps
    the GIL: /proc/self/statm read with libc's `pread` called through `ctypes.PyDLL` (a
    Python file read, or a `ctypes.CDLL` call, lets the GIL go and takes it back: two more
    hand-overs with the rendering thread a look). Elsewhere than Linux, `rss_bytes` (0)."""
    try:
        fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        pread = ctypes.PyDLL(None).pread
    except (OSError, AttributeError):
        return rss_bytes
    pread.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_long)
    pread.restype = ctypes.c_ssize_t
    buf = ctypes.create_string_buffer(128)
    page = os.sysconf("SC_PAGE_SIZE")

    def read() -> int:
        n = pread(fd, buf, 128, 0)  # "size resident shared ..." in pages
        fields = buf.raw[:n].split() if n > 0 else ()
        return int(fields[1]) * page if len(fields) > 1 else 0

    return read


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
        self.idle = False
        read_rss = _statm_reader()
        rss = read_rss()  # the last reading: the growth of a rendering first seen counts from it
        seen_at = time.monotonic()  # when a look last saw a rendering
        wait = QUIET_SECONDS
        while True:
            if time.monotonic() - seen_at > IDLE_SECONDS:
                self.idle = True
                if not self.renderings:
                    self.wake.wait()
                    rss = read_rss()  # before the rendering that woke it grows
                self.idle = False
                self.wake.clear()
                seen_at = time.monotonic()
            time.sleep(wait)
            # The reading before the snapshot: a rendering not in this snapshot registered
            # after it, so its growth counts from this reading.
            baseline, rss = rss, read_rss()
            renderings = list(self.renderings.values())
            wait = QUIET_SECONDS
            if not renderings:
                continue
            now = seen_at = time.monotonic()
            for rendering in renderings:
                if rendering[DEADLINE] is None:  # new since the last look
                    rendering[DEADLINE] = now + rendering[SECONDS]
                    rendering[START_RSS] = baseline
                else:  # ran past a look: looked at closely from now on
                    wait = POLL_SECONDS
                reason = None
                if now > rendering[DEADLINE]:
                    reason = f"rendering took more than {rendering[SECONDS]:g} s"
                elif rss and rendering[START_RSS] and (
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


def _after_fork() -> None:
    """A forked child has no watcher thread (threads do not survive a fork): a new one."""
    global _WATCHER, _RENDERINGS
    _WATCHER = _Watcher()
    _RENDERINGS = _WATCHER.renderings


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


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
