"""Helpers shared by the benchmark scripts: processes they start, and how results are written."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
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
    cmd = [sys.executable, "-m", "trims", "gateway", "--port", "0", *args]
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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


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
