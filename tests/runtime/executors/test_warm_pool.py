"""The warm pool (Note [warm pool] in trims.runtime.executors.zygote) with a real zygote."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import uvloop

from trims.errors import ValidationError
from trims.protocol import recv_frame, send_frame
from trims.runtime.executors import zygote as zygote_module
from trims.runtime.executors.local import LocalExecutor, LocalExecutorSettings
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.worker.runner import Prestarted, _loop_factory

MakeFunction = Callable[..., FunctionSpec]

WHOAMI = """
import os

def handler(request, ctx):
    return f"{os.getpid()} {os.getuid()}"
"""


def _children(ppid: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == ppid:
                out.add(int(entry.name))
    return out


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


async def _wait_children(zygote: int, count: int, exclude: set[int] = frozenset()) -> set[int]:  # type: ignore[assignment]
    """Wait (up to 60 s) until the zygote has ``count`` children outside ``exclude``."""
    deadline = time.monotonic() + 60
    while True:
        found = _children(zygote) - exclude
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"zygote {zygote} has children {found}"
        await asyncio.sleep(0.01)


async def _start(executor: LocalExecutor, spec: FunctionSpec, iid: str) -> tuple[int, int]:
    instance = await executor.start(spec, iid)
    await instance.wait_ready(60)
    reply = await instance.invoke(b"", {}, timeout=30, trace={})
    pid, uid = map(int, reply.body.split())
    assert pid == instance.pid
    return pid, uid


def _expected_uid(executor: LocalExecutor) -> int:
    return pwd.getpwnam(executor.run_as).pw_uid if executor.run_as else os.getuid()


async def test_a_start_takes_the_pooled_worker_forked_before_it_and_the_pool_refills(
    local_executor: Callable[..., LocalExecutor], make_function: MakeFunction
) -> None:
    executor = local_executor(warm_pool=1)
    await executor.prepare()
    zygote = executor.zygote_pid
    assert zygote is not None
    (pooled,) = await _wait_children(zygote, 1)
    # A pooled worker runs as the function's unprivileged user before it knows its function.
    await _wait_uid(pooled, _expected_uid(executor))
    pid, uid = await _start(executor, make_function(WHOAMI), "a-1")
    assert pid == pooled
    assert uid == _expected_uid(executor) and (os.getuid() != 0 or uid != 0)
    refill = await _wait_children(zygote, 1, exclude={pooled})
    assert pooled not in refill
    # Each pooled worker serves exactly one instance: the next start takes the refill.
    pid2, _ = await _start(executor, make_function(WHOAMI), "a-2")
    assert pid2 in refill and pid2 != pid


async def _wait_uid(pid: int, uid: int) -> None:
    deadline = time.monotonic() + 60
    while _uid(pid) != uid:
        assert time.monotonic() < deadline, f"pid {pid} still runs as uid {_uid(pid)}"
        await asyncio.sleep(0.01)


async def test_a_stopped_instance_of_a_pooled_worker_exits_and_is_not_reused(
    local_executor: Callable[..., LocalExecutor], make_function: MakeFunction
) -> None:
    executor = local_executor(warm_pool=2)
    await executor.prepare()
    zygote = executor.zygote_pid
    assert zygote is not None
    pooled = await _wait_children(zygote, 2)
    instance = await executor.start(make_function(WHOAMI), "b-1")
    await instance.wait_ready(60)
    assert instance.pid in pooled
    await executor.stop(instance, 5.0)
    assert not Path(f"/proc/{instance.pid}").exists()
    later = await _wait_children(zygote, 2)
    assert instance.pid not in later


async def test_without_a_pool_nothing_is_forked_ahead(
    local_executor: Callable[..., LocalExecutor], make_function: MakeFunction
) -> None:
    assert LocalExecutorSettings().warm_pool == 1  # on by default
    executor = local_executor(warm_pool=0)
    await executor.prepare()
    zygote = executor.zygote_pid
    assert zygote is not None
    assert _children(zygote) == set()
    pid, uid = await _start(executor, make_function(WHOAMI), "c-1")
    assert _children(zygote) == {pid} and uid == _expected_uid(executor)


def test_a_negative_pool_is_refused() -> None:
    with pytest.raises(ValidationError, match="warm_pool must be 0"):
        LocalExecutorSettings(warm_pool=-1)


def _outlive_idle_timeout(store_socket: Path) -> None:
    """Connect to the store, greet it, and wait until the daemon closes this connection for
    being idle: every connection without leases that was idle before it is closed by then."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(store_socket))
        send_frame(sock, {"id": 1, "op": "hello", "args": {"client": "idle probe"}})
        assert recv_frame(sock)[0]["ok"]
        closing, _ = recv_frame(sock)
        assert closing["id"] is None and "idle" in closing["error"]["message"]


