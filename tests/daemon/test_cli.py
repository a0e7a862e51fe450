"""`trims daemon` settings (argv over environment over defaults) and the socket lifecycle."""

from __future__ import annotations

import argparse
import grp
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.daemon.cli import build_settings, configure, parse_eviction
from trims.errors import Unavailable, ValidationError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(list(argv))


def test_help_says_what_each_cpu_backing_guarantees() -> None:
    """Finding 11 of issue 41: a root daemon's default backing (file) lets root change a model
    under descriptors already handed out; ``trims daemon --help`` says which backing holds."""
    parser = argparse.ArgumentParser()
    configure(parser)
    text = " ".join(parser.format_help().split())
    assert "memfd: a sealed copy; no process, root included, can change a model" in text
    assert "root (and the daemon's uid) can still write it under descriptors already" in text
    assert "auto: file for a root daemon where shmem huge pages are off, memfd otherwise" in text


def test_argv_wins_over_environment_and_defaults_fill_the_rest(tmp_path: Path) -> None:
    env = {"TRIMS_STORE_DIR": str(tmp_path / "env"), "TRIMS_CPU_BUDGET": "2GiB",
           "TRIMS_SOCKET": "/run/x.sock", "TRIMS_EVICTION": "fifo"}  # fmt: skip
    settings, policies, level = build_settings(
        _args("--cpu-budget", "1MiB", "--eviction", "lfu,gpu=never", "--socket-mode", "640"), env
    )
    assert settings.store_dir == tmp_path / "env"
    assert settings.socket_path == Path("/run/x.sock")
    assert settings.admin_socket_path == Path("/run/x.admin.sock")
    assert settings.budgets.cpu == 1 << 20 and settings.budgets.gpu == 0
    assert settings.eviction == "lfu" and policies == {"gpu": "never"}
    assert settings.socket_mode == 0o640 and level == "INFO"


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [("lru", ("lru", {})), ("cpu=lfu, disk=never", ("lru", {"cpu": "lfu", "disk": "never"}))],
)
def test_parse_eviction(spec: str, parsed: tuple[str, dict[str, str]]) -> None:
    assert parse_eviction(spec) == parsed


@pytest.mark.parametrize("spec", ["random", "tape=lru", "cpu=sometimes"])
def test_bad_eviction_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValidationError, match="eviction"):
        parse_eviction(spec)


def test_socket_mode_group_a_second_daemon_and_clean_shutdown(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    daemon = start_daemon(socket_mode="640", socket_group=group)
    st = daemon.socket.stat()
    assert st.st_mode & 0o777 == 0o640 and st.st_gid == os.getgid()
    assert daemon.admin_socket.stat().st_mode & 0o777 == 0o600
    twin = DaemonProcess(daemon.root, {})
    with pytest.raises(Unavailable, match="another daemon is serving"):
        twin.start()
    with RawClient(daemon.socket) as client:
        assert client.result("hello")["protocol"] == 1
        assert daemon.stop() == 0  # SIGTERM, with this client still connected
        with pytest.raises(ConnectionError):
            client.result("hello")
    assert not daemon.socket.exists() and not daemon.admin_socket.exists()
    with socket.socket(socket.AF_UNIX) as s, pytest.raises(FileNotFoundError):
        s.connect(str(daemon.socket))
