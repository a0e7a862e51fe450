"""Load beyond the queue, hung, crashing and killed instances: the gateway keeps answering."""

from __future__ import annotations

import asyncio
import os
import signal

from tests.fixtures.gateway import echo_spec, pid_alive


async def test_queue_overflow_is_429_with_retry_after(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec(max_instances=1, concurrency=1, queue_size=1))
    busy = asyncio.create_task(gw.invoke("echo", b"sleep:1.5"))
    pool = gw.gateway.pool("echo")
    while not any(s.inflight for s in pool.slots):
        await asyncio.sleep(0.01)
    queued = asyncio.create_task(gw.invoke("echo", b"queued"))
    while pool.describe()["queued"] == 0:
        await asyncio.sleep(0.01)
    status, headers, body = await gw.invoke("echo", b"overflow")
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    assert b"queue_size" in body
    assert (await busy)[0] == 200
    assert (await queued)[:3:2] == (200, b"queued")


async def test_request_timeout_is_504_and_the_instance_is_recycled(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec(request_timeout_s=0.5))
    status, _, body = await gw.invoke("echo", b"pid")
    first_pid = int(body)
    status, _, body = await gw.invoke("echo", b"sleep:30")
    assert status == 504 and b"timeout" in body
    status, _, body = await gw.invoke("echo", b"pid")
    assert status == 200 and int(body) != first_pid
    for _ in range(200):
        if not pid_alive(first_pid):
            break
        await asyncio.sleep(0.05)
    assert not pid_alive(first_pid)


async def test_crash_mid_request_is_502_with_the_reason_and_replaced(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec())
    status, _, body = await gw.invoke("echo", b"crash")
    assert status == 502
    assert b"SIGKILL" in body and b"died" in body
    status, _, body = await gw.invoke("echo", b"after")
    assert (status, body) == (200, b"after")


async def test_kill_9_of_an_idle_worker_is_noticed_and_replaced(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec(min_instances=1))
    _, _, body = await gw.invoke("echo", b"pid")
    pid = int(body)
    os.kill(pid, signal.SIGKILL)
    pool = gw.gateway.pool("echo")

    def replaced() -> bool:
        return any(
            s.state == "ready" and s.instance is not None and s.instance.alive()
            and getattr(s.instance, "pid", pid) != pid
            for s in pool.slots
        )  # fmt: skip

    for _ in range(400):
        if replaced():
            break
        await asyncio.sleep(0.05)
    assert replaced(), "min_instances=1 must bring a new instance after kill -9"
    status, _, body = await gw.invoke("echo", b"pid")
    assert status == 200 and int(body) != pid
    assert gw.gateway.metrics.instance_failures.labels("echo")._value.get() >= 1


async def test_init_failure_answers_502_with_the_workers_reason(start_gateway):
    gw = await start_gateway()
    await gw.deploy(echo_spec("bad", handler="badinit:handler"))
    status, _, body = await gw.invoke("bad", b"x")
    assert status == 502
    assert b"config lacks 'answer'" in body
    status, _, _ = await gw.invoke("echo-missing", b"x")
    assert status == 404


async def test_garbage_and_memory_hogs_get_502_and_the_function_keeps_serving(start_gateway):
    gw = await start_gateway()
    spec = echo_spec()
    spec["resources"] = {"memory": "256MiB"}
    await gw.deploy(spec)
    status, _, body = await gw.invoke("echo", b"garbage")
    assert status == 502 and b"object" in body
    status, _, body = await gw.invoke("echo", b"hog")
    assert status == 502 and b"memory" in body
    status, _, body = await gw.invoke("echo", b"still here")
    assert (status, body) == (200, b"still here")
