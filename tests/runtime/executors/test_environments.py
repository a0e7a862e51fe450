"""Functions in another Python environment: one zygote per environment, checked at deploy.

The second environment is a real virtualenv made for the test with the system's site packages
(so this trims imports there) and its own interpreter; a worker reports ``sys.prefix`` to show
where it ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from trims.errors import ValidationError
from trims.runtime.executors.base import refuse_environment
from trims.runtime.executors.local import LocalExecutor
from trims.runtime.functions.spec import FunctionSpec, parse_spec
from trims.runtime.gateway_cli import parse_environments

MakeFunction = Callable[..., FunctionSpec]

WHERE = """
import json, os, sys

def handler(request, ctx):
    return json.dumps({"prefix": sys.prefix, "executable": sys.executable, "pid": os.getpid()})
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv whose python sees the system's packages (trims among them)."""
    root = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(root)],
        check=True,
    )
    # The functions run as another user under a root test run: let it traverse to the venv.
    for parent in (root, *root.parents):
        if parent == Path("/"):
            break
        parent.chmod(parent.stat().st_mode | 0o011)
    return root


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "spawn"])
async def test_a_function_runs_in_the_environment_it_names(
    local_executor: Callable[..., LocalExecutor], make_function: MakeFunction, venv: Path,
    zygote: bool,
) -> None:  # fmt: skip
    python = str(venv / "bin" / "python")
    executor = local_executor(zygote=zygote, environments={"alt": python})
    there = make_function(WHERE, name="there", environment="alt")
    here = make_function(WHERE, name="here")
    executor.check(there)
    answers = {}
    for spec in (there, here):
        instance = await executor.start(spec, f"{spec.name}-1")
        await instance.wait_ready(60)
        reply = await instance.invoke(b"", {}, timeout=30, trace={})
        answers[spec.name] = json.loads(reply.body)
    assert Path(answers["there"]["prefix"]) == venv
    assert Path(answers["here"]["prefix"]) == Path(sys.prefix)
    if zygote:
        # One zygote per environment: the default one plus the venv's.
        assert executor.zygote_pid is not None
        assert len({answers["there"]["pid"], answers["here"]["pid"]}) == 2


async def test_an_undeclared_environment_is_refused_at_deploy(
    local_executor: Callable[..., LocalExecutor], make_function: MakeFunction
) -> None:
    executor = local_executor(environments={"alt": sys.executable})
    spec = make_function(WHERE, environment="mxnet")
    with pytest.raises(ValidationError, match=r"'mxnet' is not declared.*declared: alt") as info:
        executor.check(spec)
    assert info.value.details["field"] == "environment"
    assert "--environment mxnet=" in info.value.message


def test_container_executors_refuse_a_host_environment() -> None:
    spec = parse_spec({"name": "f", "image": "x", "handler": "h:f", "environment": "mxnet"})
    with pytest.raises(ValidationError, match="docker executor's containers") as info:
        refuse_environment(spec, "docker")
    assert info.value.details["field"] == "environment"
    refuse_environment(parse_spec({"name": "f", "image": "x"}), "docker")


def test_the_spec_names_an_environment_by_its_rule() -> None:
    spec = parse_spec({"name": "f", "handler": "h:f", "environment": "mxnet"})
    assert spec.environment == "mxnet"
    assert parse_spec(spec.to_dict()) == spec
    with pytest.raises(ValidationError, match="environment"):
        parse_spec({"name": "f", "handler": "h:f", "environment": "/usr/bin/python"})


def test_environment_flags_are_checked_at_start(tmp_path: Path, venv: Path) -> None:
    python = str(venv / "bin" / "python")
    assert parse_environments([f"alt={python}"]) == {"alt": python}
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'No module named trims' >&2\nexit 1\n")
    broken.chmod(0o755)
    cases = {
        "alt": "write NAME=PYTHON",
        "alt=bin/python": "not an absolute path",
        f"alt={tmp_path / 'missing'}": "not an absolute path to an executable",
        f"Bad={python}": "environment",
        f"alt={broken}": "cannot import trims .No module named trims.",
    }
    for item, message in cases.items():
        with pytest.raises(ValidationError, match=message):
            parse_environments([item])
    with pytest.raises(ValidationError, match="given twice"):
        parse_environments([f"alt={python}", f"alt={python}"])


def test_the_gateway_command_names_a_bad_environment_without_a_traceback(
    tmp_path: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "trims", "gateway", "--port", "0", "--state-dir",
         str(tmp_path), "--environment", "mxnet=relative/python"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "--environment mxnet" in done.stderr and "absolute path" in done.stderr
