"""What bench/peers.py needs of a peer server, and the parts every peer shares.

A peer is one :class:`Peer` (its venv, its pinned packages, how to start it) and, once started,
one :class:`PeerServer` (a process group serving some of the benchmark's models over HTTP).
Each peer lives in ``bench/peer_<name>.py`` beside its server-side code in
``bench/peers_<name>/``; every one of them serves ``peers_model.forward`` (in
``bench/peers_mlserver/``) on the same safetensors files.

A model is given to :meth:`Peer.start` as :class:`ModelFile`: its name, its safetensors path
and whether ReLU runs between layers (the small MLP) or not (``full``). Every server answers
with two outputs, ``output`` (FP32) and ``pid`` (INT64 [1], the process that ran the forward
pass), and :class:`Infer` reads the pid from the answer to tell replicas apart.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
#: the shared model code every peer's server imports (``peers_model.forward``)
MODEL_CODE = HERE / "peers_mlserver"
#: How long a server may take to answer its first request after its process starts.
START_TIMEOUT_S = 300.0


class ModelFile(NamedTuple):
    name: str
    path: Path
    relu: bool


class Request(NamedTuple):
    """One request as a peer takes it: the body, its headers, and how it is described in the
    report (``"V2 JSON"``, ``"V2 binary"``, or the peer's native format)."""

    body: bytes
    headers: dict[str, str]
    format: str


def input_row(width: int) -> list[float]:
    """The request's one row: the same values for every system."""
    return [((i % 17) - 8) / 8.0 for i in range(width)]


def v2_body(width: int) -> bytes:
    inputs = [{"name": "input", "datatype": "FP32", "shape": [1, width], "data": input_row(width)}]
    return json.dumps({"inputs": inputs}).encode()


def v2_json_request(width: int) -> Request:
    return Request(v2_body(width), {"Content-Type": "application/json"}, "V2 JSON")


def v2_binary_request(width: int) -> Request:
    """The Open Inference Protocol's binary tensor extension: a JSON header whose input says
    ``binary_data_size``, then the raw little-endian float32 bytes; outputs asked for as
    JSON (the pid is read from them)."""
    import numpy as np

    raw = np.asarray(input_row(width), dtype="<f4").tobytes()
    inputs = [
        {
            "name": "input",
            "datatype": "FP32",
            "shape": [1, width],
            "parameters": {"binary_data_size": len(raw)},
        }
    ]
    outputs = [
        {"name": "output", "parameters": {"binary_data": False}},
        {"name": "pid", "parameters": {"binary_data": False}},
    ]
    header = json.dumps({"inputs": inputs, "outputs": outputs}).encode()
    return Request(
        header + raw,
        {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        },
        "V2 binary",
    )


def v2_answer_pid(body: bytes) -> int:
    """The pid output of a V2 JSON answer."""
    doc = json.loads(body)
    pid = next(o for o in doc["outputs"] if o["name"] == "pid")["data"]
    while isinstance(pid, list):
        pid = pid[0]
    return int(pid)


class Infer:
    """POSTs one request to ``url``; ``answer_pid`` reads the answering process from a 200."""

    def __init__(
        self,
        session: Any,
        url: str,
        request: Request,
        answer_pid: Callable[[bytes], int] = v2_answer_pid,
    ) -> None:
        self.session, self.url, self.request = session, url, request
        self.answer_pid = answer_pid
        self.failures: dict[int, int] = {}

    async def pid(self) -> int:
        """The pid in a 200 answer; a request that found its pooled connection closed by the
        server before a byte was sent (a server just started can close the one it answered its
        not-ready probes on) is sent once more, on a new connection."""
        import aiohttp

        r = self.request
        for attempt in (0, 1):
            try:
                async with self.session.post(self.url, data=r.body, headers=r.headers) as a:
                    body = await a.read()
                    if a.status != 200:
                        text = body[:300].decode(errors="replace")
                        raise RuntimeError(f"{self.url} answered {a.status}: {text}")
                return self.answer_pid(body)
            except (aiohttp.ClientOSError, aiohttp.ClientConnectionResetError) as e:
                unsent = isinstance(e, aiohttp.ClientConnectionResetError) or isinstance(
                    e.__cause__, aiohttp.ClientConnectionResetError
                )
                if attempt or not unsent:
                    raise
        raise AssertionError("unreachable")

    async def ok(self) -> bool:
        """Whether the answer was 200; other statuses are counted in :attr:`failures` (0: the
        connection failed)."""
        import aiohttp

        r = self.request
        try:
            async with self.session.post(self.url, data=r.body, headers=r.headers) as a:
                await a.read()
                status = a.status
        except aiohttp.ClientError:
            status = 0
        if status != 200:
            self.failures[status] = self.failures.get(status, 0) + 1
        return status == 200


class Venv:
    """A peer's own virtualenv: ``$TRIMS_<NAME>_VENV``, by default ``/tmp/trims-<name>-venv``."""

    def __init__(self, name: str) -> None:
        variable = f"TRIMS_{name.upper()}_VENV"
        self.variable = variable
        self.path = Path(os.environ.get(variable, f"/tmp/trims-{name}-venv"))

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def bin(self, name: str) -> Path:
        return self.path / "bin" / name

    def install(self, packages: Sequence[str], extra_args: Sequence[str] = ()) -> None:
        """Create the venv (once) and pip-install ``packages`` into it: idempotent, as pip is
        for pinned versions already installed. Raises with pip's own words on failure."""
        if not self.python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(self.path)], check=True)
        cmd = [str(self.python), "-m", "pip", "install", "-q", "--prefer-binary"]
        done = subprocess.run([*cmd, *extra_args, *packages], capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
            raise RuntimeError(f"pip install into {self.path} failed:\n" + "\n".join(tail))

    def run(self, code: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.python), "-c", code], capture_output=True, text=True, timeout=timeout_s
        )


