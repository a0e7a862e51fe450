"""The request hot path: coalesced worker frames, the body fast path, the frozen worker heap."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from tests.fixtures.gateway import RunningGateway, echo_spec

Start = Callable[..., Awaitable[RunningGateway]]


async def test_many_requests_in_one_iteration_each_get_their_own_answer(
    start_gateway: Start,
) -> None:
    """Frames sent in one loop iteration share a write both ways (Note [coalesced writes]);
    every request still gets its own reply, in any order of completion."""
    gw = await start_gateway()
    await gw.deploy(echo_spec("hot", "hotpath:handler", concurrency=64, max_instances=1))
    assert (await gw.invoke("hot", b"warm"))[0] == 200
    bodies = [f"request {i}".encode() for i in range(48)]
    answers = await asyncio.gather(*(gw.invoke("hot", b) for b in bodies))
    assert [(status, body) for status, _, body in answers] == [(200, b) for b in bodies]


async def test_a_body_larger_than_one_read_arrives_whole(start_gateway: Start) -> None:
    """The fast path takes a body that came with the head; a larger one still streams in."""
    gw = await start_gateway()
    await gw.deploy(echo_spec("big", "hotpath:handler"))
    body = b"x" * (3 << 20)
    status, _, answer = await gw.invoke("big", body)
    assert status == 200 and answer == body


async def test_a_small_body_over_the_limit_is_refused(start_gateway: Start) -> None:
    gw = await start_gateway()
    await gw.deploy(echo_spec("tiny", "hotpath:handler", max_body_bytes=4))
    status, _, answer = await gw.invoke("tiny", b"12345")
    assert status == 413, answer
    assert (await gw.invoke("tiny", b"1234"))[2] == b"1234"


async def test_the_worker_freezes_what_init_made(start_gateway: Start) -> None:
    """Full collections during requests skip the objects init made (Note [gc tail])."""
    gw = await start_gateway()
    await gw.deploy(echo_spec("gc", "hotpath:handler"))
    status, _, answer = await gw.invoke("gc", b"frozen")
    assert status == 200
    at_import, now = (int(n) for n in answer.split())
    assert now > at_import  # the handler module and what init made were frozen after
