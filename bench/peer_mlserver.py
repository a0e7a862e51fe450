"""Seldon MLServer 1.7.1 as a peer of bench/peers.py.

Its custom runtime ``peers_mlserver/peers_runtime.py`` opens the weights with safetensors'
``load_file`` (a private mmap: no copy) and runs ``peers_model.forward``. Configured as its
docs recommend for CPU serving: ``parallel_workers`` one per core for throughput (its default
is 1), ``parallel_workers: 0`` for the cold cases (the model runs in the server process, no
worker hop), OpenMP threads passive (with the CPU torch build here its workers otherwise spin
on the cores they share: 188 req/s at c=16 instead of 657). Its repository API
(``/v2/repository/models/NAME/load``) is the in-process load.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peer_base import ModelFile, Peer, PeerServer, V2RepositoryServer
from runtime_common import free_port


class MLServerServer(V2RepositoryServer):
    label = "MLServer"


class MLServer(Peer):
    name = "mlserver"
    #: uvloop 0.23 crashes MLServer's worker pool ("There is no current event loop")
    packages = ("mlserver==1.7.1", "uvloop==0.21.0", "torch==2.13.0", "safetensors", "numpy")
    version_module = "mlserver"
    load_api = True
    configuration = (
        "custom MLModel runtime (safetensors load_file, mmap); parallel_workers = cores for "
        "throughput, N for N replicas, 0 (in the server process) for cold starts; "
        "OMP_WAIT_POLICY=PASSIVE; V2 JSON (no binary tensor extension in MLServer's REST)"
    )

    def start(
        self, root: Path, models: Sequence[ModelFile], workers: int, loaded: bool = True
    ) -> PeerServer:
        port = free_port()
        repo = root / f"mlserver-{port}"
        repo.mkdir()
        settings = {
            "http_port": port,
            "grpc_port": free_port(),
            "metrics_port": free_port(),
            "parallel_workers": workers,
            "load_models_at_startup": loaded,
            "debug": False,
        }
        (repo / "settings.json").write_text(json.dumps(settings))
        for m in models:
            (repo / m.name).mkdir()
            model = {
                "name": m.name,
                "implementation": "peers_runtime.PeersModel",
                "parameters": {"uri": str(m.path), "extra": {"relu": m.relu}},
            }
            (repo / m.name / "model-settings.json").write_text(json.dumps(model))
        cmd = [str(self.venv.bin("mlserver")), "start", str(repo)]
        return MLServerServer(port, cmd, root / f"mlserver-{port}.log", self.env(), repo)

    async def live(self, session: Any, server: PeerServer) -> None:
        assert isinstance(server, MLServerServer)

        async def check() -> None:
            async with session.get(f"{server.url}/v2/health/live") as r:
                if r.status != 200:
                    raise RuntimeError("not live yet")

        await server.wait(session, check)


PEER = MLServer
