"""TorchServe 0.12.0 as a peer of bench/peers.py.

Each model is packed as a user would: ``torch-model-archiver --handler peers_handler.py
--config-file model-config.yaml --archive-format no-archive`` into the server's model store;
the handler (``peers_torchserve/peers_handler.py``) opens the weights with safetensors'
``load_file`` (a private mmap: no copy) and runs ``peers_model.forward``. TorchServe is a Java
frontend (netty) handing each request to one of a model's Python worker processes, each
loading the model: ``workers`` is their number per model, and ``workers == 0`` is one worker
(the frontend cannot run Python). Its management API (``POST /models``, ``DELETE /models/NAME``)
is the in-process load. Requests are V2 JSON on its KServe v2 route, read by the handler;
TorchServe has no binary tensor format.

Configured as its performance guide recommends for CPU: workers from physical cores / 2 up,
each with ``torch.set_num_threads(1)`` (in the handler); netty threads (one per core) and
``job_queue_size`` (100) at their defaults. TorchServe 0.12 asks for token auth and an enabled
model API before it loads models by API: auth is off and the model API on, with every port on
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peer_base import HERE, ModelFile, Peer, PeerServer
from runtime_common import free_port

HANDLER = HERE / "peers_torchserve" / "peers_handler.py"
#: Debian's JRE for TorchServe's Java frontend
JRE_PACKAGE = "openjdk-17-jre-headless"


class TorchServeServer(PeerServer):
    def __init__(
        self,
        port: int,
        management_port: int,
        workers: int,
        cmd: list[str],
        log: Path,
        env: dict[str, str],
        cwd: Path,
    ) -> None:
        super().__init__(cmd, log, env, cwd)
        self.url = f"http://127.0.0.1:{port}"
        self.management_url = f"http://127.0.0.1:{management_port}"
        self.workers = workers

    def infer_url(self, model: str) -> str:
        return f"{self.url}/v2/models/{model}/infer"

    def stop(self) -> None:
        """The launcher dies at once on SIGTERM, and the base then SIGKILLs the JVM and its
        workers (the same group); waits until they are reaped, so none is left listed."""
        import psutil

        group = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(process.pid) == self.proc.pid:
                    group.append(process)
        super().stop()
        psutil.wait_procs(group, timeout=30)

    async def load(self, session: Any, model: str) -> None:
        params = {
            "url": model,
            "model_name": model,
            "initial_workers": str(self.workers),
            "synchronous": "true",
        }
        async with session.post(f"{self.management_url}/models", params=params) as r:
            if r.status != 200:
                raise RuntimeError(f"TorchServe load {model}: {r.status} {await r.text()}")

    async def unload(self, session: Any, model: str) -> None:
        async with session.delete(f"{self.management_url}/models/{model}") as r:
            if r.status != 200:
                raise RuntimeError(f"TorchServe unload {model}: {r.status} {await r.text()}")


class TorchServe(Peer):
    name = "torchserve"
    #: TorchServe imports yaml in its workers without declaring PyYAML
    packages = (
        "torchserve==0.12.0",
        "torch-model-archiver==0.12.0",
        "pyyaml",
        "torch==2.13.0",
        "safetensors",
        "numpy",
    )
    version_module = "ts"
    load_api = True
    configuration = (
        "custom handler (safetensors load_file, mmap) archived with --archive-format "
        "no-archive; default_workers_per_model = N Python worker processes (0 -> 1: the Java "
        "frontend cannot run the model), torch.set_num_threads(1) in each as its performance "
        "guide recommends; netty threads (one per core) and job_queue_size 100 at defaults; "
        "token auth off, model API on, 127.0.0.1; V2 JSON on /v2/models/NAME/infer read by "
        "the handler (the kservev2 envelope cannot answer two outputs); no binary tensors"
    )

    def setup(self) -> None:
        super().setup()
        if shutil.which("java") is None:
            for cmd in (
                ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", JRE_PACKAGE],
            ):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(tail))

    def unavailable(self) -> str | None:
        """Also needs its workers' imports and a JRE for the frontend."""
        reason = super().unavailable()
        if reason is not None:
            return reason
        probe = self.venv.run("import ts.model_service_worker")
        if probe.returncode != 0:
            return (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        if shutil.which("java") is None:
            return f"no java on PATH: apt-get install {JRE_PACKAGE} (python bench/peers.py --setup)"
        return None

    def start(
        self, root: Path, models: Sequence[ModelFile], workers: int, loaded: bool = True
    ) -> PeerServer:
        port, management_port = free_port(), free_port()
        home = root / f"torchserve-{port}"
        store, tmp, logs = home / "store", home / "tmp", home / "logs"
        for folder in (store, tmp, logs):
            folder.mkdir(parents=True)
        for m in models:
            self._archive(home, store, m)
        replicas = max(1, workers)
        config = {
            "inference_address": f"http://127.0.0.1:{port}",
            "management_address": f"http://127.0.0.1:{management_port}",
            "metrics_address": f"http://127.0.0.1:{free_port()}",
            "grpc_inference_address": "127.0.0.1",
            "grpc_inference_port": free_port(),
            "grpc_management_address": "127.0.0.1",
            "grpc_management_port": free_port(),
            "disable_token_authorization": "true",
            "enable_model_api": "true",
            "default_workers_per_model": replicas,
            "disable_system_metrics": "true",
        }
        properties = home / "config.properties"
        properties.write_text("".join(f"{k}={v}\n" for k, v in config.items()))
        cmd = [
            str(self.venv.bin("torchserve")),
            "--start",
            "--foreground",
            "--ncs",
            "--model-store",
            str(store),
            "--ts-config",
            str(properties),
        ]
        if loaded:
            cmd += ["--models", *(f"{m.name}={m.name}" for m in models)]
        # its pid file and its workers' unix sockets live in the temp dir; the ones of other
        # TorchServe instances must not collide with this one's
        env = {**self.env(), "TMPDIR": str(tmp), "TEMP": str(tmp)}
        env |= {"LOG_LOCATION": str(logs), "METRICS_LOCATION": str(logs)}
        log = root / f"torchserve-{port}.log"
        return TorchServeServer(port, management_port, replicas, cmd, log, env, home)

    def _archive(self, home: Path, store: Path, model: ModelFile) -> None:
        """``model`` as a folder in ``store``, its weights named (not copied) in its config."""
        config = home / f"{model.name}-config.yaml"
        config.write_text(json.dumps({"handler": {"weights": str(model.path), "relu": model.relu}}))
        cmd = [
            str(self.venv.bin("torch-model-archiver")),
            "--model-name",
            model.name,
            "--version",
            "1.0",
            "--handler",
            str(HANDLER),
            "--config-file",
            str(config),
            "--export-path",
            str(store),
            "--archive-format",
            "no-archive",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"torch-model-archiver {model.name}: {done.stderr.strip()}")

    async def live(self, session: Any, server: PeerServer) -> None:
        assert isinstance(server, TorchServeServer)

        async def check() -> None:
            async with session.get(f"{server.url}/ping") as r:
                if r.status != 200:
                    raise RuntimeError("not live yet")

        await server.wait(session, check)


PEER = TorchServe
