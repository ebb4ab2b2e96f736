"""The fuzz harness's HTTP class (bench/fuzz.py --kinds=http, issue 33): one `jllama serve` on the
GGUF seed (`--backend=numpy`: no compile), started once for the run, and cases
(bench/fuzz_http_cases.py) that each send raw bytes over a fresh TCP connection.

What the server must answer comes from an oracle: h11, the HTTP parser the server itself runs
(with the server's 64 KiB limit on an incomplete head), is fed the case's bytes and says what
they hold. Each complete request must get an answer; bytes h11 cannot parse must get a 400, after
which the server closes; a request still incomplete at the end may get an early answer (a 413
from its declared length, a 415 from its type) or none: the server waits for the rest, so the
harness waits INCOMPLETE_WAIT_S and closes. Answers are parsed by the standard library's
`http.client`, a parser independent of the server's.

Outcomes:
  clean    every answer the oracle asks for came within the time limit (5 s after the last byte
           went out), with a 2xx or 4xx status (a 100 Continue before it), each 4xx but a
           HEAD's carrying OpenAI's error object `{"error": {"message", "type", "param",
           "code"}}` as JSON; a crafted case's first answer has one of its statuses (an
           answer is then required even for an incomplete request); and after the case the
           server answers GET /health with 200 within 5 s, its peak RSS (VmHWM) is under
           --rss_limit and its log gained no traceback or ERROR line. Framing h11 cannot parse
           is held to the same rule: the server's 400 for it carries the error object too
           (jllama.server.protocol); a bare close is accepted only when the server closed while
           the harness was still sending the bytes it refused (a 1 MB header line: the kernel
           then resets the connection, which can discard the 400 before it is read).
  failure  anything else: a 5xx, a 3xx (the trailing slash's 307 was one), a 1xx other than
           100, an answer that does not parse, a missing answer (past the limit, or a close),
           a 4xx without the error object, a crafted case's wrong status, or after the case the
           server dead, unhealthy, over the RSS limit, or a traceback in its log.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h11
from fuzz_http_cases import HttpCase, plan_http  # bench/ is the script's folder

HTTP_TIME_LIMIT_S = 5.0
"""Seconds after its last byte went out that a case's answers may take (--time_limit if less)."""

INCOMPLETE_WAIT_S = 0.1
"""How long a request still incomplete is given for an early answer before the harness closes."""

HEALTH_S = 5.0
HEAD_LIMIT = 64 * 1024  # the server's h11_max_incomplete_event_size (jllama.server.make_server)
ERROR_KEYS = {"message", "type", "param", "code"}
BAD_LOG = ("Traceback", "ERROR", "Fatal error", "Exception in ASGI")


