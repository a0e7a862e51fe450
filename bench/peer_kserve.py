"""The KServe model server 0.21.0 as a peer of bench/peers.py.

Its server ``peers_kserve/peers_server.py`` subclasses ``kserve.Model`` (weights opened with
safetensors' ``load_file``: a private mmap, no copy) and starts ``kserve.ModelServer``.
Configured as KServe's custom-predictor docs recommend for using a machine's cores: its
``--workers`` uvicorn processes (N for N replicas; 1, the server process itself, for the cold
cases, as KServe has no separate model process to leave out); OpenMP threads passive, as for
every peer. KServe loads the models before it spawns its workers, which unpickle them: torch
moves the weights into one shared-memory segment they all map. The workers share one
listening socket, so KServe balances connections, not requests. Its repository API
(``/v2/repository/models/NAME/load``) is the in-process load, with one process.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from peer_base import (
    HERE,
    ModelFile,
    Peer,
    PeerServer,
    Request,
    V2RepositoryServer,
    v2_binary_request,
)
from runtime_common import free_port

SERVER = HERE / "peers_kserve" / "peers_server.py"
#: uvicorn's line, with the pid KServe's log format puts first, when a process serves
STARTED = re.compile(r"^\S+ \S+ (\d+) uvicorn\.error INFO:\s+Application startup complete", re.M)
#: How long the processes the group leader left may take to die once killed.
EXIT_TIMEOUT_S = 10.0


class KServeServer(V2RepositoryServer):
    """KServe's workers accept from one shared listening socket, and a connection stays with
    the worker that accepted it: a client's pooled connections reach the workers by the race
    for each accept, so n concurrent requests need not meet n workers (1 of 4 tries met all 4
    here). :meth:`wait` therefore also waits for every worker to serve; bench/peers.py then
    has every replica run a forward pass over new connections (a connection per request goes
    to whichever worker is idle)."""

    label = "KServe"

    def __init__(
        self,
        port: int,
        processes: int,
        cmd: list[str],
        log: Path,
        env: dict[str, str],
        cwd: Path,
    ):
        super().__init__(port, cmd, log, env, cwd)
        self.processes = processes

    def serving(self) -> set[int]:
        """The live processes whose uvicorn has started serving."""
        started = {int(p) for p in STARTED.findall(self.log_path.read_text(errors="replace"))}
        return started & set(self.pids())

    async def wait(self, session: Any, ready: Callable[[], Awaitable[Any]]) -> Any:
        answer = await super().wait(session, ready)
        if self.processes == 1:
            return answer

        async def all_serving() -> None:
            await asyncio.sleep(0.05)
            if len(self.serving()) < self.processes:
                raise RuntimeError(f"fewer than {self.processes} KServe workers serve yet")

        # bench/peers.py then has every worker answer, over new connections
        await super().wait(session, all_serving)
        return answer

    def stop(self) -> None:
        """Also waits for the group's other processes (multiprocessing's resource tracker
        and KServe's workers outlive the leader's SIGKILL by a moment) to be gone."""
        super().stop()
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.01)
        raise RuntimeError(f"KServe's process group {self.proc.pid} outlived SIGKILL")

    def request(self, model: str, width: int, binary: bool = False) -> Request | None:
        if binary:
            return v2_binary_request(width)
        return super().request(model, width)


class KServe(Peer):
    name = "kserve"
    packages = ("kserve==0.21.0", "torch==2.13.0", "safetensors", "numpy")
    version_module = "kserve"
    load_api = True
    configuration = (
        "custom kserve.Model (safetensors load_file, mmap) in kserve.ModelServer; workers "
        "(uvicorn processes, spawned after the models load) = N for N replicas, 1 (the server "
        "process) for cold starts; OMP_WAIT_POLICY=PASSIVE; V2 JSON and the V2 binary tensor "
        "extension; per-request latency log off; workers balance connections (shared socket)"
    )

    def version(self) -> str:
        # kserve has no __version__; its distribution metadata has the version
        done = self.venv.run("from importlib.metadata import version; print(version('kserve'))")
        return done.stdout.strip() or "?"

    def start(
        self, root: Path, models: Sequence[ModelFile], workers: int, loaded: bool = True
    ) -> PeerServer:
        port = free_port()
        folder = root / f"kserve-{port}"
        folder.mkdir()
        config = {
            "http_port": port,
            "grpc_port": free_port(),
            "workers": workers,
            "loaded": loaded,
            "models": [{"name": m.name, "path": str(m.path), "relu": m.relu} for m in models],
        }
        (folder / "config.json").write_text(json.dumps(config))
        cmd = [str(self.venv.python), str(SERVER), str(folder / "config.json")]
        log = folder / "server.log"
        return KServeServer(port, max(1, workers), cmd, log, self.env(), folder)

    async def live(self, session: Any, server: PeerServer) -> None:
        assert isinstance(server, KServeServer)

        async def check() -> None:
            async with session.get(f"{server.url}/v2/health/live") as r:
                if r.status != 200:
                    raise RuntimeError("not live yet")

        await server.wait(session, check)


PEER = KServe
