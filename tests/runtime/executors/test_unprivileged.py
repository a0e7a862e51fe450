"""Function code never runs as root: the local executor's default user, refusals, code access.

These tests run as root (CI does) and skip otherwise: only root can run code as another user.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pwd
import socket
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trims.errors import TrimsError, UpstreamError, ValidationError
from trims.runtime import gateway_cli
from trims.runtime.executors import create_executor
from trims.runtime.executors.docker import DockerExecutor
from trims.runtime.executors.local import LocalExecutor
from trims.runtime.functions.spec import FunctionSpec, parse_spec
from trims.runtime.worker.imports import WORKER_MODULES
from trims.runtime.worker.sandbox import default_user, verify_unprivileged

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="running code as another user needs root")

MakeFunction = Callable[..., FunctionSpec]

WHOAMI = """
import os
import socket


def _refused(action):
    try:
        action()
    except OSError as e:
        return type(e).__name__
    return "allowed"


def _connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    finally:
        s.close()


def handler(request, ctx):
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {
        "uids": os.getresuid(),
        "gids": os.getresgid(),
        "groups": os.getgroups(),
        "shadow": _refused(lambda: open("/etc/shadow").close()),
        "admin": _refused(lambda: _connect(ctx.config["admin"])),
        "setuid": _refused(lambda: os.setuid(0)),
        "cap_eff": int(status["CapEff"].strip(), 16),
        "cap_prm": int(status["CapPrm"].strip(), 16),
        "no_new_privs": int(status["NoNewPrivs"].strip()),
        "sum": float(ctx.models["vec"].numpy()["w"].sum()),
        "via": ctx.models["vec"].via,
    }
"""


def _gateway_local_executor(*argv: str) -> Any:
    """The local executor exactly as ``trims gateway ARGV`` makes it (its CLI options)."""
    parser = argparse.ArgumentParser()
    gateway_cli.configure(parser)
    args = parser.parse_args(list(argv))
    return create_executor(
        "local", store_socket=args.store_socket, **gateway_cli.local_options(args)
    )


async def _invoke_json(instance: Any) -> Any:
    reply = await instance.invoke(b"", {}, timeout=30, trace={})
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "spawn"])
async def test_a_root_gateway_without_run_as_runs_function_code_unprivileged(
    start_daemon: Callable[..., Any], make_function: MakeFunction, zygote: bool
) -> None:
    """Regression: a root gateway with no --run-as ran function code as uid 0, which could
    open the store's admin socket and read /etc/shadow."""
    daemon = start_daemon(models={"vec": {"w": np.ones(8, dtype=np.float32)}})
    spec = make_function(
        WHOAMI,
        name="whoami",
        models=[{"name": "vec"}],
        config={"admin": str(daemon.admin_socket)},
    )
    argv = ["--store-socket", str(daemon.socket), "--preload", "numpy"]
    executor = _gateway_local_executor(*argv, *([] if zygote else ["--no-zygote"]))
    try:
        executor.check(spec)
        instance = await executor.start(spec, "whoami-1")
        await instance.wait_ready(60)
        got = await _invoke_json(instance)
    finally:
        await executor.close()
    user = pwd.getpwnam(default_user())
    assert executor.run_as == default_user()
    assert got["uids"] == [user.pw_uid] * 3 and user.pw_uid != 0
    assert got["gids"] == [user.pw_gid] * 3 and user.pw_gid != 0
    assert got["groups"] == []
    assert got["shadow"] == "PermissionError"
    assert got["admin"] == "PermissionError"
    assert got["setuid"] == "PermissionError"
    assert (got["cap_eff"], got["cap_prm"], got["no_new_privs"]) == (0, 0, 1)
    assert (got["sum"], got["via"]) == (8.0, "store")


def test_a_root_executor_runs_code_as_the_default_user(tmp_path: Path) -> None:
    assert LocalExecutor(state_dir=tmp_path / "a").run_as == default_user() != "root"
    assert LocalExecutor(state_dir=tmp_path / "b", run_as="nobody").run_as == "nobody"


@pytest.mark.parametrize("user", ["root", "0"])
def test_run_as_root_is_refused(user: str) -> None:
    with pytest.raises(ValidationError, match="function code never runs as root"):
        _gateway_local_executor("--run-as", user)
    with pytest.raises(ValidationError, match="function code never runs as root"):
        LocalExecutor(run_as=user)


def _nobody_label() -> str:
    return f"nobody (uid {pwd.getpwnam('nobody').pw_uid})"


def test_an_unreadable_code_dir_is_refused_at_deploy_with_the_fix(
    make_function: MakeFunction, tmp_path: Path
) -> None:
    executor = LocalExecutor(run_as="nobody", state_dir=tmp_path / "state")
    spec = make_function("def handler(request, ctx):\n    return 'hi'\n")
    executor.check(spec)
    assert spec.code_dir is not None
    code = Path(spec.code_dir)
    code.chmod(0o700)
    with pytest.raises(ValidationError) as e:
        executor.check(spec)
    assert e.value.message == (
        f"code_dir {code} is not readable by user {_nobody_label()} that function code runs "
        "as; make it readable (chmod o+rx) or choose --run-as"
    )


