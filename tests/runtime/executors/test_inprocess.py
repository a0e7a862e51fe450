"""The in-process executor keeps the executor interface's contract (runtime/executors/base.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from trims.errors import NotFound, Timeout, UpstreamError, ValidationError
from trims.runtime.executors.base import Reply
from trims.runtime.executors.inprocess import InProcessExecutor, InProcessFunction
from trims.runtime.functions.spec import parse_spec

SPEC = parse_spec({"name": "fn", "handler": "inprocess:handler"})


async def reply(body: bytes, headers: Any) -> Reply:
    return Reply(201, {"x-seen": headers.get("x-in", "")}, body[::-1])


async def double(inputs: Any) -> dict[str, np.ndarray]:
    return {"y": inputs["x"] * 2}


async def test_an_instance_invokes_infers_and_stops() -> None:
    executor = InProcessExecutor({"fn": InProcessFunction(invoke=reply, infer=double)})
    instance = await executor.start(SPEC, "fn-1")
    await instance.wait_ready(1.0)
    got = await instance.invoke(b"abc", {"x-in": "1"}, timeout=1.0, trace={})
    assert got == Reply(201, {"x-seen": "1"}, b"cba")
    out = await instance.infer({"x": np.arange(3.0)}, timeout=1.0, trace={})
    np.testing.assert_array_equal(out["y"], [0.0, 2.0, 4.0])
    await executor.stop(instance, grace_s=1.0)
    assert not instance.alive() and instance.exit_reason == "stopped"
    with pytest.raises(UpstreamError, match="instance fn-1 of fn died: stopped"):
        await instance.invoke(b"", {}, timeout=1.0, trace={})
    with pytest.raises(NotFound, match="not managed by this inprocess executor"):
        await executor.stop(instance)
    await executor.close()


async def test_check_names_the_functions_it_has() -> None:
    executor = InProcessExecutor({"fn": InProcessFunction(invoke=reply)})
    other = parse_spec({"name": "other", "handler": "inprocess:handler"})
    with pytest.raises(ValidationError, match=r"no in-process function named 'other'.*has: fn"):
        executor.check(other)
    executor.check(SPEC)


async def test_a_missing_handler_and_a_timeout_keep_the_contract() -> None:
    never = asyncio.Event()

    async def hang(body: bytes, headers: Any) -> bytes:
        await never.wait()
        return b""

    executor = InProcessExecutor({"fn": InProcessFunction(invoke=hang)})
    instance = await executor.start(SPEC, "fn-1")
    await instance.wait_ready(1.0)
    with pytest.raises(UpstreamError, match="defines no infer"):
        await instance.infer({}, timeout=1.0, trace={})
    with pytest.raises(Timeout, match="did not answer within"):
        await instance.invoke(b"", {}, timeout=0.01, trace={})
    assert instance.alive(), "a timeout leaves the instance up (the pool decides)"
    assert instance.inflight == 0
    await executor.close()
    assert executor.live() == [] and executor.stopped == ["fn-1"]
