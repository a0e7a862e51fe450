"""No Python traceback reaches a CLI user: every subcommand's error paths, run as a user would.

The subcommands are enumerated from the argparse tree (:func:`trims.cli.build_parser`), so a
new command or action is covered without editing this file. Each runs as a real subprocess
with the daemon and the gateway pointed at places where nothing listens.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from trims.cli import COMMANDS, EXIT_BROKEN_PIPE, build_parser

#: Commands that serve until stopped when their arguments are valid: only their parse errors
#: and the error paths tested by name below are run.
SERVERS = {("daemon",), ("up",), ("gateway",), ("worker",), ("operator", "run")}
#: Commands that talk to the daemon or the gateway (run without arguments too: unreachable).
CLIENTS = {"models", "functions", "pipelines"}


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path
    for action in subs:
        for name, sub in action.choices.items():
            yield from _leaves(sub, (*path, name))


def _leaf_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser(path[0])
    for name in path[1:]:
        [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = action.choices[name]
    return parser


def _positionals(path: tuple[str, ...]) -> list[argparse.Action]:
    return [a for a in _leaf_parser(path)._actions if not a.option_strings]


LEAVES = [leaf for name in COMMANDS for leaf in _leaves(build_parser(name), (name,))]
WITH_POSITIONALS = [leaf for leaf in LEAVES if _positionals(leaf) and leaf not in SERVERS]
CLIENT_LEAVES = [leaf for leaf in LEAVES if leaf[0] in CLIENTS and not _positionals(leaf)]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Nothing listens at the daemon socket or the gateway URL; state stays in ``tmp_path``."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
    return {
        **base,
        "TRIMS_SOCKET": str(tmp_path / "no-daemon" / "store.sock"),
        "TRIMS_GATEWAY_URL": f"http://127.0.0.1:{port}",
        "TRIMS_RESULTS_DB": str(tmp_path / "results.sqlite"),
        "XDG_STATE_HOME": str(tmp_path / "state"),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "HOME": str(tmp_path / "home"),
    }


def trims(
    *args: str, env: dict[str, str], cwd: Path, stdout: int | None = subprocess.PIPE
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trims", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def assert_no_traceback(done: subprocess.CompletedProcess[str]) -> None:
    output = f"{done.stdout or ''}{done.stderr}"
    assert "Traceback" not in output, f"trims {' '.join(map(str, done.args[3:]))}:\n{output}"


def _id(leaf: tuple[str, ...]) -> str:
    return "-".join(leaf)


@pytest.mark.parametrize("leaf", LEAVES, ids=_id)
def test_an_unknown_flag_is_a_usage_error(
    leaf: tuple[str, ...], env: dict[str, str], tmp_path: Path
) -> None:
    done = trims(*leaf, "--no-such-flag", env=env, cwd=tmp_path)
    assert_no_traceback(done)
    assert done.returncode == 2
    assert f"usage: trims {leaf[0]}" in done.stderr and "error:" in done.stderr


@pytest.mark.parametrize("leaf", WITH_POSITIONALS, ids=_id)
def test_missing_files_are_one_line_errors(
    leaf: tuple[str, ...], env: dict[str, str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing" / "file.yaml")
    done = trims(*leaf, *[missing] * len(_positionals(leaf)), env=env, cwd=tmp_path)
    assert_no_traceback(done)
    assert done.returncode != 0
    assert done.stderr.strip(), "failed without saying why"


@pytest.mark.parametrize("leaf", WITH_POSITIONALS, ids=_id)
def test_invalid_json_files_are_one_line_errors(
    leaf: tuple[str, ...], env: dict[str, str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "steps": [')
    done = trims(*leaf, *[str(bad)] * len(_positionals(leaf)), env=env, cwd=tmp_path)
    assert_no_traceback(done)
    assert done.returncode != 0
    assert done.stderr.strip(), "failed without saying why"


@pytest.mark.parametrize("leaf", CLIENT_LEAVES, ids=_id)
def test_an_unreachable_daemon_or_gateway_is_a_one_line_error(
    leaf: tuple[str, ...], env: dict[str, str], tmp_path: Path
) -> None:
    done = trims(*leaf, env=env, cwd=tmp_path)
    assert_no_traceback(done)
    assert done.returncode == 1
    assert "not reachable" in done.stderr or "cannot reach" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_invoke_with_a_missing_data_file(env: dict[str, str], tmp_path: Path) -> None:
    for command in ("functions", "pipelines"):
        done = trims(command, "invoke", "echo", "--data", "@/nonexistent", env=env, cwd=tmp_path)
        assert_no_traceback(done)
        assert done.returncode == 1
        assert "--data @/nonexistent: cannot read /nonexistent" in done.stderr


def test_a_gateway_url_that_is_not_a_url(env: dict[str, str], tmp_path: Path) -> None:
    for args in (("functions", "--url", "notaurl", "ls"), ("pipelines", "ls", "--url", "x:y")):
        done = trims(*args, env=env, cwd=tmp_path)
        assert_no_traceback(done)
        assert done.returncode == 1
        assert "is not an http(s) URL; pass --url" in done.stderr


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_a_port_in_use_is_refused_before_anything_starts(
    command: str, env: dict[str, str], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = trims(command, "--port", str(port), env=env, cwd=tmp_path)
    assert_no_traceback(done)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in done.stderr
    # Refused before the daemon (trims up) or the zygote started: nothing was created for them.
    assert not (tmp_path / "no-daemon").exists()
    assert "zygote" not in done.stderr and "daemon started" not in done.stderr


def test_a_closed_stdout_ends_quietly(env: dict[str, str], tmp_path: Path) -> None:
    """`trims operator crd | head -0`: the reader is gone before trims writes a byte."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = trims("operator", "crd", env=env, cwd=tmp_path, stdout=write)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == EXIT_BROKEN_PIPE
    assert done.stderr == ""