class Server:
    """`jllama serve` on a checkpoint in a process of its own, its log in `folder`."""

    def __init__(self, checkpoint: Path, folder: Path, timeout: float = 120.0):
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "server.log"
        began = time.monotonic()
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "jllama", "serve", f"--checkpoint={checkpoint}",
                 "--backend=numpy", "--port=0", "--parallel=2"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.address = None
        while self.address is None:
            text = self.log.read_text(errors="replace")
            if " at http://" in text:
                url = text.split(" at http://")[1].split("/")[0]
                host, port = url.rsplit(":", 1)
                self.address = (host, int(port))
            elif self.process.poll() is not None or time.monotonic() - began > timeout:
                self.stop()
                raise RuntimeError(f"jllama serve did not start: {text[-2000:]}")
            else:
                time.sleep(0.05)
        self.start_seconds = time.monotonic() - began
        self._read_at = len(self.log.read_bytes())
        self.start_rss_mb = self.memory_mb("VmRSS")

    def new_log_lines(self) -> list[str]:
        """The lines the server logged since the last call."""
        with open(self.log, "rb") as f:
            f.seek(self._read_at)
            data = f.read()
        self._read_at += len(data)
        return [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]

    def memory_mb(self, field: str = "VmHWM") -> float:
        """The process's peak (VmHWM) or current (VmRSS) resident memory, MB; 0 once gone."""
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def healthy(self) -> bool:
        """GET /health answered 200 within HEALTH_S, on a fresh connection."""
        try:
            with socket.create_connection(self.address, timeout=HEALTH_S) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                response = http.client.HTTPResponse(conn)
                response.begin()
                return response.status == 200 and json.loads(response.read())["status"] == "ok"
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def oracle(data: bytes) -> list[tuple[str, bytes]]:
    """What the server must do with `data` sent on one connection, as h11 reads it: ("answer",
    method) for each complete request, ("bad", method) for bytes h11 refuses (last), ("maybe",
    method) for a request still incomplete at the end."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_LIMIT)
    conn.receive_data(data)
    plan, method = [], b"GET"
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return plan + [("bad", method)]
        if event is h11.NEED_DATA or event is h11.PAUSED:
            if conn.their_state is not h11.IDLE or conn.trailing_data[0]:
                plan.append(("maybe", method))
            return plan
        if isinstance(event, h11.Request):
            method = event.method
        elif isinstance(event, h11.EndOfMessage):
            plan.append(("answer", method))
            conn.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is h11.MUST_CLOSE:
                return plan
            conn.start_next_cycle()
            method = b"GET"


class _Reader:
    """One buffered reader of a socket, lent to each http.client.HTTPResponse in turn (which
    closes it after its body: a no-op here), so pipelined answers lose no bytes read ahead."""

    def __init__(self, conn: socket.socket):
        self.file = conn.makefile("rb")

    def makefile(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return getattr(self.file, name)

    def close(self) -> None:
        pass


def check_answer(status: int, body: bytes, method: bytes) -> str | None:
    """Why an answer breaks the rules (module docstring), or None."""
    if status < 200 or status > 599:
        return f"status {status} (only a 100 Continue may come before the answer)"
    if 300 <= status < 400:
        return f"a {status} redirect, not an answer"
    if status >= 500:
        return f"a {status}: {body[:160]!r}"
    if status >= 400 and method != b"HEAD":
        try:
            error = json.loads(body)["error"]
            ok = isinstance(error, dict) and set(error) == ERROR_KEYS and error["message"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return f"a {status} without OpenAI's error object: {body[:160]!r}"
    return None


def exchange(address: tuple[str, int], case: HttpCase,
             limit_s: float) -> tuple[list[int], str | None, str]:
    """Send the case on a fresh connection and read the answers the oracle asks for: (their
    statuses, why the case failed or None, a note on how it ended)."""
    plan = oracle(case.data)
    statuses: list[int] = []
    cut_while_sending = False
    with socket.create_connection(address, timeout=limit_s) as conn:
        for data, pause in case.sends:
            try:
                conn.sendall(data)
            except TimeoutError:
                return statuses, f"sending timed out after {limit_s:g} s: the server stopped " \
                    "reading", ""
            except OSError:  # the server closed: what it answered first is still to be read
                cut_while_sending = True
                break
            if pause:
                time.sleep(pause)
        sent = time.monotonic()
        reader = _Reader(conn)
        for step, method in plan:
            must = step != "maybe" or (case.statuses is not None and not statuses)
            conn.settimeout(max(0.01, sent + (limit_s if must else INCOMPLETE_WAIT_S)
                                - time.monotonic()))
            try:
                response = http.client.HTTPResponse(reader, method=method.decode("latin-1"))
                response.begin()
                body = response.read()
            except TimeoutError:
                if must:
                    return statuses, f"no answer within {limit_s:g} s ({step})", ""
                return statuses, None, "no early answer to an incomplete request: it waits"
            except (http.client.HTTPException, OSError) as e:
                closed = isinstance(e, (http.client.RemoteDisconnected, ConnectionError))
                if closed and (not must or (step == "bad" and cut_while_sending)):
                    return statuses, None, "closed while the client was still sending"
                return statuses, f"no answer ({step}): {type(e).__name__}: {e}"[:300], ""
            statuses.append(response.status)
            why = check_answer(response.status, body, method)
            if why is None and len(statuses) == 1 and case.statuses is not None \
                    and response.status not in case.statuses:
                why = f"status {response.status}, expected one of {sorted(case.statuses)}: " \
                      f"{body[:160]!r}"
            if why:
                return statuses, why, ""
            if step == "bad" or (response.getheader("connection") or "").lower() == "close":
                break
    return statuses, None, "answered" if statuses else "nothing to answer"


def run_case(server: Server, index: int, case: HttpCase, limit_s: float,
             rss_limit_mb: float) -> dict:
    """One case and the server's state after it, as its JSON line."""
    started = time.monotonic()
    try:
        statuses, failure, note = exchange(server.address, case, limit_s)
    except OSError as e:  # cannot even connect
        statuses, failure, note = [], f"connect: {e}", ""
    seconds = time.monotonic() - started
    if failure is None and server.process.poll() is not None:
        failure = f"the server died (exit {server.process.returncode})"
    if failure is None and not server.healthy():
        failure = f"unhealthy: GET /health not answered 200 within {HEALTH_S:g} s"
    peak = server.memory_mb()
    if failure is None and peak > rss_limit_mb:
        failure = f"peak RSS: {peak:.0f} MB > {rss_limit_mb:g} MB"
    lines = server.new_log_lines()
    bad = [line for line in lines if any(word in line for word in BAD_LOG)]
    if failure is None and bad:
        failure = f"server log: {bad[0][:200]}"
    return {
        "case": index, "kind": "http", "seed": "gguf", "target": "connection",
        "mutation": case.name, "expect": case.expect,
        "outcome": "failure" if failure else "clean",
        "reason": failure or (f"{note}: {statuses}" if statuses else note),
        "exit": None, "seconds": round(seconds, 3), "peak_rss_mb": round(peak, 1),
        "rss_growth_mb": round(max(0.0, server.memory_mb("VmRSS") - server.start_rss_mb), 1),
        "stderr_lines": len(lines), "stderr": (bad or lines or [""])[0][:400],
        "statuses": statuses, "bytes": len(case.data),
    }


