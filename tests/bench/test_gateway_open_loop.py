"""bench/gateway.py's open loop beside the closed loop: the JSON shape and the rate it offers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"
MEASURES = ("rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_open_loop_is_reported_beside_the_closed_loop(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    proc = _run("--concurrency", "2", "--seconds", "1", "--repeat", "1",
                "--modes", "closed,open", "--open-fraction", "0.5", "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["modes"] == ["closed", "open"] and doc["open_fraction"] == 0.5
    for server in ("echo", "echo_web", "proxy", "bare"):
        for key in MEASURES:
            assert doc[f"{server}_{key}"] is not None, key
            assert doc[f"{server}_open_{key}"] is not None, key
        assert doc[f"{server}_open_send_lag_p99_ms"] >= 0
        # one repeat: the offered rate is exactly the fraction of that run's closed loop
        assert doc[f"{server}_open_offered_rps"] == pytest.approx(0.5 * doc[f"{server}_rps"])
        assert doc[f"{server}_open_rps"] > 0
    assert doc["errors"] == 0 and doc["ratio"] > 0 and doc["proxy_ratio"] > 0
    assert doc["web_ratio"] > 0
    assert "| echo via gateway, --no-fast-path (gateway + worker) | closed, c=2 |" in proc.stdout
    assert "| minimal proxy to the same worker (proxy + worker) | closed, c=2 |" in proc.stdout
    assert "| open |" in proc.stdout and "| closed, c=2 |" in proc.stdout


@pytest.mark.slow
def test_open_loop_alone_at_a_fixed_rate(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    proc = _run("--seconds", "1", "--repeat", "1", "--modes", "open", "--open-rate", "50",
                "--json", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert "echo_rps" not in doc and "ratio" not in doc
    assert doc["echo_open_offered_rps"] == doc["bare_open_offered_rps"] == 50
    assert doc["proxy_open_offered_rps"] == doc["echo_web_open_offered_rps"] == 50
    assert doc["open_rate"] == 50 and doc["open_fraction"] is None
    # 50 req/s for one second, each answered: the schedule was kept (within one request)
    assert doc["echo_open_rps"] >= 49 and doc["bare_open_rps"] >= 49


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--modes", "open"], "--modes open alone needs --open-rate"),
        (["--modes", "closed,sideways"], "unknown: sideways"),
        (["--open-rate", "0"], "give a positive rate"),
    ],
)
def test_bad_load_options_are_refused_with_a_fix(args: list[str], says: str) -> None:
    proc = _run(*args)
    assert proc.returncode == 2
    assert says in proc.stderr and "Traceback" not in proc.stderr
