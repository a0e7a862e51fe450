"""Starting a child and waiting for its ready line: a real `trims daemon`, and children that
exit, hang or ignore SIGTERM."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import psutil
import pytest

from trims import daemon_process
from trims.errors import Unavailable


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_real_daemon_starts_answers_and_stops(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "store.sock"
    daemon = daemon_process.start_daemon(
        sock,
        store_dir=tmp_path / "store",
        options={"cpu_budget": "64MiB", "metrics_address": "127.0.0.1:0"},
        env=daemon_process.without_trims_env(),
    )
    try:
        assert daemon.log == tmp_path / "run" / "daemon.log"
        assert daemon.match.group("socket") == str(sock)
        assert daemon.metrics_url is not None and daemon.metrics_url.startswith("http://127.0.0.1:")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(sock))
    finally:
        assert daemon.stop() == 0
    assert not sock.exists()


def test_daemon_command_turns_options_into_flags(tmp_path: Path) -> None:
    cmd = daemon_process.daemon_command(
        tmp_path / "s.sock", store_dir=tmp_path / "st", options={"cpu_budget": "1GiB"}
    )
    assert cmd[1:] == ["-m", "trims", "daemon", "--socket", str(tmp_path / "s.sock"),
                       "--store-dir", str(tmp_path / "st"), "--cpu-budget", "1GiB"]  # fmt: skip


def test_a_child_that_exits_first_is_reported_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    # a ready line from an earlier run in the same log does not count
    log.write_text("trims daemon ready socket=/old\n")
    code = "import sys; print('bad flag --nope', file=sys.stderr); sys.exit(3)"
    with pytest.raises(Unavailable) as err:
        daemon_process.launch(_python(code), log, daemon_process.DAEMON_READY, name="the child")
    message = str(err.value)
    assert "the child exited with status 3 before it was ready" in message
    assert "bad flag --nope" in message and "/old" not in message


def test_a_child_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    marker = f"never-ready-{tmp_path.name}"
    code = f"import time\nmarker = {marker!r}\nwhile True: time.sleep(1)"
    log = tmp_path / "c.log"
    with pytest.raises(Unavailable, match=r"did not print its ready line in 0.3 s and was stopped"):
        daemon_process.launch(_python(code), log, "never", timeout_s=0.3)
    alive = [c for c in psutil.Process().children() if marker in " ".join(c.cmdline())]
    assert alive == []


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "while True: time.sleep(1)"
    )
    child = daemon_process.launch(_python(code), tmp_path / "c.log", "^up$", stop_grace_s=0.2)
    assert child.stop() == -signal.SIGKILL
    assert daemon_process.stop(None) is None


def test_without_trims_env_drops_only_trims_variables() -> None:
    env = {"TRIMS_SOCKET": "/x", "PATH": "/bin", "MY_TRIMS": "1"}
    assert daemon_process.without_trims_env(env) == {"PATH": "/bin", "MY_TRIMS": "1"}
