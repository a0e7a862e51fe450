"""What function code inherits, and how long its processes live (issue 41, findings 2-4).

A hostile function (running as ``nobody`` under a root gateway) read the gateway's tokens from
its environment, held the gateway's log and root's ONNX Runtime database open, and left a
double-forked ``setsid`` process running after its function was deleted. These tests run the
real gateway or the real local executor, as root, with workers that drop to ``nobody``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gateway import GatewayProcess, pid_alive, wait_until
from tests.fixtures.unprivileged import writable_by_functions
from trims.runtime.executors.base import WORKER_ENV_ALLOWED, Instance, inherited_env
from trims.runtime.executors.local import LocalExecutor
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.functions_cli import GatewayClient
from trims.runtime.worker.sandbox import children_of

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="running code as nobody needs root")

MakeFunction = Callable[..., FunctionSpec]
SECRETS = {
    "TRIMS_GATEWAY_TOKENS": "admin-secret-41:admin",
    "TRIMS_TOKEN": "client-secret-41",
    "AWS_SECRET_ACCESS_KEY": "cloud-secret-41",
}

#: Returns the worker's environment and each of its descriptors: target and open flags.
INVENTORY = """
import os


def handler(request, ctx):
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            with open(f"/proc/self/fdinfo/{fd}") as f:
                flags = int(dict(line.split(":", 1) for line in f)["flags"].strip(), 8)
        except OSError:
            continue  # listdir's own descriptor, closed by now
        fds[fd] = [target, flags]
    return {"pid": os.getpid(), "ppid": os.getppid(), "env": dict(os.environ), "fds": fds}
"""

#: Starts a process that leaves the worker's group and parentage (double fork, setsid), and
#: returns its pid; with the body "hang" the request then never returns.
DAEMON = """
import os
import time


def handler(request, ctx):
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(r)
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.execv("/bin/sleep", ["sleep", "600"])
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    pid = int(os.read(r, 64))
    os.close(r)
    os.waitpid(child, 0)
    if request.body == b"hang":
        with open(os.path.join(ctx.config["marks"], "daemon.pid"), "w") as f:
            f.write(str(pid))
        time.sleep(600)
    return {"pid": pid}
"""


def _environ(pid: int) -> dict[str, str]:
    """``pid``'s exec environment, as /proc shows it (read as root)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def _open_files() -> set[str]:
    """The regular files and pipes this process (the executor's, or the gateway's) holds."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/") and target != "/dev/null":
                found.add(target)
    return found


def _assert_inherits_nothing(got: dict[str, Any], log: Path, parents: set[str]) -> None:
    """The worker's environment holds no secret and only allowed names; its descriptors are
    its log, /dev/null, and the sockets, pipes and event fds it made."""
    for name, value in SECRETS.items():
        assert name not in got["env"]
        assert value not in json.dumps(got["env"])
    set_by_executor = {"TRIMS_SOCKET", "TRIMS_OTLP_ENDPOINT", "OMP_WAIT_POLICY",
                       "ORT_DISABLE_TELEMETRY"}  # fmt: skip
    assert set(got["env"]) - set_by_executor == set(inherited_env(got["env"])) - set_by_executor
    for fd, (target, flags) in got["fds"].items():
        own = target.startswith(("socket:", "pipe:", "anon_inode:"))
        assert own or target in ("/dev/null", str(log)), (fd, target, oct(flags))
        assert target not in parents, (fd, target)


@pytest.fixture
def secrets_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


def test_the_allow_list_holds_no_secret() -> None:
    env = {**SECRETS, "TRIMS_SOCKET": "/s", "OMP_NUM_THREADS": "2", "PATH": "/bin"}
    assert inherited_env(env) == {"TRIMS_SOCKET": "/s", "OMP_NUM_THREADS": "2", "PATH": "/bin"}
    assert not any(e.startswith(("TRIMS_G", "TRIMS_T", "OTEL")) for e in WORKER_ENV_ALLOWED)


async def _started(executor: LocalExecutor, spec: FunctionSpec, iid: str) -> Instance:
    instance = await executor.start(spec, iid)
    await instance.wait_ready(60)
    return instance


async def _invoke(instance: Instance, body: bytes = b"") -> Any:
    reply = await instance.invoke(body, {}, timeout=60, trace={})
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


async def _pool_filled(executor: LocalExecutor) -> None:
    await executor.prepare()
    zygote = executor.zygote_pid
    assert zygote is not None
    deadline = time.monotonic() + 60
    while not children_of(zygote):
        assert time.monotonic() < deadline, "the warm pool never filled"
        await asyncio.sleep(0.01)


MODES: dict[str, dict[str, Any]] = {
    "fork": {"warm_pool": 0},
    "pooled": {"warm_pool": 1},
    "spawn": {"zygote": False},
}


@pytest.mark.parametrize("mode", MODES)
async def test_a_worker_inherits_no_secret_and_no_descriptor(
    secrets_in_environment: None, make_function: MakeFunction,
    local_executor: Callable[..., LocalExecutor], mode: str,
) -> None:  # fmt: skip
    """Regression: workers (and the zygote they fork from) got the executor's whole
    environment, and held root's ONNX Runtime database (opened by the zygote's import)."""
    executor = local_executor(
        run_as="nobody", preload=("numpy", "onnxruntime"), **MODES[mode]
    )  # fmt: skip
    if mode == "pooled":
        await _pool_filled(executor)
    spec = make_function(INVENTORY, name="inventory")
    instance = await _started(executor, spec, "inventory-1")
    got = await _invoke(instance)
    assert got["pid"] == instance.pid
    _assert_inherits_nothing(got, executor.state_dir / "inventory-1.log", _open_files())
    exec_environments = [_environ(got["pid"])]
    if mode != "spawn":
        assert got["ppid"] == executor.zygote_pid
        exec_environments.append(_environ(got["ppid"]))
    for environ in exec_environments:
        assert not set(SECRETS) & set(environ)
        assert environ.get("ORT_DISABLE_TELEMETRY") == "1"


def test_function_code_under_a_gateway_sees_no_secret_and_not_its_log(
    monkeypatch: pytest.MonkeyPatch, make_function: MakeFunction, tmp_path: Path
) -> None:
    """The gateway as a process, its stdout and stderr in its log: function code must not
    read the gateway's environment nor hold its log (GatewayProcess drops TRIMS_* from its
    environment, so a cloud credential stands for the gateway's secrets here)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["AWS_SECRET_ACCESS_KEY"])
    gw = GatewayProcess(tmp_path / "gw", "--preload", "numpy,onnxruntime")
    gw.root.mkdir()
    try:
        gw.start()
        client = GatewayClient(gw.url, None, timeout_s=60)
        spec = make_function(INVENTORY, name="inventory")
        client.json("PUT", "/v1/functions/inventory", spec.to_dict())
        status, _, body = client.request("POST", "/v1/functions/inventory/invoke", b"")
        assert status == 200, body
        got = json.loads(body)
        assert "AWS_SECRET_ACCESS_KEY" not in got["env"]
        assert "AWS_SECRET_ACCESS_KEY" not in _environ(got["pid"])
        assert "AWS_SECRET_ACCESS_KEY" not in _environ(got["ppid"])
        targets = {target for target, _ in got["fds"].values()}
        assert str(gw.log) not in targets
        files = {t for t in targets if t.startswith("/") and t != "/dev/null"}
        assert len(files) == 1 and files.pop().endswith(".log"), targets
    finally:
        gw.kill()