def test_every_ancestor_of_the_code_dir_needs_the_search_bit(tmp_path: Path) -> None:
    private = tmp_path / "private"
    code = private / "fn"
    code.mkdir(parents=True)
    (code / "handler.py").write_text("def handler(request, ctx):\n    return 'hi'\n")
    private.chmod(0o700)
    spec = parse_spec({"name": "fn", "handler": "handler:handler", "code_dir": str(code)})
    with pytest.raises(ValidationError, match=rf"\({private} is not searchable by that user\)"):
        LocalExecutor(run_as="nobody", state_dir=tmp_path / "state").check(spec)


def test_an_unreadable_handler_module_is_refused(tmp_path: Path) -> None:
    code = tmp_path / "fn"
    (code / "pkg").mkdir(parents=True)
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "mod.py").write_text("def handler(request, ctx):\n    return 'hi'\n")
    (code / "pkg" / "mod.py").chmod(0o600)
    spec = parse_spec({"name": "fn", "handler": "pkg.mod:handler", "code_dir": str(code)})
    with pytest.raises(ValidationError) as e:
        LocalExecutor(run_as="nobody", state_dir=tmp_path / "state").check(spec)
    assert e.value.message == (
        f"handler module file {code / 'pkg' / 'mod.py'} is not readable by user "
        f"{_nobody_label()} that function code runs as; make it readable (chmod o+r) or "
        "choose --run-as"
    )
    assert e.value.details == {"field": "code_dir"}


async def test_code_made_unreadable_after_deploy_fails_the_start_with_the_message(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor]
) -> None:
    spec = make_function("def handler(request, ctx):\n    return 'hi'\n")
    executor = local_executor(run_as="nobody")
    executor.check(spec)
    assert spec.code_dir is not None
    Path(spec.code_dir).chmod(0o700)
    instance = await executor.start(spec, "late-1")
    with pytest.raises(UpstreamError, match="is not readable by user nobody") as e:
        await instance.wait_ready(60)
    assert f"code_dir {spec.code_dir}" in e.value.message


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "spawn"])
async def test_the_worker_reads_no_project_file_after_the_drop(
    make_function: MakeFunction, local_executor: Callable[..., LocalExecutor], zygote: bool
) -> None:
    """Every module the worker needs is in sys.modules before the drop (zygote: preloaded;
    spawn: imported by run_worker), so a worker works where its user cannot read the project
    or the interpreter (a checkout or pyenv under /root, mode 0700)."""
    importable = []
    for name in WORKER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        importable.append(name)
    spec = make_function(
        textwrap.dedent(
            """
            import os
            import sys

            NEEDED = {needed!r}
            LOADED = [m for m in NEEDED if m in sys.modules]

            def handler(request, ctx):
                import numpy
                import trims.runtime.adapters.numpy
                import trims.runtime.models

                return {{"loaded": LOADED, "uid": os.getuid(),
                         "numpy": int(numpy.arange(4).sum())}}
            """
        ).format(needed=importable)
    )
    executor = local_executor(run_as="nobody", zygote=zygote)
    instance = await executor.start(spec, "imports-1")
    await instance.wait_ready(60)
    got = await _invoke_json(instance)
    assert got["uid"] == pwd.getpwnam("nobody").pw_uid
    assert got["loaded"] == importable
    assert got["numpy"] == 6


def test_docker_checks_the_mounted_code_dir_as_the_container_user(tmp_path: Path) -> None:
    """The code dir is bind-mounted: its host ancestors do not matter, the directory does."""
    private = tmp_path / "private"
    code = private / "fn"
    code.mkdir(parents=True)
    (code / "handler.py").write_text("def handler(request, ctx):\n    return 'hi'\n")
    private.chmod(0o700)
    spec = parse_spec({"name": "fn", "handler": "handler:handler", "code_dir": str(code)})
    executor = DockerExecutor(user="10001:10001", store_socket=tmp_path / "no-store.sock")
    executor.check(spec)
    code.chmod(0o700)
    with pytest.raises(
        ValidationError, match=rf"code_dir {code} is not readable by user uid 10001"
    ):
        executor.check(spec)


def test_a_worker_that_is_still_privileged_refuses_to_run_function_code(tmp_path: Path) -> None:
    """What the worker checks after its drop, run here as root: every check must trip."""
    admin = tmp_path / "store.admin.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(admin))
        listener.listen(1)
        with pytest.raises(TrimsError) as e:
            verify_unprivileged(admin)
    message = e.value.message
    for problem in ("still uid/gid 0", "setuid(0) succeeded", "holds capabilities",
                    f"can connect to the store's admin socket {admin}"):  # fmt: skip
        assert problem in message
    assert "function code is not run" in message
