"""`trims worker` as containers run it: a real process on TCP or a Unix socket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.unprivileged import writable_by_functions
from tests.fixtures.workers import connect_worker, free_port
from trims.errors import Unavailable
from trims.runtime.wire import Kind
from trims.runtime.worker.client import raise_for_error
from trims.runtime.worker.exits import EXIT_INIT_FAILED

SLOW = """
import time

def init(ctx):
    if ctx.config.get("fail"):
        raise RuntimeError("cannot load weights")

def handler(request, ctx):
    time.sleep(float(request.text() or 0))
    return {"pid": __import__("os").getpid()}
"""


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[object]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(listen: str, config: dict[str, object] | None = None) -> subprocess.Popen[bytes]:
        (tmp_path / "handler.py").write_text(textwrap.dedent(SLOW))
        if config:
            # A spec file (YAML, code_dir = its folder) as a container image would ship it.
            (tmp_path / "function.yaml").write_text(
                f"name: slow\nhandler: handler:handler\nconfig: {json.dumps(config)}\n"
            )
            source = ["--spec", str(tmp_path / "function.yaml")]
        else:
            spec = {"name": "slow", "handler": "handler:handler", "code_dir": str(tmp_path)}
            source = ["--spec-json", json.dumps(spec)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "trims", "worker", *source,
             "--listen", listen, "--instance-id", "slow-1"],
            stderr=open(tmp_path / "worker.log", "ab"),  # noqa: SIM115
        )  # fmt: skip
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_tcp_worker_serves_and_drains_on_sigterm(worker: object) -> None:
    port = free_port()
    proc = worker(f"tcp:127.0.0.1:{port}")  # type: ignore[operator]
    conn = await connect_worker(f"tcp:127.0.0.1:{port}")
    hello = await conn.hello()
    assert hello["state"] == "ready" and hello["pid"] == proc.pid
    frame = await conn.request(Kind.INVOKE, None, b"0", timeout=30)
    raise_for_error(frame)
    assert json.loads(frame.body) == {"pid": proc.pid}

    in_flight = asyncio.ensure_future(conn.request(Kind.INVOKE, None, b"0.5", timeout=30))
    await asyncio.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.1)
    refused = await conn.request(Kind.INVOKE, None, b"0", timeout=30)
    with pytest.raises(Unavailable, match="draining"):
        raise_for_error(refused)
    done = await in_flight
    raise_for_error(done)
    assert await asyncio.get_running_loop().run_in_executor(None, proc.wait) == 0
    conn.close()


async def test_init_failure_is_told_to_the_first_client_then_the_worker_exits(
    worker: object, tmp_path: Path
) -> None:
    # Run as root, the worker drops to nobody: its socket goes where nobody may write.
    path = writable_by_functions(tmp_path / "run") / "w.sock"
    proc = worker(f"unix:{path}", {"fail": True})  # type: ignore[operator]
    conn = await connect_worker(f"unix:{path}")
    hello = await conn.hello()
    assert hello["state"] == "failed"
    # An unexpected exception says where it was raised: the worker's log goes with it.
    assert hello["reason"] == "RuntimeError: cannot load weights (at handler.py:6 in init)"
    conn.close()
    assert await asyncio.get_running_loop().run_in_executor(None, proc.wait) == EXIT_INIT_FAILED
    assert not os.path.exists(path)
    assert "init failed: RuntimeError: cannot load weights" in (tmp_path / "worker.log").read_text()


def test_worker_cli_rejects_a_bad_spec_with_the_field() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trims", "worker", "--spec-json", '{"name": "x", "handler": 1}',
         "--listen", "unix:/tmp/never.sock"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "handler: must be a non-empty string" in result.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="only a root worker can be asked to stay root")
def test_worker_cli_refuses_to_run_function_code_as_root(tmp_path: Path) -> None:
    spec = {"name": "x", "handler": "handler:handler", "code_dir": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "trims", "worker", "--spec-json", json.dumps(spec),
         "--listen", f"unix:{tmp_path / 'w.sock'}", "--run-as", "root"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert "function code never runs as root" in result.stderr
