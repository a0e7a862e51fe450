"""trims' side of bench/peers.py: a daemon and a gateway serving the benchmark's models, and
its cold-start case (Note [idle memory] in bench/peers.py)."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

from peer_base import MODEL_CODE, Infer, v2_json_request
from runtime_common import drop_caches, pid_alive, start_daemon, start_gateway, tree_pids

FUNCTION = """
import os

import numpy as np
import torch
from peers_model import forward


def init(ctx):
    ctx.state["tensors"] = ctx.models["weights"].torch()


def infer(inputs, ctx):
    x = torch.from_numpy(np.ascontiguousarray(inputs["input"], dtype=np.float32))
    y = forward(ctx.state["tensors"], x, ctx.config.get("relu", False))
    return {"output": y.numpy(), "pid": np.array([os.getpid()], dtype=np.int64)}


def handler(request, ctx):
    return str(os.getpid())
"""


def prepare_cache(cache: str) -> None:
    """Drop the page cache for ``cache == "dropped"`` (checked to work before the runs)."""
    if cache == "dropped":
        drop_caches()


#: The longest the idle-matched warm request waits (Note [idle memory] in bench/peers.py):
#: between trims' cases the peers' process starts run for tens of seconds, and waiting as
#: long would stretch the run by minutes. Past it the match is partial (a shorter idle: a
#: faster warm request to hold the first one against).
IDLE_CAP_S = 10.0


class ColdRun(NamedTuple):
    """One run of a cold case, in seconds (see :func:`trims_cold`)."""

    first: float
    warm: float
    #: trims: a warm request after the weights sat idle as long as they had before ``first``
    #: (None for the disk tier with caches dropped, whose first request reads them fresh from
    #: disk, and for the peers)
    warm_idle: float | None = None
    #: trims: how long the weights had sat unread when ``first`` was sent (None
    #: where ``warm_idle`` is)
    idle: float | None = None
    #: trims: the instance start as the gateway measured it (its metric), in ms
    start_ms: float | None = None


class Trims:
    """A daemon and a gateway process; functions serving ``peers_model`` from ``code``."""

    def __init__(self, root: Path, models: dict[str, Path], warm_pool: int = 1) -> None:
        from trims.runtime.client import StoreClient

        self.root, self.models = root, models
        #: when the CPU tier's copy of the models was last read or written whole (see
        #: :func:`trims_cold`)
        self.touched = time.perf_counter()
        budget = sum(p.stat().st_size for p in models.values()) * 2 + (256 << 20)
        self.daemon, self.socket = start_daemon(root, cpu_budget=f"{budget >> 20}MiB")
        try:
            self.code = root / "code"
            self.code.mkdir()
            (self.code / "peersfn.py").write_text(FUNCTION)
            shutil.copy(MODEL_CODE / "peers_model.py", self.code)
            with StoreClient(self.socket) as client:
                for name, path in models.items():
                    client.add(name, path)
                    client.load(name, tier="cpu")
            self.touched = time.perf_counter()
            # the benchmark's client is one peer standing for many users
            self.gateway, self.url = start_gateway(
                root, "--store-socket", str(self.socket), "--max-connections-per-peer", "1024",
                "--warm-pool", str(warm_pool),
            )  # fmt: skip
        except BaseException:
            self.daemon.stop()
            raise

    def stop(self) -> None:
        self.gateway.stop()
        self.daemon.stop()

    def store(self, op: str, model: str) -> None:
        from trims.runtime.client import StoreClient

        with StoreClient(self.socket) as client:
            if op == "evict":
                client.evict(model, tier="cpu")
            else:
                client.load(model, tier="cpu")
                self.touched = time.perf_counter()

    def spec(
        self, name: str, model: str, width_in: int, cpus: float | None = None, **scaling: Any
    ) -> dict[str, Any]:
        """The function serving ``model``; ``cpus``: each instance's share of the cores
        (``resources.cpus``, which sizes its torch thread team, as Ray's ``num_cpus`` does)."""
        out = [
            {"name": "output", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "pid", "datatype": "INT64", "shape": [1]},
        ]
        spec: dict[str, Any] = {
            "name": name,
            "handler": "peersfn:handler",
            "code_dir": str(self.code),
            "models": [{"name": model, "alias": "weights", "source": str(self.models[model])}],
            "config": {"relu": model == "mlp"},
            "serves": {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, width_in]}],
                "outputs": out,
            },
            "scaling": {"request_timeout_s": 300, "queue_size": 1024, **scaling},
        }
        if cpus is not None:
            spec["resources"] = {"cpus": cpus}
        return spec

    async def deploy(self, session: Any, spec: dict[str, Any]) -> str:
        async with session.put(f"{self.url}/v1/functions/{spec['name']}", json=spec) as r:
            if r.status not in (200, 201):
                raise RuntimeError(f"deploying {spec['name']}: {r.status} {await r.text()}")
        return f"{self.url}/v2/models/{spec['name']}/infer"

    async def delete(self, session: Any, name: str, pids: set[int]) -> None:
        async with session.delete(f"{self.url}/v1/functions/{name}") as r:
            await r.read()
        while any(pid_alive(p) for p in pids):
            await asyncio.sleep(0.02)

    async def standby_prepared(self, session: Any, name: str) -> None:
        """Poll the function until its standby says it is prepared (not timed)."""
        while True:
            async with session.get(f"{self.url}/v1/functions/{name}") as r:
                doc = await r.json()
            if any(i.get("prepared") for i in doc["status"]["instances"]):
                return
            await asyncio.sleep(0.02)

    async def instance_start_ms(self, session: Any, name: str) -> float | None:
        from runtime_common import parse_metric

        async with session.get(f"{self.url}/metrics") as r:
            text = await r.text()
        value = parse_metric(text, "trims_cold_start_seconds_sum", {"function": name})
        return None if value is None else value * 1e3

    def pids(self) -> list[int]:
        return [self.daemon.proc.pid, *tree_pids(self.gateway.proc.pid)]


