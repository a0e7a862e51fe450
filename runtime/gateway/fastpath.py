"""The invoke fast path: ``POST /v1/functions/{name}/invoke`` answered below aiohttp's web layer.

Note [invoke fast path]: a small invocation spent most of the gateway's CPU in aiohttp's
application layer (request and response objects, routing, three middlewares) rather than in
anything the gateway decides (see "Gateway hot path" in docs/runtime.md). Each connection
therefore starts on this path (:class:`FastConnection`, driven by the connection guard in
``connections.py``): it parses a request head itself and, when the request is a plain
invocation it can answer exactly as the aiohttp route would, runs it through the same
:meth:`Gateway.invoke` and writes the response bytes itself. Anything else, at a request
boundary and before a byte of it was acted on, is *handed over*: the raw bytes go to aiohttp's
own protocol, which serves that connection from then on. So the fast path only ever answers
requests it fully understands, and every other request, malformed ones included, meets
aiohttp's parser and the routes and middlewares as before.

What it answers (:func:`parse_head`, :meth:`FastInvoke.accept`): HTTP/1.1, ``POST`` to
exactly ``/v1/functions/{name}/invoke`` (no query, no escapes) of a deployed function, an
ASCII head under 8 KiB without control characters, repeated or invalid header names,
``Transfer-Encoding``, ``Expect``, ``Upgrade``, ``Prefer`` or ``trims-trace-level``, a
``Connection`` of ``close`` or ``keep-alive`` if any, a ``Content-Length`` of digits within the
function's body limit with the whole body already received, and a caller the authenticator
lets invoke the function. A refusal the gateway makes itself (401, 403, 404, 413, ...) is
therefore always aiohttp's; the fast path answers the function's reply or the errors of the
invocation itself (draining, queue full, timeouts, a dead instance) with the bytes the error
middleware would send, and counts each request in the same HTTP metrics series.

It is off when spans are recorded (the tracing middleware makes one per request) and with the
access log on, and ``GatewaySettings.fast_path`` turns it off (``--no-fast-path``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import NamedTuple

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE

from trims.errors import TrimsError, UpstreamError
from trims.runtime.gateway.auth import Authenticator
from trims.runtime.gateway.context import AUTH, GATEWAY
from trims.runtime.gateway.errors import (
    log_trims_error,
    trims_error_parts,
    unexpected_error_parts,
)
from trims.runtime.gateway.metrics import GatewayMetrics
from trims.runtime.gateway.service import Gateway
from trims.runtime.settings import GatewaySettings

__all__ = [
    "FastConnection",
    "FastInvoke",
    "Head",
    "check_reply",
    "fast_invoke_for",
    "parse_head",
    "response_head",
]

log = logging.getLogger(__name__)

#: The route template the metrics count these requests under (the aiohttp route's canonical).
ROUTE = "/v1/functions/{name}/invoke"
_PREFIX = b"POST /v1/functions/"
_SUFFIX = b"/invoke HTTP/1.1"
#: aiohttp's default limit on a request line and on a header field.
MAX_HEAD = 8190
HEAD_END = b"\r\n\r\n"
_NAME = re.compile(rb"[a-z0-9][-a-z0-9]{0,62}")
_TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
#: Control characters, CR and LF included (the head is searched with its line breaks masked).
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: Request headers whose presence means the request is not a plain invocation.
_NOT_PLAIN = frozenset({"transfer-encoding", "expect", "upgrade", "prefer", "trims-trace-level"})
#: Response headers the gateway sets itself (as ``api_functions.outcome_response``).
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_REASONS = {int(s): s.phrase for s in HTTPStatus}
_STR_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Head(NamedTuple):
    """A plain invocation's head: the function, headers (names lower-cased), sizes."""

    function: str
    headers: dict[str, str]
    head_len: int
    body_len: int
    close: bool


#: :func:`parse_head`'s answer while the head has not fully arrived.
INCOMPLETE = "incomplete"


