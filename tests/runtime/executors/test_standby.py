"""Standby instances on the local executor (Note [standby instances] in
trims.runtime.gateway.pool): real zygote and worker processes, a real daemon for the models."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.unprivileged import writable_by_functions
from trims.errors import TrimsError, UpstreamError
from trims.runtime.executors.base import Instance
from trims.runtime.executors.local import LocalExecutor
from trims.runtime.functions.spec import FunctionSpec

MakeFunction = Callable[..., FunctionSpec]


async def _invoke(instance: Instance) -> bytes:
    return (await instance.invoke(b"", {}, timeout=30, trace={})).body


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.mark.parametrize("warm_pool", [0, 1], ids=["fork", "pooled"])
async def test_a_standby_maps_and_imports_and_runs_init_only_when_activated(
    start_daemon: Callable[..., object],
    make_function: MakeFunction,
    local_executor: Callable[..., LocalExecutor],
    tmp_path: Path,
    warm_pool: int,
) -> None:
    out = writable_by_functions(tmp_path / "out")
    weights = np.arange(1 << 20, dtype=np.float32)
    daemon = start_daemon(models={"vec": {"w": weights}})
    spec = make_function(
        f"""
        import os

        with open({str(out / "imported")!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")

        def init(ctx):
            with open({str(out / "init")!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")

        def handler(request, ctx):
            model = ctx.models["v"]
            return {{"sum": float(model.numpy()["w"].sum()),
                     "populated": model.lease.mapping.populated}}
        """,
        models=[{"name": "vec", "alias": "v"}],
    )
    executor = local_executor(
        store_socket=daemon.socket,  # type: ignore[attr-defined]
        warm_pool=warm_pool,
    )
    instance = await executor.start_standby(spec, "vec-standby")
    await instance.wait_standby(30)
    pid = str(instance.pid)
    assert _lines(out / "imported") == [pid], "the code is imported while a standby"
    assert _lines(out / "init") == [], "init waits for the activation"
    assert daemon.request("stats")["result"]["leases"] >= 1  # type: ignore[attr-defined]
    with pytest.raises(TrimsError, match="not ready"):
        await _invoke(instance)

    await instance.activate(30)
    assert _lines(out / "init") == [pid]
    reply = json.loads(await _invoke(instance))
    assert reply == {"sum": float(weights.sum()), "populated": "populate_read"}
    assert _lines(out / "imported") == [pid], "activation imports nothing again"
    log = (executor.state_dir / "vec-standby.log").read_text()
    assert "prepared as a standby" in log
    await executor.stop(instance, grace_s=5)


async def test_a_standby_stopped_before_activation_exits_without_init(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor], tmp_path: Path
) -> None:
    out = writable_by_functions(tmp_path / "out")
    spec = make_function(
        f"""
        def init(ctx):
            open({str(out / "init")!r}, "w").close()

        def handler(request, ctx):
            return b"x"
        """
    )
    executor = local_executor()
    instance = await executor.start_standby(spec, "idle-standby")
    await instance.wait_standby(30)
    await executor.stop(instance, grace_s=5)
    assert await instance.wait_exit_reason(10) is not None
    assert not instance.alive()
    assert not (out / "init").exists()


async def test_a_standby_that_cannot_prepare_or_init_says_why(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    executor = local_executor()
    broken = make_function("import no_such_module_here\n", name="broken")
    instance = await executor.start_standby(broken, "broken-standby")
    with pytest.raises(UpstreamError, match="no_such_module_here"):
        await instance.wait_standby(30)

    failing = make_function(
        """
        def init(ctx):
            raise RuntimeError("the weights do not fit")

        def handler(request, ctx):
            return b"x"
        """,
        name="failing",
    )
    instance = await executor.start_standby(failing, "failing-standby")
    await instance.wait_standby(30)
    with pytest.raises(UpstreamError, match="the weights do not fit"):
        await instance.activate(30)