def run_http(n: int, seed: int, checkpoint: Path, folder: Path, time_limit_s: float,
             rss_limit_mb: float, first_index: int = 0,
             on_result: Callable[[dict, HttpCase], None] | None = None
             ) -> tuple[list[dict], dict]:
    """`n` HTTP cases against one server on `checkpoint`: (their results, numbers for the
    summary: the server's start seconds and RSS)."""
    cases = plan_http(n, seed)
    limit_s = min(time_limit_s, HTTP_TIME_LIMIT_S)
    server = Server(checkpoint, folder)
    results = []
    try:
        for i, case in enumerate(cases):
            result = run_case(server, first_index + i, case, limit_s, rss_limit_mb)
            results.append(result)
            if on_result:
                on_result(result, case)
    finally:
        end_rss = server.memory_mb("VmRSS")
        server.stop()
    return results, {"http_server_start_s": round(server.start_seconds, 1),
                     "http_server_rss_mb": [round(server.start_rss_mb, 1), round(end_rss, 1)]}


def keep(result: dict, case: HttpCase, out: Path) -> Path:
    """A failing case's bytes (request.bin, the sends one after another) and case.json (the
    sizes and pauses of its sends, and its result), for --replay."""
    dest = out / f"{result['case']:05d}-http"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "request.bin").write_bytes(case.data)
    meta = {"sends": [[len(data), pause] for data, pause in case.sends],
            "statuses": None if case.statuses is None else sorted(case.statuses), **result}
    (dest / "case.json").write_text(json.dumps(meta, indent=1) + "\n")
    return dest


def replay(folder: Path, checkpoint: Path, time_limit_s: float, rss_limit_mb: float) -> dict:
    """A kept case (`keep`) against a fresh server."""
    meta = json.loads((folder / "case.json").read_text())
    data, sends, at = (folder / "request.bin").read_bytes(), [], 0
    for size, pause in meta["sends"]:
        sends.append((data[at:at + size], pause))
        at += size
    statuses = None if meta.get("statuses") is None else frozenset(meta["statuses"])
    case = HttpCase(meta["mutation"], tuple(sends), statuses, meta.get("expect", "any"))
    server = Server(checkpoint, folder / "replay")
    try:
        return run_case(server, meta["case"], case, min(time_limit_s, HTTP_TIME_LIMIT_S),
                        rss_limit_mb)
    finally:
        server.stop()
