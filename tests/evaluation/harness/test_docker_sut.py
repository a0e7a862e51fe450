"""Evaluations whose gateway runs the function in a container: ``--executor docker``.

A real gateway with the docker executor (containers from the runtime image, which carries ONNX
Runtime), a real store daemon, the real digits-mlp manifest under LoadGen: the function answers
as the model in this process does, its accuracy is the manifest's, the record says where it ran,
and no container is left (the ``docker_executor`` fixture fails a test that leaves one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

from tests.fixtures.store import DaemonProcess
from trims.evaluation.db import ResultsDB
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.manifest import Manifest, load_manifest, shipped_manifest_paths
from trims.evaluation.harness.manifest_run import GatewayTarget, manifest_model_file, run_manifest
from trims.evaluation.harness.results import record_evaluation
from trims.runtime.client import StoreClient
from trims.runtime.executors.docker import LABEL_FUNCTION

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[3]
ONNX_HANDLER = ROOT / "examples" / "onnx_zoo"
FUNCTION = "eval-digits-mlp"
#: Short LoadGen runs: every one of the 450 samples is still answered once in accuracy mode.
SHORT = LoadGenSettings(min_duration_ms=300, min_query_count=16)


@pytest.fixture
def digits() -> Manifest:
    return load_manifest(next(p for p in shipped_manifest_paths() if p.stem == "digits-mlp"))


@pytest_asyncio.fixture
async def start_docker_gateway(
    docker_executor: Callable[..., Any], tmp_path: Path
) -> AsyncIterator[Callable[[DaemonProcess | None], Awaitable[str]]]:
    """Factory: a gateway on 127.0.0.1 whose functions run in containers, with the store
    socket of ``daemon`` mounted (or none). At teardown the gateway stops its instances; then
    the docker fixture fails the test if any container is left.

    The instances' socket directories live in a short folder under /tmp: the host path of a
    worker's socket (``<state_dir>/<instance>/<instance>.sock``, the instance id twice) under
    pytest's tmp_path passes the 107 bytes a Unix socket address holds, and the gateway would
    never reach the worker."""
    from aiohttp import web

    from trims.runtime.gateway.app import create_app
    from trims.runtime.settings import GatewaySettings

    runners: list[web.AppRunner] = []
    state = Path(tempfile.mkdtemp(prefix="trims-e9-", dir="/tmp"))

    async def start(daemon: DaemonProcess | None) -> str:
        store = daemon.socket if daemon is not None else tmp_path / "no-store.sock"
        settings = GatewaySettings(port=0, store_socket=store, drain_timeout_s=5.0, auth=False)
        folder = state / str(len(runners))
        app = create_app(
            settings, lambda name: docker_executor(store_socket=store, state_dir=folder)
        )
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()
    shutil.rmtree(state, ignore_errors=True)


def _containers(client: Any) -> list[Any]:
    return list(client.containers.list(all=True, filters={"label": f"{LABEL_FUNCTION}={FUNCTION}"}))


async def _all_removed(client: Any) -> bool:
    """Wait until the function's containers are removed (the gateway stops a removed
    function's instances after answering the DELETE); True when none is left."""
    import docker.errors

    for container in _containers(client):
        with contextlib.suppress(docker.errors.NotFound):
            await asyncio.to_thread(container.wait, condition="removed", timeout=60)
    return _containers(client) == []


def _cpu_loads(daemon: DaemonProcess) -> int:
    return int(daemon.request("stats")["result"]["tiers"]["cpu"]["loads"])


async def test_a_docker_function_answers_as_the_direct_sut_with_the_model_from_the_store(
    start_docker_gateway: Callable[[DaemonProcess | None], Awaitable[str]],
    start_daemon: Callable[..., DaemonProcess],
    docker_client: Any,
    digits: Manifest,
    tmp_path: Path,
) -> None:
    daemon = start_daemon()
    work = tmp_path / "work"
    model = manifest_model_file(digits, work)
    with StoreClient(daemon.socket) as admin:
        admin.add(digits.name, model)
    url = await start_docker_gateway(daemon)
    target = GatewayTarget(url, ONNX_HANDLER, executor="docker")
    loads = _cpu_loads(daemon)

    def evaluate() -> tuple[Any, Any]:
        in_container = run_manifest(
            digits, "gateway", "single-stream", "both", SHORT, work_dir=work, gateway=target,
            socket_path=daemon.socket,
        )  # fmt: skip
        in_process = run_manifest(
            digits, "direct", "single-stream", "accuracy", SHORT, work_dir=work,
            socket_path=daemon.socket,
        )  # fmt: skip
        return in_container, in_process

    in_container, in_process = await asyncio.to_thread(evaluate)

    # the container mapped the store's copy (one load into the CPU tier), and the direct SUT
    # mapped that same copy afterwards: no second load
    assert _cpu_loads(daemon) == loads + 1
    assert in_container.executor == "docker" and in_process.executor == "local"
    outputs, expected = in_container.run.outputs, in_process.run.outputs
    assert sorted(outputs) == list(range(digits.dataset.samples))
    for i, out in expected.items():
        np.testing.assert_allclose(outputs[i], out, rtol=1e-5, atol=1e-7)
    assert digits.accuracy is not None and in_container.accuracy is not None
    assert in_container.accuracy == in_process.accuracy
    assert abs(in_container.accuracy - digits.accuracy.reference) <= 0.005
    assert in_container.run.performance is not None and in_container.run.performance.qps

    db = ResultsDB(str(tmp_path / "results.sqlite"))
    try:
        record = record_evaluation(db, in_container.to_evaluation("both"))
        stored = db.get_evaluation(record.id).evaluation
    finally:
        db.close()
    assert (stored.executor, stored.sut, stored.scenario) == ("docker", "gateway", "single-stream")
    assert stored.accuracy is not None and stored.accuracy.value == in_container.accuracy
    # removing the function at the end of the evaluation stops and removes its container
    assert await _all_removed(docker_client)


async def test_trims_evaluate_run_with_the_docker_executor_records_it(
    start_docker_gateway: Callable[[DaemonProcess | None], Awaitable[str]],
    docker_client: Any,
    digits: Manifest,
    tmp_path: Path,
) -> None:
    """The command line, without a store: the container loads the model file staged beside
    its handler (Note [functions in containers] in manifest_run.py)."""
    url = await start_docker_gateway(None)
    out, db_path = tmp_path / "out.json", tmp_path / "results.sqlite"
    argv = [
        sys.executable, "-m", "trims", "evaluate", "run", "digits-mlp",
        "--sut", "gateway", "--executor", "docker", "--gateway", url,
        "--scenario", "single-stream", "--mode", "both", "--quick",
        "--socket", str(tmp_path / "no-store.sock"), "--work-dir", str(tmp_path / "work"),
        "--db", str(db_path), "--json", str(out),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
        env=env,
    )  # fmt: skip
    stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stdout.decode() + stderr.decode()

    (evaluation,) = json.loads(out.read_text())["evaluations"]
    assert (evaluation["model"], evaluation["sut"]) == ("digits-mlp", "gateway")
    assert digits.accuracy is not None
    assert abs(evaluation["accuracy"]["value"] - digits.accuracy.reference) <= 0.005
    db = ResultsDB(str(db_path))
    try:
        (record,) = db.evaluations()
    finally:
        db.close()
    assert record.evaluation.executor == "docker"
    assert await _all_removed(docker_client)