def parse_head(buf: bytes) -> Head | str | None:
    """The plain invocation at the start of ``buf``; :data:`INCOMPLETE` while its head is still
    arriving; None when the request is anything else (aiohttp's to answer)."""
    end = buf.find(HEAD_END, 0, MAX_HEAD + 4)
    if end < 0:
        return INCOMPLETE if len(buf) < MAX_HEAD + 4 else None
    head = buf[:end]
    if not head.isascii() or _CTL.search(head.replace(b"\r\n", b"\t")):
        return None
    lines = head.split(b"\r\n")
    line = lines[0]
    if not (line.startswith(_PREFIX) and line.endswith(_SUFFIX)):
        return None
    name = line[len(_PREFIX) : -len(_SUFFIX)]
    if not _NAME.fullmatch(name):
        return None
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        key, sep, value = raw.decode("ascii").partition(":")
        if not sep or not _TOKEN.fullmatch(key):
            return None
        key = key.lower()
        if key in headers or key in _NOT_PLAIN:
            return None
        headers[key] = value.strip(" \t")
    body_len = 0
    declared = headers.get("content-length")
    if declared is not None:
        if not (declared.isdigit() and len(declared) <= 15):
            return None
        body_len = int(declared)
    connection = headers.get("connection")
    close = False
    if connection is not None:
        token = connection.lower()
        if token not in ("close", "keep-alive"):
            return None
        close = token == "close"
    return Head(name.decode("ascii"), headers, end + 4, body_len, close)


_date_cache: list[object] = [0, ""]


def _http_date() -> str:
    now = int(time.time())
    if now != _date_cache[0]:
        _date_cache[0] = now
        _date_cache[1] = formatdate(now, usegmt=True)
    return str(_date_cache[1])


def _bad_header(key: str, value: str) -> bool:
    return not _TOKEN.fullmatch(key) or bool(_STR_CTL.search(value.replace("\t", " ")))


def _invalid(what: str) -> UpstreamError:
    return UpstreamError(f"the function answered {what}, which is not valid HTTP")


def check_reply(status: int, headers: Mapping[str, str]) -> None:
    """Raise :class:`UpstreamError` for a function's status or header that is not valid HTTP
    (a reply is not trusted to be: a header value with a line break would split the
    response). The aiohttp route checks with this, and :func:`response_head` calls it."""
    if not 100 <= status <= 599:
        raise _invalid(f"status {status}")
    for key, value in headers.items():
        if key.lower() not in HOP_HEADERS and _bad_header(key, value):
            raise _invalid(f"a header {key[:64]!r}")


