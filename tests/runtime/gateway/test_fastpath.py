"""The invoke fast path (Note [invoke fast path] in runtime/gateway/fastpath.py).

A gateway with it and one without answer the same raw requests with the same bytes (but the
date); what the fast path does not answer reaches aiohttp whole, and the connection limits
(keep-alive, the head deadline, shutdown) hold on it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from tests.fixtures.gateway import ADMIN, RunningGateway, doubler_spec, echo_spec
from trims.errors import UpstreamError
from trims.runtime.gateway.auth import Authenticator
from trims.runtime.gateway.connections import ConnectionGuard, GuardedTCPSite
from trims.runtime.gateway.context import AUTH, GATEWAY
from trims.runtime.gateway.fastpath import (
    INCOMPLETE,
    INFER_ROUTE,
    INFER_VERSION_ROUTE,
    Head,
    check_reply,
    fast_invoke_for,
    parse_head,
    response_head,
)
from trims.runtime.gateway.service import Gateway
from trims.runtime.settings import GatewaySettings, Token

Start = Callable[..., Awaitable[RunningGateway]]

INVOKER = Token("echo-invoker-secret", frozenset({"invoke:echo"}), "invoker")
PLAIN = b"POST /v1/functions/echo/invoke HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n\r\nhello"


def _request(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n\r\n" + body


# -- parsing ---------------------------------------------------------------------------------


def test_a_plain_invocation_is_parsed() -> None:
    raw = _request(
        "POST /v1/functions/echo-2/invoke HTTP/1.1\nHost: gw\nContent-Type: text/plain\n"
        "Authorization: Bearer abc\nContent-Length: 5\nConnection: close",
        b"helloPOST",
    )
    head = parse_head(raw)
    assert isinstance(head, Head)
    assert head.function == "echo-2"
    assert head.headers == {
        "host": "gw",
        "content-type": "text/plain",
        "authorization": "Bearer abc",
        "content-length": "5",
        "connection": "close",
    }
    assert raw[head.head_len : head.head_len + head.body_len] == b"hello"
    assert head.close


def test_a_head_still_arriving_is_incomplete_and_an_endless_one_is_not_ours() -> None:
    assert parse_head(PLAIN[:30]) == INCOMPLETE
    assert parse_head(b"POST /v1/functions/echo/invoke HTTP/1.1\r\nX: " + b"a" * 9000) is None


@pytest.mark.parametrize(
    "head",
    [
        "GET /v1/functions/echo/invoke HTTP/1.1",
        "POST /v1/functions/echo/invoke HTTP/1.0",
        "POST /v1/functions/echo/invoke?async=true HTTP/1.1",
        "POST /v1/functions/ech%6f/invoke HTTP/1.1",
        "POST /v1/functions/Echo/invoke HTTP/1.1",
        "POST /v1/functions/a/b/invoke HTTP/1.1",
        "POST /v1/functions//invoke HTTP/1.1",
        "POST  /v1/functions/echo/invoke HTTP/1.1",
        "POST /v1/functions/echo/invoke HTTP/1.1\nTransfer-Encoding: chunked",
        "POST /v1/functions/echo/invoke HTTP/1.1\nExpect: 100-continue",
        "POST /v1/functions/echo/invoke HTTP/1.1\nUpgrade: websocket",
        "POST /v1/functions/echo/invoke HTTP/1.1\nPrefer: respond-async",
        "POST /v1/functions/echo/invoke HTTP/1.1\ntrims-trace-level: kernel",
        "POST /v1/functions/echo/invoke HTTP/1.1\nContent-Length: 5\ncontent-length: 6",
        "POST /v1/functions/echo/invoke HTTP/1.1\nAuthorization: a\nauthorization: b",
        "POST /v1/functions/echo/invoke HTTP/1.1\nContent-Length: +5",
        "POST /v1/functions/echo/invoke HTTP/1.1\nContent-Length: 5 5",
        "POST /v1/functions/echo/invoke HTTP/1.1\nContent-Length: 1000000000000000000",
        "POST /v1/functions/echo/invoke HTTP/1.1\nConnection: upgrade",
        "POST /v1/functions/echo/invoke HTTP/1.1\nX-Folded: a\n b",
        "POST /v1/functions/echo/invoke HTTP/1.1\nBad Name: a",
        "POST /v1/functions/echo/invoke HTTP/1.1\nNoColon",
        "POST /v1/functions/echo/invoke HTTP/1.1\nX-Bell: a\x07",
        "POST /v1/functions/echo/invoke HTTP/1.1\nX-Latin: caf\u00e9",
    ],
)
def test_anything_but_a_plain_invocation_is_left_to_aiohttp(head: str) -> None:
    assert parse_head(_request(head)) is None


def test_a_bare_line_feed_is_left_to_aiohttp() -> None:
    assert parse_head(b"POST /v1/functions/echo/invoke HTTP/1.1\nHost: gw\r\n\r\n") is None
    assert parse_head(b"POST /v1/functions/echo/invoke HTTP/1.1\r\nX: a\rb\r\n\r\n") is None


# -- the response head -----------------------------------------------------------------------


async def _raw_answer(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await _read_response(reader)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    m = re.search(rb"\r\ncontent-length: (\d+)\r\n", head, re.IGNORECASE)
    assert m is not None, head
    return head + await reader.readexactly(int(m.group(1)))


def _undated(response: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*", b"", response)


@pytest.mark.parametrize(
    ("status", "headers", "close"),
    [
        (200, {"content-type": "text/plain"}, False),
        (201, {}, False),
        (404, {"Content-Type": "application/json", "x-a": "b"}, True),
        (299, {"connection": "keep-alive", "content-length": "99", "x-tab": "a\tb"}, False),
    ],
)
async def test_the_response_head_is_what_aiohttp_writes(
    status: int, headers: dict[str, str], close: bool
) -> None:
    body = b"some body"

    async def answer(request: web.Request) -> web.Response:
        kept = {k: v for k, v in headers.items() if k not in ("connection", "content-length")}
        return web.Response(status=status, body=body, headers=kept)

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        connection = "Connection: close\r\n" if close else ""
        request = f"POST / HTTP/1.1\r\nHost: x\r\n{connection}Content-Length: 0\r\n\r\n".encode()
        expected = await _raw_answer(port, request)
    finally:
        await runner.cleanup()
    ours = response_head(status, headers, len(body), close=close) + body
    assert _undated(ours) == _undated(expected)


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (200, {"x-note": "a\r\nx-injected: 1"}),
        (200, {"x-note": "a\nb"}),
        (200, {"x note": "a"}),
        (200, {"x-nul": "a\x00"}),
        (99, {}),
        (600, {}),
    ],
)
def test_a_reply_that_is_not_valid_http_is_refused(status: int, headers: dict[str, str]) -> None:
    with pytest.raises(UpstreamError, match="not valid HTTP"):
        check_reply(status, headers)
    with pytest.raises(UpstreamError, match="not valid HTTP"):
        response_head(status, headers, 0, close=False)


# -- through a gateway -----------------------------------------------------------------------


def _guard(gw: RunningGateway) -> ConnectionGuard:
    assert gw.runner is not None
    site = next(iter(gw.runner.sites))
    assert isinstance(site, GuardedTCPSite)
    return site.guard


def _port(gw: RunningGateway) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def _pair(start_gateway: Start, **options: object) -> tuple[RunningGateway, RunningGateway]:
    """The same gateway with the fast path and without, echo deployed and warm on both."""
    fast = await start_gateway(tokens=(ADMIN, INVOKER), **options)
    slow = await start_gateway(tokens=(ADMIN, INVOKER), fast_path=False, **options)
    for gw in (fast, slow):
        await gw.deploy(echo_spec("echo", max_body_bytes=64))
        assert (await gw.invoke("echo", b"warm"))[0] == 200
    assert _guard(fast).fast is not None and _guard(slow).fast is None
    return fast, slow


def _invoke(extra: str = "", body: bytes = b"hello", token: str | None = INVOKER.secret) -> bytes:
    auth = f"Authorization: Bearer {token}\n" if token else ""
    return _request(
        f"POST /v1/functions/echo/invoke HTTP/1.1\nHost: gw\n{auth}{extra}"
        f"Content-Length: {len(body)}",
        body,
    )


CASES = {
    "plain": (_invoke("Content-Type: text/plain\n"), True),
    "no content type": (_invoke(), True),
    "the function's headers": (_invoke(body=b"headers"), True),
    "an invalid header from the function": (_invoke(body=b"split-header"), True),
    "a crashed instance": (_invoke(body=b"crash"), True),
    "unknown function": (_invoke().replace(b"/echo/", b"/nope/"), False),
    "no token": (_invoke(token=None), False),
    "wrong token": (_invoke(token="not-a-token"), False),
    "over the body limit": (_invoke(body=b"x" * 65), False),
    "a query": (_invoke().replace(b"/invoke ", b"/invoke?async=false "), False),
    "chunked": (
        _request(
            "POST /v1/functions/echo/invoke HTTP/1.1\nHost: gw\n"
            f"Authorization: Bearer {INVOKER.secret}\nTransfer-Encoding: chunked",
            b"5\r\nhello\r\n0\r\n\r\n",
        ),
        False,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_fast_and_aiohttp_answers_are_the_same_bytes(start_gateway: Start, case: str) -> None:
    fast, slow = await _pair(start_gateway)
    request, answered_fast = CASES[case]
    before = _guard(fast).fast.answered  # type: ignore[union-attr]
    handed = _guard(fast).handed_over  # the deploy's connection
    ours = await _raw_answer(_port(fast), request)
    theirs = await _raw_answer(_port(slow), request)
    if case == "a crashed instance":  # the message names the instance, which differs
        ours, theirs = (re.sub(rb"echo-\d+-[0-9a-f]+", b"echo-N", a) for a in (ours, theirs))
        ours, theirs = (re.sub(rb"Content-Length: \d+", b"", a) for a in (ours, theirs))
    assert _undated(ours) == _undated(theirs)
    took = _guard(fast).fast.answered - before  # type: ignore[union-attr]
    assert took == (1 if answered_fast else 0), ours
    assert _guard(fast).handed_over - handed == (0 if answered_fast else 1)


async def test_an_invalid_header_from_a_function_never_reaches_the_client(
    start_gateway: Start,
) -> None:
    fast, _ = await _pair(start_gateway)
    answer = await _raw_answer(_port(fast), _invoke(body=b"split-header"))
    assert answer.startswith(b"HTTP/1.1 502") and b"x-injected" not in answer.split(b"\r\n\r\n")[0]


async def test_pipelined_requests_are_answered_in_order_across_a_hand_over(
    start_gateway: Start,
) -> None:
    """Fast, fast, then one for aiohttp, then a fast one again (now aiohttp's too)."""
    fast, _ = await _pair(start_gateway)
    requests = [
        _invoke(body=b"sleep:0.2"),
        _invoke(body=b"second"),
        _request("GET /healthz HTTP/1.1\nHost: gw"),
        _invoke(body=b"fourth"),
    ]
    handed = _guard(fast).handed_over  # the deploy's connection
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(fast))
    try:
        writer.write(b"".join(requests))
        answers = [await _read_response(reader) for _ in requests]
    finally:
        writer.close()
    bodies = [a.split(b"\r\n\r\n", 1)[1] for a in answers]
    assert bodies == [b"slept", b"second", b'{"status": "ok"}', b"fourth"]
    assert _guard(fast).handed_over - handed == 1


