"""Start a child process, wait for its ready line in its log, stop it: the store daemon's way.

``trims daemon`` prints ``trims daemon ready socket=PATH [metrics=URL]`` on stderr once both
sockets listen; ``trims gateway`` prints ``trims gateway ready url=URL``. :func:`launch` starts
any such command with its stdout and stderr appended to a log file and reads the log (from where
it ended before the start) until the ready pattern matches, the child exits, or the deadline
passes; the failure says which, with the log's last lines. :func:`start_daemon` does that for
``python -m trims daemon``; :func:`stop` ends a child with SIGTERM, then SIGKILL after a grace.

This lives on the ground floor because it only runs a subprocess and reads a file: ``trims up``
(runtime), the benchmarks and the tests all start daemons with it, and runtime may not import
the daemon package.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trims.errors import Unavailable

__all__ = [
    "DAEMON_READY",
    "Started",
    "daemon_command",
    "launch",
    "start_daemon",
    "stop",
    "without_trims_env",
]

#: the daemon's ready line (daemon/cli.py prints it); groups ``socket`` and ``metrics``
DAEMON_READY = re.compile(
    r"^trims daemon ready socket=(?P<socket>\S+)(?: metrics=(?P<metrics>\S+))?", re.MULTILINE
)
#: characters of the log a failure shows
LOG_TAIL_CHARS = 3000
#: how often the log is read while waiting (seconds)
POLL_S = 0.02


@dataclass(frozen=True)
class Started:
    """A child that printed its ready line: the process, the match, and where it logs."""

    proc: subprocess.Popen[bytes]
    match: re.Match[str]
    log: Path
    #: seconds :meth:`stop` waits after SIGTERM before SIGKILL
    stop_grace_s: float = 10.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def metrics_url(self) -> str | None:
        """A daemon's ``metrics=`` URL, when it serves metrics."""
        return self.match.groupdict().get("metrics")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after :attr:`stop_grace_s`; the exit status."""
        return _stop(self.proc, self.stop_grace_s)


def without_trims_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: ours) without ``TRIMS_*``, so only the command line configures
    the child."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if not k.startswith("TRIMS_")}


def _tail(text: str) -> str:
    return text[-LOG_TAIL_CHARS:] if text.strip() else "(the log is empty)"


def launch(
    cmd: Sequence[str],
    log: Path,
    ready: re.Pattern[str] | str,
    *,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
    stop_grace_s: float = 10.0,
) -> Started:
    """Start ``cmd`` logging to ``log`` (appended) and wait until ``ready`` matches a part of
    the log written since (a string is compiled with ``re.MULTILINE``: ``^`` starts a line).

    Raises :class:`Unavailable` with the log's tail when the child exits first or
    ``timeout_s`` passes (it is stopped then). ``stop_grace_s``: how long a stop waits after
    SIGTERM before SIGKILL."""
    what = name or " ".join(cmd[:4])
    pattern = re.compile(ready, re.MULTILINE) if isinstance(ready, str) else ready
    log.parent.mkdir(parents=True, exist_ok=True)
    offset = log.stat().st_size if log.exists() else 0
    # Owner-only from its first byte: a log names models, sources and clients, and a reader
    # who opened it while it was looser would keep reading after a chmod.
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    with open(os.open(log, flags, 0o600), "ab") as f:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=f,
            env=None if env is None else dict(env),
        )
    deadline = time.monotonic() + timeout_s
    while True:
        text = _read_from(log, offset)
        m = pattern.search(text)
        if m:
            return Started(proc, m, log, stop_grace_s)
        if proc.poll() is not None:
            text = _read_from(log, offset)
            raise Unavailable(
                f"{what} exited with status {proc.returncode} before it was ready; "
                f"the end of {log}:\n{_tail(text)}"
            )
        if time.monotonic() >= deadline:
            stop(proc, stop_grace_s)
            raise Unavailable(
                f"{what} did not print its ready line in {timeout_s:g} s and was stopped; "
                f"the end of {log}:\n{_tail(text)}"
            )
        time.sleep(POLL_S)


def _read_from(log: Path, offset: int) -> str:
    with open(log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def stop(proc: subprocess.Popen[bytes] | None, grace_s: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after ``grace_s``; the exit status (None for no process)."""
    return None if proc is None else _stop(proc, grace_s)


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def daemon_command(
    socket: Path,
    *,
    store_dir: Path | None = None,
    options: Mapping[str, object] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """``python -m trims daemon --socket SOCKET [--store-dir DIR]`` plus one ``--key value``
    per option (``cpu_budget="8GiB"`` -> ``--cpu-budget 8GiB``)."""
    cmd = [python, "-m", "trims", "daemon", "--socket", str(socket)]
    if store_dir is not None:
        cmd += ["--store-dir", str(store_dir)]
    for key, value in (options or {}).items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def start_daemon(
    socket: Path,
    *,
    store_dir: Path | None = None,
    log: Path | None = None,
    options: Mapping[str, object] | None = None,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    stop_grace_s: float = 10.0,
) -> Started:
    """A ``trims daemon`` on ``socket`` that said it is ready; its log defaults to
    ``daemon.log`` beside the socket, whose folder is made if missing."""
    socket.parent.mkdir(parents=True, exist_ok=True)
    return launch(
        daemon_command(socket, store_dir=store_dir, options=options),
        log or socket.with_name("daemon.log"),
        DAEMON_READY,
        timeout_s=timeout_s,
        env=env,
        name="the store daemon",
        stop_grace_s=stop_grace_s,
    )