@pytest.fixture
def daemons() -> Iterator[list[int]]:
    """Pids of the processes a test's function started; killed at teardown if they outlived
    what the test expected (on code without the fix they do)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_deleting_a_function_ends_the_processes_its_code_started(
    make_function: MakeFunction, tmp_path: Path, daemons: list[int]
) -> None:
    """Regression: a double-forked setsid child ran on 13 s and more after its function was
    deleted."""
    gw = GatewayProcess(tmp_path / "gw")
    gw.root.mkdir()
    try:
        gw.start()
        client = GatewayClient(gw.url, None, timeout_s=60)
        client.json("PUT", "/v1/functions/daemon", make_function(DAEMON, name="daemon").to_dict())
        status, _, body = client.request("POST", "/v1/functions/daemon/invoke", b"")
        assert status == 200, body
        pid = json.loads(body)["pid"]
        daemons.append(pid)
        assert pid_alive(pid)
        assert client.request("DELETE", "/v1/functions/daemon")[0] == 200
        assert wait_until(lambda: not pid_alive(pid), 20), f"process {pid} outlived its function"
    finally:
        gw.kill()


@pytest.mark.parametrize("ending", ["drained", "killed"])
@pytest.mark.parametrize("mode", ["fork", "spawn"])
async def test_an_instance_ends_the_processes_its_code_started(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor], tmp_path: Path,
    daemons: list[int], mode: str, ending: str,
) -> None:  # fmt: skip
    """Drained: the worker ends its processes on its way out. Killed (a request still hangs
    when the drain timeout ends): the zygote, or a spawned worker's executor, ends them."""
    marks = writable_by_functions(tmp_path / "marks")
    executor = local_executor(run_as="nobody", **MODES[mode])
    spec = make_function(DAEMON, name="daemon", config={"marks": str(marks)})
    instance = await _started(executor, spec, "daemon-1")
    hung = None
    if ending == "drained":
        pid = (await _invoke(instance))["pid"]
    else:
        hung = asyncio.ensure_future(instance.invoke(b"hang", {}, timeout=600, trace={}))
        mark = marks / "daemon.pid"
        deadline = time.monotonic() + 60
        while not (mark.exists() and mark.read_text()):
            assert time.monotonic() < deadline and not hung.done(), "the daemon never started"
            await asyncio.sleep(0.01)
        pid = int(mark.read_text())
    daemons.append(pid)
    assert pid_alive(pid)
    await executor.stop(instance, grace_s=0.5)
    if hung is not None:
        with contextlib.suppress(Exception):
            await hung
    gone = await asyncio.to_thread(wait_until, lambda: not pid_alive(pid), 20)
    assert gone, f"process {pid} outlived its instance ({ending})"