def response_head(status: int, headers: Mapping[str, str], body_len: int, *, close: bool) -> bytes:
    """The status line and headers aiohttp's ``web.Response`` would send for this answer:
    the given headers less :data:`HOP_HEADERS`, ``Content-Length``, a default
    ``Content-Type``, ``Date``, ``Server`` and, when closing, ``Connection: close``.

    Raises :class:`UpstreamError` as :func:`check_reply` does.
    """
    check_reply(status, headers)
    parts = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"]
    typed = False
    for key, value in headers.items():
        low = key.lower()
        if low in HOP_HEADERS:
            continue
        typed = typed or low == "content-type"
        parts.append(f"{key}: {value}\r\n")
    parts.append(f"Content-Length: {body_len}\r\n")
    if not typed:
        parts.append("Content-Type: application/octet-stream\r\n")
    parts.append(f"Date: {_http_date()}\r\nServer: {SERVER_SOFTWARE}\r\n")
    if close:
        parts.append("Connection: close\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("utf-8")


class FastInvoke:
    """Decides whether a parsed head is the fast path's to answer, and answers it."""

    def __init__(self, gateway: Gateway, auth: Authenticator, metrics: GatewayMetrics) -> None:
        self._gateway = gateway
        self._auth = auth
        self._series = metrics.http_series
        self._max_body = gateway.settings.max_body_bytes
        #: Requests answered here (the rest were aiohttp's).
        self.answered = 0

    def accept(self, head: Head) -> bool:
        """Whether this invocation may run here: a deployed function, a body within its limit,
        a caller allowed to invoke it. Otherwise aiohttp answers it (404, 413, 401/403)."""
        pool = self._gateway.pools.get(head.function)
        if pool is None:
            return False
        if head.body_len > min(self._max_body, pool.spec.scaling.max_body_bytes):
            return False
        return self._auth.allows_invoke(head.headers.get("authorization"), head.function)

    async def answer(self, head: Head, body: bytes) -> bytes:
        """The response to one accepted invocation, counted in the HTTP metrics."""
        started = time.monotonic()
        status = 500
        self.answered += 1
        try:
            try:
                outcome = await self._gateway.invoke(head.function, body, head.headers)
                data = outcome.body
                out = response_head(outcome.status, outcome.headers, len(data), close=head.close)
                status = outcome.status
            except TrimsError as e:
                log_trims_error("POST", f"/v1/functions/{head.function}/invoke", e)
                status, headers, data = trims_error_parts(e)
                out = response_head(status, headers, len(data), close=head.close)
            except Exception:
                log.exception("POST /v1/functions/%s/invoke failed unexpectedly", head.function)
                status, headers, data = unexpected_error_parts()
                out = response_head(status, headers, len(data), close=head.close)
            return out + data
        finally:
            series = self._series(ROUTE, "POST", status)
            series[0].inc()
            series[1].observe(time.monotonic() - started)


def fast_invoke_for(app: web.Application, settings: GatewaySettings) -> FastInvoke | None:
    """The app's fast path, or None where it must stay off (see the module note)."""
    gateway = app[GATEWAY]
    if not settings.fast_path or settings.access_log or gateway.tracing:
        return None
    return FastInvoke(gateway, app[AUTH], gateway.metrics)


#: Buffered bytes past which a connection stops reading while a request runs (pipelining).
_PAUSE_AT = 1 << 20


class FastConnection:
    """One connection on the fast path (see Note [invoke fast path]).

    ``hand_over(pending)`` is called, at most once, with the bytes of the requests not answered
    yet (starting at a request's first byte) when one of them is not the fast path's; the
    caller then gives the connection to aiohttp. Requests are answered one at a time, in
    order; an idle connection closes after ``keepalive_s``.
    """

    def __init__(
        self,
        transport: asyncio.Transport,
        fast: FastInvoke,
        hand_over: Callable[[bytes], None],
        keepalive_s: float,
    ) -> None:
        self._transport = transport
        self._fast = fast
        self._hand_over = hand_over
        self._keepalive_s = keepalive_s
        self._loop = asyncio.get_running_loop()
        self._buf = b""
        self._busy = False
        self._closed = False
        #: Shutting down: close once the running request is answered.
        self._closing = False
        self._write_paused = False
        self._read_paused = False
        self._idle_since = self._loop.time()
        self._keepalive = self._loop.call_at(self._idle_since + keepalive_s, self._check_idle)

    def feed(self, data: bytes) -> None:
        self._buf = self._buf + data if self._buf else data
        if self._busy or self._write_paused:
            if len(self._buf) > _PAUSE_AT and not self._read_paused:
                self._read_paused = True
                self._transport.pause_reading()
            return
        self._next()

    def _next(self) -> None:
        """Start the next buffered request, or hand the connection over."""
        if self._closed or self._write_paused:
            return
        buf = self._buf
        if not buf:
            return
        head = parse_head(buf)
        if isinstance(head, Head) and self._fast.accept(head):
            end = head.head_len + head.body_len
            if len(buf) >= end:
                self._buf = buf[end:]
                self._busy = True
                task = self._loop.create_task(self._run(head, buf[head.head_len : end]))
                task.add_done_callback(_log_failure)
                return
        self._give_up()

    def _give_up(self) -> None:
        buf, self._buf = self._buf, b""
        self._release()
        if self._read_paused:
            self._read_paused = False
            self._transport.resume_reading()
        self._hand_over(buf)

    async def _run(self, head: Head, body: bytes) -> None:
        response = await self._fast.answer(head, body)
        self._busy = False
        if self._closed:
            return
        self._transport.write(response)
        if head.close or self._closing:
            self._close()
            return
        self._idle_since = self._loop.time()
        if self._read_paused and len(self._buf) <= _PAUSE_AT:
            self._read_paused = False
            self._transport.resume_reading()
        self._next()

    def _check_idle(self) -> None:
        if self._closed:
            return
        now = self._loop.time()
        due = self._idle_since + self._keepalive_s
        if not self._busy and not self._buf and now >= due:
            self._close()
            return
        self._keepalive = self._loop.call_at(max(due, now + 1.0), self._check_idle)

    def _close(self) -> None:
        self._release()
        self._transport.close()

    def _release(self) -> None:
        self._closed = True
        self._keepalive.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if not self._busy:
            self._next()

    def close_when_idle(self) -> None:
        """Shutting down: close now when idle, else after the running request's answer."""
        if not self._busy:
            self._close()
        else:
            self._closing = True

    def connection_lost(self) -> None:
        self._release()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("fast-path request failed", exc_info=task.exception())
