"""The fast path: ``POST /v1/functions/{name}/invoke`` and the Open Inference Protocol's ``POST
/v2/models/{name}[/versions/{version}]/infer`` answered below aiohttp's web layer.

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

What it answers (:func:`parse_head`, :meth:`FastInvoke.accept`, :meth:`FastInvoke.prepare`):
HTTP/1.1, ``POST`` to exactly one of those paths (no query, no escapes) of a deployed function
(for infer: one that serves a model, loaded, and the version it names), an ASCII head under
8 KiB without control characters, repeated or invalid header names, ``Transfer-Encoding``,
``Content-Encoding``, ``Expect``, ``Upgrade``, ``Prefer`` or ``trims-trace-level``, a
``Connection`` of ``close`` or ``keep-alive`` if any, a ``Content-Length`` of digits within the
function's body limit with the whole body already received, a caller the authenticator lets
invoke the function, and for infer a body that parses as an infer request naming no shared
memory (the parse has no side effect, so a body that fails it still goes to aiohttp whole). A
refusal the gateway makes itself (401, 403, 404, 413, a malformed infer request's 400, ...)
is therefore always aiohttp's; the fast path answers the function's reply or the errors of
the invocation itself (draining, queue full, timeouts, a dead instance, inputs that do not
match the model) with the bytes the error middleware would send, and counts each request in
the same HTTP metrics series. An infer request on aiohttp's path cost the gateway about
410 us of CPU (a small MLP, 2 instances, 16 in flight, 2-core VM), most of it in aiohttp's
request and response objects and the three middlewares.

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
from trims.oip import HEADER_LENGTH
from trims.runtime.gateway.auth import Authenticator
from trims.runtime.gateway.context import AUTH, GATEWAY
from trims.runtime.gateway.errors import (
    log_trims_error,
    trims_error_parts,
    unexpected_error_parts,
)
from trims.runtime.gateway.metrics import GatewayMetrics
from trims.runtime.gateway.oip_repository import REPOSITORY, Repository
from trims.runtime.gateway.service import Gateway
from trims.runtime.gateway.tensors import (
    InferRequest,
    check_inputs,
    encode_response,
    parse_request,
)
from trims.runtime.settings import GatewaySettings

__all__ = [
    "INFER_ROUTE",
    "INFER_VERSION_ROUTE",
    "FastConnection",
    "FastInvoke",
    "Head",
    "check_reply",
    "fast_invoke_for",
    "parse_head",
    "response_head",
]

log = logging.getLogger(__name__)

#: The route templates the metrics count these requests under (the aiohttp routes' canonical).
ROUTE = "/v1/functions/{name}/invoke"
INFER_ROUTE = "/v2/models/{name}/infer"
INFER_VERSION_ROUTE = "/v2/models/{name}/versions/{version}/infer"
_PREFIX = b"POST /v1/functions/"
_SUFFIX = b"/invoke HTTP/1.1"
_INFER_PREFIX = b"POST /v2/models/"
_INFER_SUFFIX = b"/infer HTTP/1.1"
_VERSIONS = b"/versions/"
#: aiohttp's default limit on a request line and on a header field.
MAX_HEAD = 8190
HEAD_END = b"\r\n\r\n"
_NAME = re.compile(rb"[a-z0-9][-a-z0-9]{0,62}")
#: A version as a path segment holds (no '%': an escaped one is aiohttp's to decode).
_VERSION = re.compile(rb"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
_TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
#: Control characters, CR and LF included (the head is searched with its line breaks masked).
_CTL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: Request headers whose presence means the request is not a plain invocation.
_NOT_PLAIN = frozenset(
    {"transfer-encoding", "content-encoding", "expect", "upgrade", "prefer", "trims-trace-level"}
)
#: Response headers the gateway sets itself (as ``api_functions.outcome_response``).
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_REASONS = {int(s): s.phrase for s in HTTPStatus}
_STR_CTL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class Head(NamedTuple):
    """A plain request's head: the function, headers (names lower-cased), sizes, and which
    route (:data:`ROUTE`, :data:`INFER_ROUTE` or :data:`INFER_VERSION_ROUTE`)."""

    function: str
    headers: dict[str, str]
    head_len: int
    body_len: int
    close: bool
    route: str = ROUTE
    #: the version an infer request's path names
    version: str | None = None

    @property
    def path(self) -> str:
        if self.route == ROUTE:
            return f"/v1/functions/{self.function}/invoke"
        if self.version is None:
            return f"/v2/models/{self.function}/infer"
        return f"/v2/models/{self.function}/versions/{self.version}/infer"


#: :func:`parse_head`'s answer while the head has not fully arrived.
INCOMPLETE = "incomplete"


def _request_line(line: bytes) -> tuple[bytes, str, bytes | None] | None:
    """The function's name, the route and the version of a request line the fast path takes."""
    if line.startswith(_PREFIX) and line.endswith(_SUFFIX):
        return line[len(_PREFIX) : -len(_SUFFIX)], ROUTE, None
    if line.startswith(_INFER_PREFIX) and line.endswith(_INFER_SUFFIX):
        name, sep, version = line[len(_INFER_PREFIX) : -len(_INFER_SUFFIX)].partition(_VERSIONS)
        if not sep:
            return name, INFER_ROUTE, None
        if _VERSION.fullmatch(version):
            return name, INFER_VERSION_ROUTE, version
    return None