@pytest.mark.parametrize("waited", [False, True], ids=["fresh", "past-idle-timeout"])
async def test_a_pooled_worker_acquires_its_model_through_the_store_as_the_unprivileged_user(
    start_daemon: Callable[..., object],
    make_function: MakeFunction,
    local_executor: Callable[..., LocalExecutor],
    waited: bool,
) -> None:
    """``waited``: the pool's worker waited longer than the daemon's idle timeout, after which
    the daemon closes a connection without leases; the store socket (0660) is closed to the
    unprivileged user. A pooled worker that connected before its drop lost its connection
    and could not make another (its start failed with EACCES); the zygote now connects it
    when it hands over the request."""
    weights = np.arange(1000, dtype=np.float32)
    options = {"idle_timeout": 0.2} if waited else {}
    daemon = start_daemon(models={"vec": {"w": weights}}, **options)
    spec = make_function(
        """
        import os

        def handler(request, ctx):
            model = ctx.models["vec"]
            return {"sum": float(model.numpy()["w"].sum()), "via": model.via,
                    "uid": os.getuid(), "pid": os.getpid()}
        """,
        models=[{"name": "vec"}],
    )
    executor = local_executor(store_socket=daemon.socket, warm_pool=1)  # type: ignore[attr-defined]
    await executor.prepare()
    zygote = executor.zygote_pid
    assert zygote is not None
    (pooled,) = await _wait_children(zygote, 1)
    if waited:
        deadline = time.monotonic() + 60
        while _uid(pooled) != _expected_uid(executor):  # confined: past a connect before it
            assert time.monotonic() < deadline, "the pooled worker never dropped privileges"
            await asyncio.sleep(0.01)
        await asyncio.to_thread(_outlive_idle_timeout, daemon.socket)  # type: ignore[attr-defined]
    instance = await executor.start(spec, "vec-1")
    await instance.wait_ready(60)
    reply = json.loads((await instance.invoke(b"", {}, timeout=30, trace={})).body)
    assert reply == {
        "sum": float(weights.sum()),
        "via": "store",
        "uid": _expected_uid(executor),
        "pid": pooled,
    }


@pytest.fixture
def root_logging() -> Iterator[None]:
    """The rehearsal sets up logging as a worker would: give this process's back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("root_logging")
def test_the_rehearsal_runs_the_start_steps_and_hands_over_an_open_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Note [start rehearsal]: its worker arguments still parse (a stale sample would only
    print a traceback), and its loop has run once, is open and is what the worker runs on."""
    loop = zygote_module._rehearse()
    assert loop is not None
    try:
        assert isinstance(loop, uvloop.Loop)
        assert not loop.is_closed() and not loop.is_running()
        assert capsys.readouterr().err == ""
        prestarted = Prestarted(run_as=None, dropped_to=None, loop=loop)
        assert _loop_factory(prestarted)() is loop
    finally:
        loop.close()
    made = _loop_factory(None)()
    try:
        assert isinstance(made, uvloop.Loop) and made is not loop
    finally:
        made.close()


@pytest.mark.usefixtures("root_logging")
def test_a_rehearsal_that_fails_says_why_and_leaves_the_start_to_make_its_loop(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(zygote_module, "_REHEARSAL_ARGV", ["--no-such-option"])
    assert zygote_module._rehearse() is None
    err = capsys.readouterr().err
    assert "usage: trims worker" in err and "SystemExit: 2" in err
    invalid_spec = ["--spec-json", "{}", "--listen", "unix:/x"]
    monkeypatch.setattr(zygote_module, "_REHEARSAL_ARGV", invalid_spec)
    assert zygote_module._rehearse() is None
    assert "ValidationError" in capsys.readouterr().err
