"""The fuzz harness's HTTP cases (bench/fuzz_http.py, issue 33): raw bytes a client could send to
`jllama serve`, crafted (framing, sizes, content types, slashes, deep and huge JSON, pipelining,
slow senders) and random damage to a valid request (bit flips, truncation, insertion, deletion,
a line repeated, a number replaced).

A case is what goes over one fresh TCP connection, in one or more sends with pauses between
them; what the server must answer is decided by fuzz_http's oracle (h11, the server's own parser,
says which requests the bytes hold), and a crafted case may also name the statuses its first
answer must have (a trailing slash: 200; a declared 2^64 bytes: 413).
"""

from __future__ import annotations

import dataclasses
import json
import random

from fuzz_mutations import INTERESTING, pow_name  # bench/ is the script's folder

MODEL = "model"  # the GGUF seed's name as `jllama serve` gives it (the file's stem)
LIMIT = 4 * 1024 * 1024  # the server's body limit (jllama.server.transport.MAX_BODY_BYTES)
COMPLETION = {"model": MODEL, "prompt": "Hi there", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "temperature": 0}


@dataclasses.dataclass(frozen=True)
class HttpCase:
    """One connection's bytes.

    Attributes:
      name: what the bytes are, e.g. "http.content_length[2^64]" or "http.bitflip@83x2[chat]".
      sends: (bytes, seconds to pause after sending them), in order.
      statuses: statuses the first answer must have (crafted cases), or None (any the rules
        allow: fuzz_http's docstring).
      expect: "crafted" or "any" (random damage).
    """

    name: str
    sends: tuple[tuple[bytes, float], ...]
    statuses: frozenset[int] | None = None
    expect: str = "crafted"

    @property
    def data(self) -> bytes:
        return b"".join(data for data, _ in self.sends)