def parse_head(buf: bytes) -> Head | str | None:
    """The plain request at the start of ``buf``; :data:`INCOMPLETE` while its head is still
    arriving; None when the request is anything else (aiohttp's to answer)."""
    end = buf.find(HEAD_END, 0, MAX_HEAD + 4)
    if end < 0:
        return INCOMPLETE if len(buf) < MAX_HEAD + 4 else None
    head = buf[:end]
    if not head.isascii() or _CTL.search(head.replace(b"\r\n", b"\t")):
        return None
    lines = head.split(b"\r\n")
    target = _request_line(lines[0])
    if target is None:
        return None
    name, route, version = target
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
    return Head(
        name.decode("ascii"),
        headers,
        end + 4,
        body_len,
        close,
        route,
        None if version is None else version.decode("ascii"),
    )


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

    def __init__(
        self,
        gateway: Gateway,
        auth: Authenticator,
        metrics: GatewayMetrics,
        repository: Repository | None = None,
    ) -> None:
        self._gateway = gateway
        self._auth = auth
        self._series = metrics.http_series
        self._max_body = gateway.settings.max_body_bytes
        #: the Open Inference Protocol's model repository (None: its routes are not served)
        self._repository = repository
        #: Requests answered here (the rest were aiohttp's).
        self.answered = 0

    def accept(self, head: Head) -> bool:
        """Whether this request may run here: a deployed function (for infer: serving a loaded
        model, of the version named), a body within its limit, a caller allowed to invoke it.
        Otherwise aiohttp answers it (404, 413, 401/403, 503)."""
        pool = self._gateway.pools.get(head.function)
        if pool is None:
            return False
        if head.route != ROUTE:
            served = pool.spec.serves
            if served is None or self._repository is None:
                return False
            if head.version is not None and head.version not in served.versions:
                return False
            if self._repository.unloaded(head.function):
                return False
        if head.body_len > min(self._max_body, pool.spec.scaling.max_body_bytes):
            return False
        return self._auth.allows_invoke(head.headers.get("authorization"), head.function)

    def prepare(self, head: Head, body: bytes) -> bytes | InferRequest | None:
        """What :meth:`answer` runs: an invocation's body, or an infer request parsed (without
        side effects); None where the request is aiohttp's after all (a body the parse refuses,
        whose 400 aiohttp writes, or one naming shared memory)."""
        if head.route == ROUTE:
            return body
        try:
            parsed = parse_request(body, head.headers.get(HEADER_LENGTH.lower()))
        except TrimsError:
            return None
        if parsed.shm_inputs or any(o.shm is not None for o in (parsed.outputs or {}).values()):
            return None
        return parsed

    async def answer(self, head: Head, prepared: bytes | InferRequest) -> bytes:
        """The response to one accepted request, counted in the HTTP metrics."""
        started = time.monotonic()
        status = 500
        self.answered += 1
        oip = head.route != ROUTE
        try:
            try:
                if isinstance(prepared, InferRequest):
                    status, headers, data = await self._infer(head, prepared)
                else:
                    outcome = await self._gateway.invoke(head.function, prepared, head.headers)
                    status, headers, data = outcome.status, outcome.headers, outcome.body
                out = response_head(status, headers, len(data), close=head.close)
            except TrimsError as e:
                log_trims_error("POST", head.path, e)
                status, headers, data = trims_error_parts(e, oip=oip)
                out = response_head(status, headers, len(data), close=head.close)
            except Exception:
                log.exception("POST %s failed unexpectedly", head.path)
                status, headers, data = unexpected_error_parts(oip=oip)
                out = response_head(status, headers, len(data), close=head.close)
            return out + data
        finally:
            series = self._series(head.route, "POST", status)
            series[0].inc()
            series[1].observe(time.monotonic() - started)

    async def _infer(
        self, head: Head, request: InferRequest
    ) -> tuple[int, Mapping[str, str], bytes]:
        """``api_oip.infer`` for a request without shared memory or a trace."""
        name = head.function
        served = self._gateway.pool(name).spec.serves
        assert served is not None  # accept() checked, and a redeploy keeps what a name serves
        inputs = dict(request.inputs)
        check_inputs(name, served, inputs)
        outputs = await self._gateway.infer(name, inputs)
        version = head.version or served.versions[-1]
        payload, headers = encode_response(name, version, request, outputs, served.outputs)
        return 200, headers, payload


def fast_invoke_for(app: web.Application, settings: GatewaySettings) -> FastInvoke | None:
    """The app's fast path, or None where it must stay off (see the module note)."""
    gateway = app[GATEWAY]
    if not settings.fast_path or settings.access_log or gateway.tracing:
        return None
    return FastInvoke(gateway, app[AUTH], gateway.metrics, app.get(REPOSITORY))


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
                prepared = self._fast.prepare(head, buf[head.head_len : end])
                if prepared is not None:
                    self._buf = buf[end:]
                    self._busy = True
                    task = self._loop.create_task(self._run(head, prepared))
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

    async def _run(self, head: Head, prepared: bytes | InferRequest) -> None:
        response = await self._fast.answer(head, prepared)
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
