"""A real worker whose model the daemon's cpu tier cannot hold starts and serves it from the
disk tier (Note [degraded acquires] in trims.daemon.store), instead of failing its start."""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from tests.fixtures.store import DaemonProcess
from trims.runtime.executors.local import LocalExecutor
from trims.runtime.functions.spec import FunctionSpec

SUM = """
def handler(request, ctx):
    model = ctx.models["m"]
    return {"sum": float(model.numpy()["w"].sum()), "tier": model.lease.tier}
"""


async def test_an_instance_whose_model_the_cpu_tier_cannot_hold_maps_the_disk_file(
    start_daemon: Callable[..., DaemonProcess],
    make_function: Callable[..., FunctionSpec],
    local_executor: Callable[..., LocalExecutor],
) -> None:
    weights = {name: np.arange(1024, dtype=np.float32) * (i + 1) for i, name in enumerate("ab")}
    daemon = start_daemon(models={n: {"w": w} for n, w in weights.items()}, cpu_budget="4KiB")
    executor = local_executor(store_socket=daemon.socket)
    instances = []
    for name in "ab":  # a's idle instance keeps its lease: b cannot be loaded into the tier
        spec = make_function(SUM, name=f"fn-{name}", models=[{"name": name, "alias": "m"}])
        instance = await executor.start(spec, f"fn-{name}-1")
        await instance.wait_ready(30)
        instances.append(instance)
    replies = []
    for instance in instances:
        reply = await instance.invoke(b"", {}, timeout=30, trace={})
        replies.append(json.loads(reply.body))
    assert replies == [
        {"sum": float(weights["a"].sum()), "tier": "cpu"},
        {"sum": float(weights["b"].sum()), "tier": "disk"},
    ]
    table = daemon.request("stats", admin=True)["result"]["lease_table"]
    assert sorted((lease["model"], lease["tier"]) for lease in table) == [
        ("a:1", "cpu"),
        ("b:1", "disk"),
    ]
    for instance in instances:
        await executor.stop(instance, grace_s=5)
