"""Gateway fixtures: a real gateway on 127.0.0.1 port 0 with the real local executor.

``start_gateway(...)`` runs one in the test's event loop (its settings as keywords) and stops it
at teardown; ``GatewayProcess`` runs ``python -m trims gateway`` as a subprocess for the tests
that signal or kill it. Both turn authentication off unless the test gives tokens or asks for
it (``auth=True`` / ``gateway_process(..., auth=True)``): most tests are about something else,
and tests/runtime/gateway/test_secure_defaults.py covers the default.
Workers fork from a zygote that preloads only numpy, to start fast.
The docker fixtures (tests/fixtures/docker.py) serve the gateway-with-docker tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.fixtures.docker import docker_client, runtime_image
from trims.runtime.executors import create_executor
from trims.runtime.gateway.app import create_app
from trims.runtime.gateway.context import GATEWAY
from trims.runtime.gateway.server import start_runner, start_site
from trims.runtime.gateway.service import Gateway
from trims.runtime.settings import GatewaySettings, Token

__all__ = ["docker_client", "runtime_image"]

FUNCS = Path(__file__).parent / "funcs"
ADMIN = Token("admin-secret-1", frozenset({"admin"}), "admin")
PRELOAD = ("numpy",)


def echo_spec(
    name: str = "echo", handler: str = "gwfuncs:handler", **scaling: Any
) -> dict[str, Any]:
    """A spec for a test function in ``funcs/``; ``scaling`` keywords go to its scaling."""
    return {"name": name, "handler": handler, "code_dir": str(FUNCS), "scaling": scaling}


@dataclass
class RunningGateway:
    url: str
    app: web.Application
    session: aiohttp.ClientSession
    token: str | None = None
    runner: web.AppRunner | None = field(default=None, repr=False)

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY]

    def headers(self, token: str | None = None) -> dict[str, str]:
        token = token or self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def deploy(self, spec: dict[str, Any]) -> dict[str, Any]:
        async with self.session.put(
            f"{self.url}/v1/functions/{spec['name']}", json=spec, headers=self.headers()
        ) as r:
            doc = await r.json()
            assert r.status in (200, 201), doc
            return doc  # type: ignore[no-any-return]

    async def invoke(
        self, name: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        async with self.session.post(
            f"{self.url}/v1/functions/{name}/invoke",
            data=body,
            headers={**self.headers(), **(headers or {})},
        ) as r:
            return r.status, dict(r.headers), await r.read()

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path, headers=self.headers()) as r:
            return r.status, await r.json()


def local_factory(
    tmp: Path, store_socket: Path | None, environments: dict[str, str] | None = None
) -> Callable[[str], Any]:
    def make(name: str) -> Any:
        return create_executor(
            name, store_socket=store_socket, preload=PRELOAD, state_dir=tmp / "instances",
            **({"environments": environments} if environments else {}),
        )  # fmt: skip

    return make


@pytest.fixture
async def start_gateway(
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Awaitable[RunningGateway]]]:
    """Factory: ``await start_gateway(tokens=(ADMIN,), store_socket=...)``; ``environments=``
    goes to the local executor (name -> interpreter)."""
    started: list[RunningGateway] = []

    async def start(**options: Any) -> RunningGateway:
        root = tmp_path / f"gateway{len(started)}"
        root.mkdir()
        store_socket = options.pop("store_socket", root / "no-store.sock")
        environments = options.pop("environments", None)
        if "tokens" not in options:
            options.setdefault("auth", False)
        settings = GatewaySettings(
            port=0, store_socket=store_socket, drain_timeout_s=5.0, **options
        )
        app = create_app(settings, local_factory(root, store_socket, environments))
        runner = await start_runner(app, settings)
        await start_site(runner, settings, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        admin = next((t.secret for t in settings.tokens if "admin" in t.scopes), None)
        running = RunningGateway(
            f"http://127.0.0.1:{port}", app, aiohttp.ClientSession(), admin, runner
        )
        started.append(running)
        return running

    yield start
    for running in started:
        await running.session.close()
        assert running.runner is not None
        await running.runner.cleanup()


class GatewayProcess:
    """``python -m trims gateway`` as a subprocess (for SIGTERM and SIGKILL tests)."""

    def __init__(self, root: Path, *args: str, auth: bool = False) -> None:
        self.root = root
        self.args = args
        self.auth = auth
        #: The default state directory of this gateway ($XDG_STATE_HOME points into root).
        self.state_home = root / "xdg-state"
        self.log = root / "gateway.log"
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        offset = self.log.stat().st_size if self.log.exists() else 0
        cmd = [
            sys.executable,
            "-m",
            "trims",
            "gateway",
            "--port",
            "0",
            "--preload",
            ",".join(PRELOAD),
        ]
        if not self.auth and "--tokens-file" not in self.args:
            cmd.append("--no-auth")
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
        env["XDG_STATE_HOME"] = str(self.state_home)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*cmd, *self.args], stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            m = re.search(r"trims gateway ready url=(\S+)", text)
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"gateway did not get ready in {timeout_s}s")

    def terminate(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        proc, self.proc = self.proc, None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise

    def kill(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            proc.kill()
            proc.wait()

    def text(self) -> str:
        return self.log.read_bytes().decode(errors="replace")


@pytest.fixture
def gateway_process(tmp_path: Path) -> Any:
    """Factory: ``gateway_process(*cli_args)`` -> a started GatewayProcess (killed at teardown)."""
    started: list[GatewayProcess] = []

    def start(*args: str, auth: bool = False) -> GatewayProcess:
        root = tmp_path / f"gwproc{len(started)}"
        root.mkdir(exist_ok=True)
        process = GatewayProcess(root, *args, auth=auth)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.kill()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()