_COUNTER = "trims_http_requests_total{"


async def test_fast_answers_are_counted_like_the_others(start_gateway: Start) -> None:
    fast, slow = await _pair(start_gateway)
    for gw in (fast, slow):
        for _ in range(3):
            await _raw_answer(_port(gw), _invoke())
        await _raw_answer(_port(gw), _invoke(token=None))
    texts = []
    for gw in (fast, slow):
        text = gw.gateway.metrics.render().decode()
        lines = text.splitlines()
        texts.append(sorted(x for x in lines if x.startswith(_COUNTER) and '/invoke"' in x))
    assert texts[0] == texts[1]
    assert any('status="200"} 4.0' in line for line in texts[0]), texts[0]  # warm-up + 3
    assert any('status="401"} 1.0' in line for line in texts[0]), texts[0]


async def test_connection_close_is_honoured(start_gateway: Start) -> None:
    fast, _ = await _pair(start_gateway)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(fast))
    try:
        writer.write(_invoke("Connection: close\n"))
        answer = await asyncio.wait_for(reader.read(), 30)  # to EOF: the gateway closed
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200") and b"\r\nConnection: close\r\n" in answer


async def test_an_idle_fast_connection_closes_after_the_keepalive_timeout(
    start_gateway: Start,
) -> None:
    fast, _ = await _pair(start_gateway, keepalive_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(fast))
    try:
        writer.write(_invoke())
        assert (await _read_response(reader)).endswith(b"hello")
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()


