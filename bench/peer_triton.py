"""NVIDIA Triton Inference Server, through PyTriton 0.7.0, as a peer of bench/peers.py.

PyTriton's wheel bundles the real ``tritonserver`` binary and its python backend; the
server-side script ``peers_triton/peers_serve.py`` binds each model with ``Triton.bind``
and serves it. Replicas are Triton model instances (``instance_group`` KIND_CPU, one
inference callable each): PyTriton runs them as threads of the user's process, so they all
answer with one pid (:attr:`process_replicas` is False). Triton's HTTP front end speaks V2
REST with the binary tensor extension.

The python backend's stub embeds ``libpython3.X.so`` and runs the venv's standard library on
it, so it must be the venv Python's own: the server finds that Python's LIBDIR first on
``LD_LIBRARY_PATH`` (a shared build, as pyenv's here); ``setup`` installs Debian's
``libpython3.X`` (apt-get) where none is found, and ``unavailable`` says so where the one
found is another Python's.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from peer_base import ModelFile, Peer, PeerServer, Request, v2_binary_request
from runtime_common import free_port

SERVER_CODE = Path(__file__).resolve().parent / "peers_triton"
#: how long the server may take to stop tritonserver and its models on SIGINT
STOP_TIMEOUT_S = 30.0


class PyTritonServer(PeerServer):
    def __init__(self, port: int, cmd: list[str], log: Path, env: dict[str, str], cwd: Path):
        super().__init__(cmd, log, env, cwd)
        self.url = f"http://127.0.0.1:{port}"

    def infer_url(self, model: str) -> str:
        return f"{self.url}/v2/models/{model}/infer"

    def request(self, model: str, width: int, binary: bool = False) -> Request | None:
        return v2_binary_request(width) if binary else super().request(model, width)

    def stop(self) -> None:
        """SIGINT to the PyTriton process first, its way to stop: it stops tritonserver and
        its stubs, then its models' handlers. The base stop then ends what is left of the
        group, and the python backend's shared memory named after this server's pid goes
        (a stub that Triton's exit timeout kills leaves its region in /dev/shm)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        super().stop()
        for region in Path("/dev/shm").glob(f"pytrtion{self.proc.pid}-*"):
            region.unlink(missing_ok=True)


class PyTriton(Peer):
    name = "triton"
    packages = ("nvidia-pytriton==0.7.0", "torch==2.13.0", "safetensors", "numpy")
    version_module = "pytriton"
    #: PyTriton can bind a model into a running server, but unbinds only in Triton.stop: a
    #: model, once unloaded, cannot be bound again under its name in the same process
    load_api = False
    process_replicas = False
    configuration = (
        "PyTriton Triton.bind with batching=False (max_batch_size 0); replicas are Triton model "
        "instances (instance_group KIND_CPU), which PyTriton runs as threads of one Python "
        "process (tritonserver and one relay stub per instance are separate processes); "
        "torch intra-op threads = cores / instances so instances do not oversubscribe the "
        "cores (PyTorch's CPU threading notes); OMP_WAIT_POLICY=PASSIVE; V2 JSON and binary"
    )

    @functools.cached_property
    def python(self) -> dict[str, str]:
        """The venv's Python: its version, libpython soname and the folder holding it, and
        where PyTriton is (asked once: ``start`` must not spend a second on it)."""
        done = self.venv.run(
            "import json, sys, sysconfig, pytriton.server.triton_server as t; "
            "print(json.dumps({'version': sys.version, 'soname': sysconfig.get_config_var("
            "'INSTSONAME'), 'libdir': sysconfig.get_config_var('LIBDIR'), 'pytriton': t.__file__}))"
        )
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip())
        info: dict[str, str] = json.loads(done.stdout)
        return info

    def library_path(self, python: dict[str, str]) -> str:
        """``LD_LIBRARY_PATH`` for tritonserver: the venv Python's own libpython first (a
        shared build's, e.g. pyenv's), where the stub must find it."""
        own = Path(python["libdir"]) / python["soname"]
        paths = [python["libdir"]] if own.exists() else []
        return os.pathsep.join([*paths, *filter(None, [os.environ.get("LD_LIBRARY_PATH")])])

    def libraries(self) -> tuple[list[str], str | None]:
        """ldd's "not found" lines for tritonserver and the python backend's stub (a library,
        a glibc version), and the libpython the stub resolves."""
        python = self.python
        dist = Path(python["pytriton"]).parents[1] / "tritonserver"
        version = ".".join(python["version"].split(".")[:2])
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        env = {**os.environ, "LD_LIBRARY_PATH": self.library_path(python)}
        missing, libpython = [], None
        for binary in (dist / "bin" / "tritonserver", stub):
            done = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env)
            for line in (done.stdout + done.stderr).splitlines():
                if "not found" in line:
                    missing.append(f"{binary.name}: {line.strip()}")
                elif line.strip().startswith("libpython") and "=>" in line:
                    libpython = line.split("=>")[1].split("(")[0].strip()
        return missing, libpython

    def setup(self) -> None:
        super().setup()
        missing, _ = self.libraries()
        for line in missing:
            found = re.search(r"libpython(3\.\d+)", line)
            if found is None:
                continue
            for cmd in (
                ["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", f"libpython{found.group(1)}"],
            ):
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(tail))

    def unavailable(self) -> str | None:
        """Also: a library tritonserver or the stub lacks, and a libpython other than the
        venv's Python (the stub embeds it, and runs the venv's standard library on it)."""
        reason = super().unavailable()
        if reason is not None:
            return reason
        missing, libpython = self.libraries()
        if missing:
            return missing[0]
        if libpython is None:
            return None
        # the library's own version string, read without running it
        probe = self.venv.run(
            f"import ctypes, sys; f = ctypes.CDLL({libpython!r}).Py_GetVersion; "
            "f.restype = ctypes.c_char_p; print(f().decode() == sys.version, f().decode())"
        )
        same, _, version = probe.stdout.strip().partition(" ")
        if same != "True":
            return (
                f"the python backend stub would run on {libpython} (Python {version}), not on "
                f"the venv's Python {self.python['version']}: build {self.venv.path} on a "
                "Python with a shared libpython (pyenv: PYTHON_CONFIGURE_OPTS=--enable-shared)"
            )
        return None

    def start(
        self, root: Path, models: Sequence[ModelFile], workers: int, loaded: bool = True
    ) -> PeerServer:
        port = free_port()
        folder = root / f"triton-{port}"
        folder.mkdir()
        # workers == 0 (the cold cases) is one instance: PyTriton runs every instance in the
        # server's own Python process anyway
        instances = max(1, workers)
        spec = {
            "http_port": port,
            "grpc_port": free_port(),
            "metrics_port": free_port(),
            "workspace": str(folder / "workspace"),
            "instances": instances,
            "models": [{"name": m.name, "path": str(m.path), "relu": m.relu} for m in models],
        }
        (folder / "spec.json").write_text(json.dumps(spec))
        env = self.env([SERVER_CODE])
        env["LD_LIBRARY_PATH"] = self.library_path(self.python)
        threads = max(1, len(os.sched_getaffinity(0)) // instances)
        env.setdefault("OMP_NUM_THREADS", str(threads))
        cmd = [
            str(self.venv.python),
            str(SERVER_CODE / "peers_serve.py"),
            str(folder / "spec.json"),
        ]
        return PyTritonServer(port, cmd, folder / "triton.log", env, folder)


PEER = PyTriton