class PeerServer:
    """A started peer: a process group (``start_new_session``) logging to ``log``."""

    def __init__(self, cmd: Sequence[str], log: Path, env: dict[str, str], cwd: Path) -> None:
        self.log_path = log
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            list(cmd),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    # -- what each peer says about itself -----------------------------------------------------

    def infer_url(self, model: str) -> str:
        raise NotImplementedError

    def request(self, model: str, width: int, binary: bool = False) -> Request | None:
        """The request for ``model`` (a [1, width] float32 input); None where the peer has
        no binary tensor format (``binary``)."""
        return None if binary else v2_json_request(width)

    def answer_pid(self, body: bytes) -> int:
        return v2_answer_pid(body)

    async def load(self, session: Any, model: str) -> None:
        """The peer's in-process load API (only where :attr:`Peer.load_api` says it has one)."""
        raise NotImplementedError

    async def unload(self, session: Any, model: str) -> None:
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------

    def infer(self, session: Any, model: str, width: int, binary: bool = False) -> Infer | None:
        request = self.request(model, width, binary)
        if request is None:
            return None
        return Infer(session, self.infer_url(model), request, self.answer_pid)

    async def wait(self, session: Any, ready: Callable[[], Awaitable[Any]]) -> Any:
        """Poll ``ready`` until it answers (connection refused, or not ready, meanwhile)."""
        import aiohttp

        deadline = time.perf_counter() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-20:]
                raise RuntimeError(
                    f"{type(self).__name__} exited ({self.proc.returncode}); {self.log_path}:\n"
                    + "\n".join(tail)
                )
            try:
                return await ready()
            except (TimeoutError, aiohttp.ClientError, RuntimeError):
                if time.perf_counter() > deadline:
                    raise
            await asyncio.sleep(0.005)

    def pids(self) -> list[int]:
        from runtime_common import tree_pids

        return tree_pids(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with _gone():
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with _gone():
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # what the group left behind (a peer's helpers that outlive their leader)
        with _gone():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class V2RepositoryServer(PeerServer):
    """A peer serving the Open Inference Protocol on ``url``, with its model repository
    extension (``/v2/repository/models/NAME/load`` and ``unload``) as its load API."""

    #: the peer's name in errors
    label = "the server"

    def __init__(
        self, port: int, cmd: Sequence[str], log: Path, env: dict[str, str], cwd: Path
    ) -> None:
        super().__init__(cmd, log, env, cwd)
        self.url = f"http://127.0.0.1:{port}"

    def infer_url(self, model: str) -> str:
        return f"{self.url}/v2/models/{model}/infer"

    async def load(self, session: Any, model: str) -> None:
        await self._repository(session, model, "load")

    async def unload(self, session: Any, model: str) -> None:
        await self._repository(session, model, "unload")

    async def _repository(self, session: Any, model: str, op: str) -> None:
        async with session.post(f"{self.url}/v2/repository/models/{model}/{op}") as r:
            if r.status != 200:
                raise RuntimeError(f"{self.label} {op} {model}: {r.status} {await r.text()}")


class _gone:
    """Ignores ProcessLookupError: the process (group) had already ended."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


class Peer:
    """One peer server: how to install it and how to start it on some models."""

    #: the name ``--systems`` takes and the JSON's ``system`` field
    name: str = ""
    #: pinned packages of its venv (torch is the CPU build ``torch==2.13.0``)
    packages: tuple[str, ...] = ()
    #: extra ``pip install`` arguments
    pip_args: tuple[str, ...] = ()
    #: the module whose ``__version__`` names the peer's version
    version_module: str = ""
    #: whether it has an API that loads a model into a server that already runs
    load_api: bool = False
    #: whether each replica is a process of its own (its answers carry distinct pids); else
    #: replicas are the peer's own unit inside one process (e.g. threads)
    process_replicas: bool = True
    #: how it is configured for CPU serving, for docs/runtime.md and the report
    configuration: str = ""

    def __init__(self) -> None:
        self.venv = Venv(self.name)

    def setup(self) -> None:
        """Install the peer (idempotent). Raises with the exact error where it cannot."""
        self.venv.install(self.packages, self.pip_args)

    def unavailable(self) -> str | None:
        """None where the peer can run here; else the exact reason it cannot."""
        if not self.venv.python.exists():
            return f"no venv at {self.venv.path}: run python bench/peers.py --setup"
        probe = self.venv.run(f"import {self.version_module}")
        if probe.returncode != 0:
            return (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None

    def version(self) -> str:
        done = self.venv.run(
            f"import {self.version_module} as m; print(getattr(m, '__version__', '?'))"
        )
        return done.stdout.strip() or "?"

    def env(self, extra_path: Sequence[Path] = ()) -> dict[str, str]:
        """The server's environment: this one, its OpenMP threads passive (as trims' workers
        run them, Note [passive OpenMP threads] in trims.runtime.functions.spec; unless the
        environment says otherwise), and ``PYTHONPATH`` holding the shared model code."""
        paths = [str(p) for p in (*extra_path, MODEL_CODE)]
        return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, "PYTHONPATH": os.pathsep.join(paths)}

    def start(
        self, root: Path, models: Sequence[ModelFile], workers: int, loaded: bool = True
    ) -> PeerServer:
        """A server on ``models`` with ``workers`` replicas (processes, or the peer's own unit),
        each model loaded at start. ``workers == 0``: the model runs in the server process
        where the peer can do so (the cold cases), else one replica. ``loaded=False`` (only
        where :attr:`load_api`): the server knows the models but loads none until
        :meth:`PeerServer.load`. Logs and repositories go in a new folder under ``root``."""
        raise NotImplementedError

    async def live(self, session: Any, server: PeerServer) -> None:
        """Wait until a server started with ``loaded=False`` answers its API."""
        raise NotImplementedError

    async def ready(self, session: Any, server: PeerServer, model: str, width: int) -> int:
        """Wait until ``server`` answers a full request for ``model``; the answering pid."""
        infer = server.infer(session, model, width)
        assert infer is not None
        return int(await server.wait(session, infer.pid))