async def trims_cold(
    session: Any, trims: Trims, name: str, width: int, tier: str, cache: str, standby: bool
) -> ColdRun:
    """First and warm response of a new function (no instance) on ``full``, and its instance
    start as the gateway saw it; with ``standby`` the function keeps one (``scaling.standby:
    1``), prepared before the cache is dropped and the clock starts.

    A third request, to the same instance, waits first as long as the CPU tier's weights had
    sat unread before the first one (Note [idle memory] in the module's docstring): the warm
    request such a first request should be held against."""
    # the instance outlives the idle-matched wait (at most IDLE_CAP_S) and the peers' cases
    spec = trims.spec(
        name, "full", width, max_instances=1, standby=int(standby), idle_timeout_s=600
    )
    url = await trims.deploy(session, spec)
    if standby:
        await trims.standby_prepared(session, name)
    if tier == "disk":
        trims.store("evict", "full")
    prepare_cache(cache)
    infer = Infer(session, url, v2_json_request(width))
    t0 = time.perf_counter()
    idle = min(t0 - trims.touched, IDLE_CAP_S)
    pid = await infer.pid()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert await infer.pid() == pid, "the warm request met another instance"
    warm = time.perf_counter() - t0
    trims.touched = time.perf_counter()
    warm_idle = None
    if tier == "cpu" or cache == "warm":
        await asyncio.sleep(idle)
        t0 = time.perf_counter()
        assert await infer.pid() == pid, "the warm request met another instance"
        warm_idle = time.perf_counter() - t0
        trims.touched = time.perf_counter()
    start = await trims.instance_start_ms(session, name)
    await trims.delete(session, name, {pid})
    if tier == "disk":
        trims.store("load", "full")
    return ColdRun(first, warm, warm_idle, idle if warm_idle is not None else None, start)