async def test_a_slow_head_after_fast_requests_meets_the_head_deadline(
    start_gateway: Start,
) -> None:
    """Slowloris on a connection that began on the fast path: handed over mid-head, it gets
    the same deadline as a connection's first head (the keep-alive timeout is far off)."""
    fast, _ = await _pair(start_gateway, header_timeout_s=0.5, keepalive_timeout_s=600)
    reader, writer = await asyncio.open_connection("127.0.0.1", _port(fast))
    try:
        writer.write(_invoke())
        assert (await _read_response(reader)).endswith(b"hello")
        writer.write(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()
    assert _guard(fast).timed_out == 1


async def test_a_client_gone_mid_request_leaves_the_gateway_serving(start_gateway: Start) -> None:
    fast, _ = await _pair(start_gateway)
    _, writer = await asyncio.open_connection("127.0.0.1", _port(fast))
    writer.write(_invoke(body=b"sleep:0.3"))
    await writer.drain()
    writer.close()
    await writer.wait_closed()
    answers = await asyncio.gather(
        *(_raw_answer(_port(fast), _invoke(body=b"x")) for _ in range(5))
    )
    assert all(a.endswith(b"\r\n\r\nx") for a in answers)


def test_the_fast_path_stays_off_where_it_would_change_what_is_recorded() -> None:
    def app_with(settings: GatewaySettings, *, tracing: bool = False) -> web.Application:
        app = web.Application()
        gateway = Gateway(settings, lambda name: None)  # type: ignore[arg-type,return-value]
        gateway.tracing = tracing
        app[GATEWAY] = gateway
        app[AUTH] = Authenticator((), enabled=False)
        return app

    plain = GatewaySettings(port=0, auth=False)
    assert fast_invoke_for(app_with(plain), plain) is not None
    off = GatewaySettings(port=0, auth=False, fast_path=False)
    assert fast_invoke_for(app_with(off), off) is None
    logged = GatewaySettings(port=0, auth=False, access_log=True)
    assert fast_invoke_for(app_with(logged), logged) is None
    assert fast_invoke_for(app_with(plain, tracing=True), plain) is None


async def test_shutdown_closes_idle_fast_connections(gateway_process: Any) -> None:
    gw = gateway_process()
    async with (
        aiohttp.ClientSession() as session,
        session.put(f"{gw.url}/v1/functions/echo", json=echo_spec("echo")) as r,
    ):
        assert r.status == 201, await r.text()
    host, port = gw.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(_invoke(token=None))
        assert (await _read_response(reader)).endswith(b"hello")
        assert await asyncio.to_thread(gw.terminate) == 0
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        writer.close()


# -- the Open Inference Protocol's infer -----------------------------------------------------


def test_an_infer_request_line_is_parsed() -> None:
    head = parse_head(_request("POST /v2/models/doubler/infer HTTP/1.1\nContent-Length: 2", b"{}"))
    assert isinstance(head, Head) and head.route == INFER_ROUTE and head.version is None
    assert head.path == "/v2/models/doubler/infer"
    raw = _request("POST /v2/models/doubler/versions/1.0+cpu/infer HTTP/1.1\nHost: gw")
    head = parse_head(raw)
    assert isinstance(head, Head) and head.route == INFER_VERSION_ROUTE
    assert head.function == "doubler" and head.version == "1.0+cpu"


@pytest.mark.parametrize(
    "line",
    [
        "POST /v2/models/doubler/infer?x=1 HTTP/1.1",
        "POST /v2/models/doubler/versions//infer HTTP/1.1",
        "POST /v2/models/doubler/versions/%31/infer HTTP/1.1",
        "POST /v2/models/doubler/versions/1/2/infer HTTP/1.1",
        "POST /v2/models/Doubler/infer HTTP/1.1",
        "POST /v2/models/doubler/ready HTTP/1.1",
        "GET /v2/models/doubler/infer HTTP/1.1",
        "POST /v2/models/doubler/infer HTTP/1.1\nContent-Encoding: gzip",
        "POST /v1/functions/echo/invoke HTTP/1.1\nContent-Encoding: gzip",
    ],
)
def test_any_other_infer_request_is_left_to_aiohttp(line: str) -> None:
    assert parse_head(_request(line)) is None


def _infer(
    body: bytes,
    path: str = "/v2/models/doubler/infer",
    token: str | None = ADMIN.secret,
    extra: str = "",
) -> bytes:
    auth = f"Authorization: Bearer {token}\n" if token else ""
    return _request(
        f"POST {path} HTTP/1.1\nHost: gw\n{auth}Content-Type: application/json\n{extra}"
        f"Content-Length: {len(body)}",
        body,
    )


def _binary_infer() -> bytes:
    head = json.dumps(
        {
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [2],
                        "parameters": {"binary_data_size": 8}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    body = head + np.array([1.5, -2.0], dtype="<f4").tobytes()
    return _request(
        f"POST /v2/models/doubler/infer HTTP/1.1\nHost: gw\nAuthorization: Bearer {ADMIN.secret}"
        f"\nInference-Header-Content-Length: {len(head)}\nContent-Length: {len(body)}",
        body,
    )


_X = {"name": "x", "datatype": "FP32", "shape": [3], "data": [1.0, 2.5, -4.0]}
#: the doubler's BYTES output "raw" is not UTF-8, which JSON cannot carry: ask for y alone
_Y = [{"name": "y"}]
_DOUBLE = json.dumps({"inputs": [_X], "outputs": _Y}).encode()
INFER_CASES = {
    "json": (_infer(json.dumps({"id": "a1", "inputs": [_X], "outputs": _Y}).encode()), True),
    "a version": (
        _infer(_DOUBLE, "/v2/models/doubler/versions/1/infer"),
        True,
    ),
    "binary tensors": (_binary_infer(), True),
    "inputs the model does not take": (
        _infer(json.dumps({"inputs": [{**_X, "name": "z"}], "outputs": _Y}).encode()),
        True,
    ),
    "not json": (_infer(b"{nope"), False),
    "shared memory": (
        _infer(
            json.dumps(
                {
                    "inputs": [
                        {
                            "name": "x",
                            "datatype": "FP32",
                            "shape": [1],
                            "parameters": {
                                "shared_memory_region": "r",
                                "shared_memory_byte_size": 4,
                            },
                        }
                    ]
                }
            ).encode()
        ),
        False,
    ),
    "an unknown version": (
        _infer(_DOUBLE, "/v2/models/doubler/versions/9/infer"),
        False,
    ),
    "an unknown model": (
        _infer(_DOUBLE, "/v2/models/nope/infer"),
        False,
    ),
    "no token": (_infer(_DOUBLE, token=None), False),
}


async def _oip_pair(start_gateway: Start) -> tuple[RunningGateway, RunningGateway]:
    fast = await start_gateway(tokens=(ADMIN, INVOKER))
    slow = await start_gateway(tokens=(ADMIN, INVOKER), fast_path=False)
    for gw in (fast, slow):
        await gw.deploy(doubler_spec())
        warm = await _raw_answer(_port(gw), _infer(_DOUBLE))
        assert warm.startswith(b"HTTP/1.1 200"), warm
    return fast, slow


@pytest.mark.parametrize("case", list(INFER_CASES))
async def test_fast_and_aiohttp_infer_answers_are_the_same_bytes(
    start_gateway: Start, case: str
) -> None:
    fast, slow = await _oip_pair(start_gateway)
    request, answered_fast = INFER_CASES[case]
    before = _guard(fast).fast.answered  # type: ignore[union-attr]
    ours = await _raw_answer(_port(fast), request)
    theirs = await _raw_answer(_port(slow), request)
    assert _undated(ours) == _undated(theirs)
    took = _guard(fast).fast.answered - before  # type: ignore[union-attr]
    assert took == (1 if answered_fast else 0), ours


async def test_an_unloaded_model_is_aiohttps_to_refuse(start_gateway: Start) -> None:
    fast, _ = await _oip_pair(start_gateway)
    async with fast.session.post(
        f"{fast.url}/v2/repository/models/doubler/unload", headers=fast.headers(ADMIN.secret)
    ) as r:
        assert r.status == 200, await r.text()
    before = _guard(fast).fast.answered  # type: ignore[union-attr]
    answer = await _raw_answer(_port(fast), _infer(_DOUBLE))
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert _guard(fast).fast.answered == before  # type: ignore[union-attr]


async def test_fast_infer_answers_are_counted_under_their_route(start_gateway: Start) -> None:
    fast, slow = await _oip_pair(start_gateway)
    texts = []
    for gw in (fast, slow):
        await _raw_answer(_port(gw), _binary_infer())
        lines = gw.gateway.metrics.render().decode().splitlines()
        texts.append(sorted(x for x in lines if x.startswith(_COUNTER) and "/infer" in x))
    assert texts[0] == texts[1]
    assert any('route="/v2/models/{name}/infer"' in x and "2.0" in x for x in texts[0]), texts[0]
