"""bench/coldstart.py --handler full: every request reads all the weights, and each cold row
splits instance start from the first request (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_full_handler_splits_start_and_first_request(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "coldstart.py"), "--handler", "full", "--model-mb", "2",
         "--runs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["handler"] == "full"
    for r in doc["results"]:
        if r["mode"] == "warm":
            assert r["start_median_s"] is None and r["request_median_s"] is None
        else:
            assert 0 < r["start_median_s"] < r["median_s"]
            assert r["request_median_s"] > 0
    assert "first request ms" in proc.stdout
