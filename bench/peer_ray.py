"""Ray Serve 2.60.0 as a peer of bench/peers.py.

A driver (``peers_ray/peers_serve.py``) starts a Ray head in the server process, Serve's
HTTP proxy and one deployment (``peers_ray/peers_deployment.py``) serving every model through
Ray's model multiplexing; each replica is a Ray actor process that opens the weights with
safetensors' ``load_file`` (a private mmap: no copy) and runs ``peers_model.forward``.

Configured as Ray Serve's resource-allocation guide recommends for CPU inference: the Ray node
has one logical CPU per core, and each of the N replicas reserves ``num_cpus = cores / N``,
from which Ray sets its ``OMP_NUM_THREADS`` (at least 1), so N replicas share the cores
without oversubscribing them; OpenMP threads passive, as for every peer. Replicas are always
actor processes: ``workers == 0`` (the model in the server process) is one replica. Ray speaks
no V2, so the route is ours: V2 JSON in and out, the model in the multiplexing header; no
binary tensors. The load API is multiplexing's: a load request makes a replica run its
``@serve.multiplexed`` loader, an unload evicts the model from that replica's cache.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from peer_base import HERE, ModelFile, Peer, PeerServer, Request, v2_json_request
from runtime_common import free_port

CODE = HERE / "peers_ray"
#: the header Ray Serve's proxy routes multiplexed requests by
MODEL_HEADER = "serve_multiplexed_model_id"
#: Ray keeps a logical resource to 4 decimal places: a share is rounded down so that N of
#: them never add up to more than the node has
_CPU_PRECISION = 10_000
#: how long the killed processes may take to be gone (reaped)
EXIT_S = 10.0


class RayServer(PeerServer):
    def __init__(
        self, port: int, temp_dir: Path, cmd: list[str], log: Path, env: dict[str, str], cwd: Path
    ) -> None:
        super().__init__(cmd, log, env, cwd)
        self.url = f"http://127.0.0.1:{port}"
        self.temp_dir = temp_dir

    def infer_url(self, model: str) -> str:
        return f"{self.url}/v2/models/{model}/infer"

    def request(self, model: str, width: int, binary: bool = False) -> Request | None:
        if binary:
            return None
        body, headers, _ = v2_json_request(width)
        return Request(body, {**headers, MODEL_HEADER: model}, "Ray HTTP, V2 JSON payload")

    async def load(self, session: Any, model: str) -> None:
        await self._repository(session, model, "load")

    async def unload(self, session: Any, model: str) -> None:
        await self._repository(session, model, "unload")

    async def _repository(self, session: Any, model: str, op: str) -> None:
        url = f"{self.url}/v2/repository/models/{model}/{op}"
        async with session.post(url, headers={MODEL_HEADER: model}) as r:
            if r.status != 200:
                raise RuntimeError(f"Ray Serve {op} {model}: {r.status} {await r.text()}")

    def stop(self) -> None:
        """Kills the driver's whole tree at once: the group's signal would miss Ray's workers
        (the replicas, Serve's controller and proxy), which the raylet starts in process groups
        of their own, and Ray's own shutdown on SIGTERM takes seconds (the driver's handler,
        then each worker noticing its raylet gone) for a server whose state nothing keeps.
        Then the session directory (sockets, Ray's own logs) goes."""
        tree = self._tree()
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        super().stop()
        psutil.wait_procs(tree, timeout=EXIT_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _tree(self) -> list[psutil.Process]:
        try:
            driver = psutil.Process(self.proc.pid)
            return [driver, *driver.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


class RayServe(Peer):
    name = "ray"
    packages = ("ray[serve]==2.60.0", "torch==2.13.0", "safetensors", "numpy")
    version_module = "ray"
    load_api = True
    configuration = (
        "one deployment, model multiplexing (safetensors load_file, mmap); num_replicas = N "
        "actor processes (0: one), each with num_cpus = cores / N on a node of cores CPUs, "
        "so Ray sets OMP_NUM_THREADS = max(1, cores // N); OMP_WAIT_POLICY=PASSIVE; "
        "dashboard and usage stats off; V2 JSON payload on Ray's HTTP proxy (no binary)"
    )

    def unavailable(self) -> str | None:
        """Beyond the import: Ray's bundled GCS and raylet binaries must run on this glibc."""
        reason = super().unavailable()
        if reason is not None:
            return reason
        probe = self.venv.run(
            "import pathlib, subprocess, ray\n"
            "core = pathlib.Path(ray.__file__).parent / 'core' / 'src' / 'ray'\n"
            "for b in (core / 'gcs' / 'gcs_server', core / 'raylet' / 'raylet'):\n"
            "    done = subprocess.run([str(b), '--version'], capture_output=True, text=True)\n"
            "    if done.returncode:\n"
            "        raise SystemExit(done.stderr.strip() or f'{b} exited {done.returncode}')\n"
        )
        if probe.returncode != 0:
            return (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None

    def start(
        self, root: Path, models: Sequence[ModelFile], workers: int, loaded: bool = True
    ) -> PeerServer:
        port = free_port()
        folder = root / f"ray-{port}"
        folder.mkdir()
        # Ray's unix sockets live under its temp dir and a socket path may not pass 107
        # bytes: a short directory of its own, removed by stop()
        temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        cores = len(os.sched_getaffinity(0))
        replicas = max(workers, 1)
        config = {
            "port": port,
            "temp_dir": str(temp_dir),
            "cpus": cores,
            "replicas": replicas,
            "replica_cpus": math.floor(cores / replicas * _CPU_PRECISION) / _CPU_PRECISION,
            "loaded": loaded,
            "models": {m.name: {"path": str(m.path), "relu": m.relu} for m in models},
        }
        (folder / "config.json").write_text(json.dumps(config))
        env = {**self.env([CODE]), "RAY_USAGE_STATS_ENABLED": "0"}
        cmd = [str(self.venv.python), str(CODE / "peers_serve.py"), str(folder / "config.json")]
        return RayServer(port, temp_dir, cmd, folder / "ray.log", env, folder)

    async def live(self, session: Any, server: PeerServer) -> None:
        assert isinstance(server, RayServer)

        async def check() -> None:
            async with session.get(f"{server.url}/v2/health/live") as r:
                if r.status != 200:
                    raise RuntimeError("not live yet")

        await server.wait(session, check)


PEER = RayServe