def request(method: str = "POST", path: str = "/v1/completions", body: bytes | dict | None = None,
            content_type: str | None = "application/json", headers: tuple[str, ...] = (),
            length: str | None = "auto", version: str = "1.1") -> bytes:
    """An HTTP/1.1 request's bytes; `length` "auto" declares the body's own length (None: no
    Content-Length line); a dict body is JSON."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1"]
    if body is not None and content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if length == "auto" and body is not None:
        lines.append(f"Content-Length: {len(body)}")
    elif length not in (None, "auto"):
        lines.append(f"Content-Length: {length}")
    lines += headers
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chunked(body: bytes, sizes: tuple[int, ...] = (7,)) -> bytes:
    """`body` as HTTP chunks of the given sizes (the last one repeated), then the last chunk."""
    out, at, i = [], 0, 0
    while at < len(body):
        size = sizes[min(i, len(sizes) - 1)]
        out.append(b"%x\r\n%s\r\n" % (len(body[at:at + size]), body[at:at + size]))
        at, i = at + size, i + 1
    return b"".join(out) + b"0\r\n\r\n"


def _case(name: str, data: bytes, statuses: tuple[int, ...] | None = None,
          pause: float = 0.0) -> HttpCase:
    return HttpCase(f"http.{name}", ((data, pause),),
                    None if statuses is None else frozenset(statuses))


def _slowly(name: str, data: bytes, every: float, statuses: tuple[int, ...] | None) -> HttpCase:
    """`data` sent a byte at a time, `every` seconds apart (slowloris)."""
    return HttpCase(f"http.{name}", tuple((data[i:i + 1], every) for i in range(len(data))),
                    None if statuses is None else frozenset(statuses))


def crafted() -> list[HttpCase]:
    """Every crafted case (deterministic)."""
    body = json.dumps(COMPLETION).encode()
    te = ("Transfer-Encoding: chunked",)
    cases = [
        _case("valid[completion]", request(body=COMPLETION), (200,)),
        _case("valid[chat]", request(path="/v1/chat/completions", body=CHAT), (200,)),
        _case("valid[stream]", request(body={**COMPLETION, "stream": True}), (200,)),
        _case("valid[health]", request("GET", "/health"), (200,)),
        _case("valid[models]", request("GET", "/v1/models"), (200,)),
        _case("valid[metrics]", request("GET", "/metrics"), (200,)),
        _case("valid[chunked]", request(body=chunked(body), length=None, headers=te), (200,)),
    ]
    # Trailing slashes: the route without the slash answers.
    for method, path, payload in (("POST", "/v1/completions/", COMPLETION),
                                  ("POST", "/v1/chat/completions/", CHAT),
                                  ("POST", "/v1/completions//", COMPLETION),
                                  ("GET", "/health/", None), ("GET", "/v1/models/", None),
                                  ("GET", f"/v1/models/{MODEL}/", None)):
        cases.append(_case(f"trailing_slash[{method} {path}]",
                           request(method, path, payload), (200,)))
    # Declared lengths: over the limit is a 413 at once, whether or not the body comes.
    for n in (2**64, 2**64 - 1, 10**19, 10**9, 10 * 1024 * 1024, LIMIT + 1):
        cases.append(_case(f"content_length[{pow_name(n)}, no body]",
                           request(body=b"{", length=str(n)), (413,)))
    cases.append(_case("content_length[limit+1, sent]",
                       request(body=b" " * (LIMIT + 1)), (413,)))
    cases.append(_case("content_length[limit, sent]", request(body=b" " * LIMIT), (400,)))
    for value in ("10" * 11, "-1", "abc", "1e3", "0x10", " ", "+5", "5 5", "\xb2"):
        cases.append(_case(f"content_length[{value!r}]",
                           request(body=body, length=value), (400,)))
    cases += [
        _case("content_length[two different]",
              request(body=body, headers=(f"Content-Length: {len(body) + 1}",)), (400,)),
        _case("content_length[two equal]",
              request(body=body, headers=(f"Content-Length: {len(body)}",)), (200,)),
        _case("content_length['n, n+1']",
              request(body=body, length=f"{len(body)}, {len(body) + 1}"), (400,)),
        _case("content_length[0, body follows]", request(body=body, length="0"), (400,)),
        _case("content_length[short by 10]", request(body=body, length=str(len(body) - 10))),
        _case("content_length[long by 10]", request(body=body, length=str(len(body) + 10))),
        _case("content_length[100, body never sent]", request(body=b"", length="100")),
        _case("content_length[with transfer-encoding]",
              request(body=chunked(body), headers=te, length=str(len(body))), (400,)),
    ]
    # Chunked framing.
    for name, chunks, statuses in (
            ("bad size 'zz'", b"zz\r\n{}\r\n0\r\n\r\n", (400,)),
            ("negative size", b"-1\r\n{}\r\n0\r\n\r\n", (400,)),
            ("size 2^80", b"%x\r\n{}" % 2**80, None),
            ("size of 1000 digits", b"1" * 1000 + b"\r\n", (400,)),
            ("no CRLF after data", b"2\r\n{}XX0\r\n\r\n", (400,)),
            ("extension", b"%x;name=value\r\n%s\r\n0\r\n\r\n" % (len(body), body), (200,)),
            ("trailer", b"%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (len(body), body), (200,)),
            ("no last chunk", b"%x\r\n%s\r\n" % (len(body), body), None),
            ("over the limit, open", b"".join(b"100000\r\n" + b" " * 0x100000 + b"\r\n"
                                              for _ in range(5)), (413,))):
        cases.append(_case(f"chunked[{name}]", request(body=chunks, length=None, headers=te),
                           statuses))
    cases += [
        _case("transfer_encoding[gzip]", request(body=body, length=None,
                                                 headers=("Transfer-Encoding: gzip",)), (400,)),
        _case("transfer_encoding[twice]", request(body=chunked(body), length=None,
                                                  headers=te + te), (400,)),
        _case("transfer_encoding[gzip, chunked]",
              request(body=chunked(body), length=None,
                      headers=("Transfer-Encoding: gzip, chunked",)), (400,)),
    ]
    # Heads too large or malformed.
    cases += [
        _case("header[a line of 1 MB]", request(body=body, headers=("X-Big: " + "a" * 2**20,)),
              (400,)),
        _case("header[10,000 lines]", request(body=body, headers=tuple(
            f"X-{i}: {i}" for i in range(10_000))), (400,)),
        _case("header[200 lines]", request(body=body, headers=tuple(
            f"X-{i}: {i}" for i in range(200))), (200,)),
        _case("header[no colon]", request(body=body, headers=("NoColon",)), (400,)),
        _case("header[space in name]", request(body=body, headers=("Bad Name: x",)), (400,)),
        _case("header[NUL in value]", request(body=body, headers=("X-A: a\x00b",)), (400,)),
        _case("header[folded line]", request(body=body, headers=("X-A: a", " b"))),
        _case("header[no Host]", request(body=body).replace(b"Host: 127.0.0.1\r\n", b""),
              (400,)),
        _case("request_line[path of 60 KB]", request("GET", "/" + "a" * 60_000), (404,)),
        _case("request_line[path of 1 MB]", request("GET", "/" + "a" * 2**20), (400,)),
        _case("request_line[byte 0xff in path]", b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n",
              (400,)),
        _case("request_line[%00 in path]", request("GET", "/health%00"), (404,)),
        _case("request_line[bad escape]", request("GET", "/health%zz"), (404,)),
        _case("request_line[absolute form]", request("GET", "http://127.0.0.1/health")),
        _case("request_line[asterisk]", request("OPTIONS", "*")),
        _case("request_line[HTTP/1.0, no Host]", b"GET /health HTTP/1.0\r\n\r\n", (200,)),
        _case("request_line[HTTP/2 preface]", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
        _case("request_line[HTTP/9.9]", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n"),
        _case("request_line[lower-case method]", request("get", "/health")),
        _case("request_line[garbage]", b"\x00\x01\x02\xff\xfe\r\n\r\n", (400,)),
        _case("request_line[LF only]", request(body=body).replace(b"\r\n", b"\n"), (200,)),
        _case("request_line[TLS hello]", bytes.fromhex("16030100a5010000a10303") + bytes(160),
              (400,)),
    ]
    for method in ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"):
        cases.append(_case(f"method[{method}]", request(method, "/v1/completions", COMPLETION),
                           (405,)))
    cases += [
        _case("method[HEAD /health]", request("HEAD", "/health"), (200,)),
        _case("method[GET /v1/completions]", request("GET", "/v1/completions"), (405,)),
        _case("method[POST /health]", request("POST", "/health", COMPLETION), (405,)),
        _case("path[unknown]", request(path="/v2/completions", body=COMPLETION), (404,)),
        _case("path[query string]", request(path="/v1/completions?x=1&y", body=COMPLETION),
              (200,)),
        _case("expect[100-continue]", request(body=body, headers=("Expect: 100-continue",)),
              (200,)),
        _case("expect[100-continue over the limit]",
              request(body=b"{", length=str(10**9), headers=("Expect: 100-continue",)),
              (413,)),
        _case("upgrade[websocket]", request("GET", "/health", headers=(
            "Connection: Upgrade", "Upgrade: websocket", "Sec-WebSocket-Version: 13",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==")), (200,)),
        _case("upgrade[h2c]", request(body=body, headers=(
            "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAA")),
              (200,)),
        _case("connection[close]", request(body=body, headers=("Connection: close",)), (200,)),
    ]
    # Content types and encodings.
    for content_type, status in (("text/plain", 415), ("image/png", 415),
                                 ("multipart/form-data; boundary=x", 415),
                                 ("application/xml", 415), ("application/json; charset=utf-16", 415),
                                 ("application/json; charset=latin-1", 415),
                                 ("application/x-www-form-urlencoded", 200),
                                 ("APPLICATION/JSON; CHARSET=UTF-8", 200),
                                 ("application/json;charset=\"utf-8\"", 200), ("", 200)):
        cases.append(_case(f"content_type[{content_type!r}]",
                           request(body=body, content_type=content_type), (status,)))
    cases.append(_case("content_type[none]", request(body=body, content_type=None), (200,)))
    cases.append(_case("content_type[twice, different]", request(
        body=body, headers=("Content-Type: text/plain",)), (400,)))
    text = json.dumps(COMPLETION)
    for name, data, status in (
            ("utf-16", text.encode("utf-16"), 400), ("utf-16-le", text.encode("utf-16-le"), 400),
            ("utf-32", text.encode("utf-32"), 400), ("utf-8 BOM", b"\xef\xbb\xbf" + body, 200),
            ("byte 0xff", body.replace(b"Hi", b"H\xff"), 400),
            ("overlong '/'", body.replace(b"Hi", b"H\xc0\xaf"), 400),
            ("surrogate D800", body.replace(b"Hi", b"H\xed\xa0\x80"), 400),
            ("cut character", body.replace(b"Hi", b"H\xe2\x82"), 400),
            ("escaped lone surrogate", body.replace(b"Hi", b"H\\ud800"), 400),
            ("NUL in prompt", body.replace(b"Hi", b"H\\u0000"), 200),
            ("latin-1 in JSON string", body.replace(b"Hi", b"H\xe9"), 400)):
        cases.append(_case(f"encoding[{name}]", request(body=data), (status,)))
    # JSON that is deep, huge or not an object.
    deep = 10**5
    for name, data in (
            ("prompt nested 10^5 deep", text.replace('"Hi there"', "[" * deep + "]" * deep)),
            ("object nested 10^5 deep", '{"model": "model", "x": ' + '{"a": ' * deep + "1"
             + "}" * deep + "}"),
            ("messages nested 10^5 deep", json.dumps(CHAT).replace(
                '"Hi"', "[" * deep + "]" * deep)),
            ("array body nested 10^5 deep", "[" * deep + "]" * deep),
            ("unclosed 10^5 deep", "[" * deep)):
        path = "/v1/chat/completions" if "messages" in name else "/v1/completions"
        cases.append(_case(f"json[{name}]", request(path=path, body=data.encode()), (400,)))
    digits = "9" * 5000
    for field, value, status in (
            ("max_tokens", digits, 400), ("seed", digits, 400), ("temperature", digits, 400),
            ("temperature", "0." + "0" * 4998 + "1", 200), ("temperature", "1e5000", 400),
            ("top_p", "-" + digits, 400), ("logprobs", digits, 400)):
        data = text.replace('"temperature": 0', f'"temperature": 0, "{field}": {value}') \
            if field != "temperature" else text.replace('"temperature": 0', f'"temperature": {value}')
        cases.append(_case(f"json[{field} of {len(value)} characters]", request(body=data.encode()),
                           (status,)))
    cases += [
        _case("json[prompt ids of 5000 digits]",
              request(body=text.replace('"Hi there"', f"[1, {digits}]").encode()), (400,)),
        _case("json[logit_bias key of 5000 digits]", request(body=text.replace(
            '"temperature": 0', f'"temperature": 0, "logit_bias": {{"{digits}": 1}}').encode()),
              (400,)),
        _case("json[NaN]", request(body=text.replace('"temperature": 0', '"temperature": NaN')
                                   .encode()), (400,)),
        _case("json[duplicate keys]", request(body=text.replace(
            '"temperature": 0', '"temperature": 0, "temperature": 9').encode()), (400,)),
        _case("json[empty body]", request(body=b""), (400,)),
        _case("json[not an object]", request(body=b'"hi"'), (400,)),
        _case("json[prompt of 4 MB]", request(body=text.replace(
            "Hi there", "a" * (LIMIT - 200)).encode()), (400,)),
        _case("json[100,000 keys]", request(body=("{" + ", ".join(
            f'"k{i}": {i}' for i in range(100_000)) + "}").encode()), (400,)),
        _case("json[stop of 10^5 strings]", request(body=text.replace(
            '"temperature": 0', '"temperature": 0, "stop": [' + ", ".join(['"a"'] * 10**5)
            + "]").encode()), (400,)),
    ]
    # Several requests in one send (pipelining), and senders that pause.
    one = request(body=body)
    health = request("GET", "/health")
    cases += [
        _case("pipelined[two completions]", one + one, (200,)),
        _case("pipelined[50 health checks]", health * 50, (200,)),
        _case("pipelined[completion then garbage]", one + b"\x00garbage\r\n\r\n", (200,)),
        _case("pipelined[after Connection: close]",
              request(body=body, headers=("Connection: close",)) + one, (200,)),
        _case("pipelined[413 body, then health]", request(body=b" " * (LIMIT + 1)) + health,
              (413,)),
        _case("pipelined[two chunked]", 2 * request(body=chunked(body), length=None,
                                                     headers=te), (200,)),
        _slowly("slow[whole request, a byte per 5 ms]", one, 0.005, (200,)),
        _slowly("slow[half a head, a byte per 20 ms]", one[:40], 0.02, None),
        HttpCase("http.slow[head, then body 1 s later]",
                 ((one[:one.index(b"\r\n\r\n") + 4], 1.0), (body, 0.0)), frozenset((200,))),
        HttpCase("http.slow[oversized head, then nothing]",
                 ((request(body=b"{", length=str(10**9)), 1.0),), frozenset((413,))),
    ]
    return cases


TOKENS = (b"\r\n", b"\r\n\r\n", b"\n", b"\r", b":", b" ", b"\x00", b"\xff", b"%", b"/",
          b"?", b"{", b"}", b"[", b"\"", b"\\", b",", b"-", b"0", b"9" * 30,
          b"Content-Length: 99999999999\r\n", b"Transfer-Encoding: chunked\r\n",
          b"Content-Type: text/plain\r\n", b"Connection: close\r\n", b"\xc0\xaf",
          b"\xed\xa0\x80", b"[" * 1000, b"\\ud800", b"1e999", b"NaN")
"""Byte strings worth inserting: framing tokens, bytes that are not UTF-8, JSON punctuation,
headers that change the framing."""


def valid_requests() -> list[tuple[str, bytes]]:
    """The requests random damage starts from, as (name, bytes)."""
    body = json.dumps(COMPLETION).encode()
    return [
        ("completion", request(body=COMPLETION)),
        ("chat", request(path="/v1/chat/completions", body=CHAT)),
        ("stream", request(body={**COMPLETION, "stream": True,
                                 "stream_options": {"include_usage": True}})),
        ("chunked", request(body=chunked(body, (5, 11)), length=None,
                            headers=("Transfer-Encoding: chunked",))),
        ("health", request("GET", "/health")),
        ("logprobs", request(body={**COMPLETION, "logprobs": 2, "stop": ["x"],
                                   "logit_bias": {"5": 1}, "seed": 3})),
    ]


def random_case(rng: random.Random) -> HttpCase:
    """A valid request damaged by one to three random edits."""
    name, data = rng.choice(valid_requests())
    data = bytearray(data)
    edits = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        edit = rng.choice(("bitflip", "truncate", "insert", "delete", "repeat_line",
                           "number"))
        at = rng.randrange(len(data) + 1)
        if edit == "bitflip":
            count = rng.randint(1, 8)
            for _ in range(count):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
            edits.append(f"bitflip x{count}")
        elif edit == "truncate":
            del data[at:]
            edits.append(f"truncate@{at}")
        elif edit == "insert":
            token = rng.choice(TOKENS) if rng.random() < 0.7 else rng.randbytes(
                rng.randint(1, 16))
            data[at:at] = token
            edits.append(f"insert@{at}")
        elif edit == "delete":
            n = rng.randint(1, 16)
            del data[at:at + n]
            edits.append(f"delete@{at}x{n}")
        elif edit == "repeat_line":
            lines = bytes(data).split(b"\r\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[i])
            data = bytearray(b"\r\n".join(lines))
            edits.append(f"repeat_line{i}")
        else:
            numbers = [i for i in range(len(data)) if 48 <= data[i] <= 57]  # ASCII digits
            if numbers:
                i = rng.choice(numbers)
                j = i
                while j < len(data) and 48 <= data[j] <= 57:
                    j += 1
                value = rng.choice(INTERESTING + (-1, 10**30))
                data[i:j] = str(value).encode()
                edits.append(f"number@{i}={pow_name(abs(value)) if value > 0 else value}")
        if not data:
            data = bytearray(b"\r\n")
    return HttpCase(f"http.{'+'.join(edits)}[{name}]", ((bytes(data), 0.0),), expect="any")


def plan_http(n: int, seed: int) -> list[HttpCase]:
    """`n` cases: every crafted one (a seeded sample when n is smaller), then random damage,
    each drawn from a generator of its own seeded from `seed`."""
    rng = random.Random(seed ^ 0x4854_5450)  # "HTTP": apart from the file kinds' draws
    cases = crafted()
    cases = cases if len(cases) <= n else rng.sample(cases, n)
    while len(cases) < n:
        cases.append(random_case(random.Random(rng.randrange(2**63))))
    return cases
