"""Helpers shared by the benchmark scripts: processes they start, and how results are written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class Process:
    """A child process whose log is scanned for a ready line; stopped with SIGTERM."""

    def __init__(self, cmd: Sequence[str], log: Path, ready: str, timeout_s: float = 120.0) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMS_")}
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(
                list(cmd), stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env
            )
        deadline = time.monotonic() + timeout_s
        pattern = re.compile(ready)
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            m = pattern.search(text)
            if m:
                self.match = m
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[:4]} exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{cmd[:4]} did not get ready in {timeout_s}s; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_daemon(root: Path, cpu_budget: str = "8GiB") -> tuple[Process, Path]:
    socket_path = root / "run" / "store.sock"
    socket_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "trims", "daemon", "--store-dir", str(root / "store"),
        "--socket", str(socket_path), "--cpu-budget", cpu_budget,
    ]  # fmt: skip
    return Process(cmd, root / "daemon.log", r"trims daemon ready"), socket_path


def start_gateway(root: Path, *args: str) -> tuple[Process, str]:
    cmd = [sys.executable, "-m", "trims", "gateway", "--port", "0", "--no-auth", *args]
    proc = Process(cmd, root / "gateway.log", r"trims gateway ready url=(\S+)")
    return proc, proc.match.group(1)


def summary(samples: Sequence[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
    }


def write_json(path: Path | None, doc: dict[str, Any]) -> None:
    text = json.dumps(doc, indent=2)
    if path is None:
        print(text)
        return
    from trims.config import write_atomic

    write_atomic(path, text + "\n")


def write_report(path: Path | None, doc: dict[str, Any], text: str) -> None:
    """The JSON at ``path`` and its markdown ``text`` beside it (``.md``), each written
    atomically, then ``text`` on stdout; without ``path`` the JSON goes to stdout too."""
    write_json(path, doc)
    if path is not None:
        from trims.config import write_atomic

        write_atomic(path.with_suffix(".md"), text)
    print(text)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def machine() -> str:
    cpus = os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return f"{cpus} CPUs, load average {load:.1f} at start"


#: Executors the benchmarks' in-process gateway offers (spec "executor" field -> options).
EXECUTORS = {
    "local": {"zygote": True, "store": True},
    "spawn-store": {"zygote": False, "store": True},
    "spawn-direct": {"zygote": False, "store": False},
    "zygote-direct": {"zygote": True, "store": False},
}


@contextlib.asynccontextmanager
async def local_gateway(root: Path, store_socket: Path) -> AsyncIterator[str]:
    """A gateway in this process (its URL) whose functions pick one of ``EXECUTORS``.

    "-direct" executors point workers at a socket where no daemon listens, so their models
    load from the spec's ``source`` file in each instance.
    """
    from aiohttp import web

    from trims.runtime.executors import create_executor
    from trims.runtime.gateway.app import create_app
    from trims.runtime.settings import GatewaySettings

    def make(name: str) -> object:
        opts = EXECUTORS[name]
        socket_path = store_socket if opts["store"] else root / "no-store.sock"
        return create_executor(
            "local", zygote=opts["zygote"], store_socket=socket_path,
            state_dir=root / "instances" / name,
        )  # fmt: skip

    settings = GatewaySettings(port=0, store_socket=store_socket, drain_timeout_s=5, auth=False)
    runner = web.AppRunner(create_app(settings, make), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def write_model(path: Path, megabytes: int, seed: float = 0.0, tensor_mb: int = 50) -> None:
    """A safetensors file of ``megabytes`` MiB of float32 tensors (at most ``tensor_mb`` each)."""
    import numpy as np
    from safetensors.numpy import save_file

    tensors = {}
    left = megabytes << 20
    i = 0
    while left > 0:
        n = min(left, tensor_mb << 20) // 4
        tensors[f"layer{i:03d}.weight"] = np.full(n, seed + i, dtype=np.float32)
        left -= n * 4
        i += 1
    save_file(tensors, str(path))
    path.chmod(0o644)  # safetensors writes 0600; workers (nobody) load sources themselves


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pss_bytes(pid: int) -> int:
    """Proportional set size of a process (shared pages divided among their mappers)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def tree_pids(root: int) -> list[int]:
    """``root`` and all its live descendants."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents.setdefault(int(_stat_fields(int(entry))[1]), []).append(int(entry))
            except (OSError, IndexError):
                continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(parents.get(pid, []))
    return out


def cpu_seconds(pids: Sequence[int]) -> dict[int, float]:
    """User + system CPU seconds used so far by each process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out
