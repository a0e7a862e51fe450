"""bench/peers.py runs end to end at toy sizes and writes the JSON, tables and figure issue 42
names.

The trims side always runs (a tiny model: 16 layers of 64 x 64); a peer only where its venv is
(``python bench/peers.py --setup``). No timing is asserted: performance lives in bench/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers import order, peer  # noqa: E402
from peers_report import render_markdown  # noqa: E402

COLD_KEYS = {"system", "case", "cache", "first_response_ms", "warm_ms", "overhead_ms",
             "min_ms", "max_ms", "runs"}  # fmt: skip
MEMORY_KEYS = {"system", "replicas", "pss_mib", "model_mib"}
THROUGHPUT_KEYS = {"system", "concurrency", "rps", "p50_ms", "p99_ms", "mode", "rate"}


def _peers(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    out, md = tmp_path / "peers.json", tmp_path / "peers.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "peers.py"), "--quick", "--runs", "1", "--width", "64",
         "--model-mb", "1", "--keep-page-cache", "--seconds", "0.5", "--json", str(out),
         "--markdown", str(md), "--figure", str(tmp_path / "peers.png"), *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), md.read_text()


def _check_shape(doc: dict[str, Any], systems: set[str]) -> None:
    assert doc["quick"] is True
    cold = doc["cold_start"]
    assert {r["system"] for r in cold} == systems
    for r in cold:
        assert set(r) >= COLD_KEYS
        assert r["min_ms"] <= r["first_response_ms"] <= r["max_ms"] and r["runs"] == 1
    trims_cases = {(r["case"], r["tier"]) for r in cold if r["system"] == "trims"}
    assert trims_cases == {
        ("scale_from_zero", "cpu"), ("standby", "cpu"), ("scale_from_zero", "disk")
    }  # fmt: skip
    for r in cold:
        # Note [idle memory]: trims' cases hold their first request against a warm one after
        # the same idle, but for the disk tier after a cache drop, which reads fresh weights
        idled = r["system"] == "trims" and (r["tier"] == "cpu" or r["cache"] == "warm")
        assert (r["warm_idle_ms"] is not None) == idled == (r["idle_ms"] is not None)
        if idled:
            assert r["warm_idle_ms"] > 0 and r["idle_ms"] > 0
        started = r["system"] == "trims"
        assert (
            (r["first_request_ms"] is not None) == started == (r["instance_start_ms"] is not None)
        )
        if started:
            assert 0 < r["first_request_ms"] < r["first_response_ms"]
            assert r["first_request_ratio"] > 0
        else:
            assert r["first_request_ratio"] is None
    if "mlserver" in systems:
        assert {r["case"] for r in cold if r["system"] == "mlserver"} == {"load", "process_start"}
    assert {r["system"] for r in doc["memory"]} == systems
    for r in doc["memory"]:
        assert set(r) >= MEMORY_KEYS and r["replicas"] == 2 and r["pss_mib"] > 0
    loops = {(r["system"], r["mode"], r["concurrency"]) for r in doc["throughput"]}
    assert loops >= {(s, m, c) for s in systems
                     for m, c in (("closed", 1), ("closed", 16), ("open", None))}  # fmt: skip
    # trims takes V2 binary tensors; the open loop offers every system one rate
    assert ("trims", "closed-binary", 16) in loops
    assert len({r["rate"] for r in doc["throughput"] if r["mode"] == "open"}) == 1
    for r in doc["throughput"]:
        assert set(r) >= THROUGHPUT_KEYS and r["errors"] == 0 and r["rps"] > 0
        assert (r["rate"] is not None) == (r["mode"] == "open")


def test_trims_side_writes_the_issue_shape_and_tables(tmp_path: Path) -> None:
    doc, md = _peers(tmp_path, "--systems", "trims", "--replicas", "2", "--workers", "1")
    _check_shape(doc, {"trims"})
    assert md == render_markdown(doc)
    assert "(quick: a check, not a measurement)" in md
    assert "**Cold start, page cache warm**" in md
    assert "| trims | scale_from_zero (disk tier) |" in md
    assert "| trims | standby (cpu tier) |" in md
    assert "| trims | V2 JSON |" in md and "| trims | V2 binary |" in md
    assert (tmp_path / "peers.png").read_bytes().startswith(b"\x89PNG")
    assert doc["unavailable"] == {} and doc["failed"] == {}


@pytest.mark.skipif(
    peer("mlserver").unavailable() is not None,
    reason=f"MLServer cannot run: {peer('mlserver').unavailable()}",
)
def test_trims_and_a_peer_side_by_side(tmp_path: Path) -> None:
    doc, md = _peers(tmp_path, "--systems", "trims,mlserver", "--replicas", "2", "--workers", "1")
    _check_shape(doc, {"trims", "mlserver"})
    assert doc["peers"]["mlserver"]["version"] == "1.7.1"
    assert "| mlserver | process_start |" in md and "**Targets**" in md
    assert (tmp_path / "peers.png").read_bytes().startswith(b"\x89PNG")


def test_a_peer_that_cannot_run_is_reported_with_its_error(tmp_path: Path) -> None:
    env = {**os.environ, "TRIMS_KSERVE_VENV": str(tmp_path / "no-such-venv")}
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "peers.py"), "--quick", "--runs", "1", "--width", "64",
         "--model-mb", "1", "--keep-page-cache", "--only", "memory", "--replicas", "1",
         "--systems", "trims,kserve", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert f"no venv at {tmp_path / 'no-such-venv'}" in doc["unavailable"]["kserve"]
    assert "Not run: **kserve** cannot run here" in proc.stdout
    assert {r["system"] for r in doc["memory"]} == {"trims"}


def test_order_changes_who_follows_whom() -> None:
    systems = ["trims", "a", "b", "c"]
    runs = [order(systems, r) for r in range(4)]
    assert all(sorted(r) == sorted(systems) for r in runs)
    follows = {(r[i], r[i + 1]) for r in runs for i in range(len(r) - 1)}
    # each system is followed by more than one other: no fixed successor
    for s in systems:
        assert len({b for a, b in follows if a == s}) >= 2


def test_markdown_says_what_was_skipped() -> None:
    doc = {"machine": "m", "runs": 1, "quick": False, "systems": ["trims", "ray"],
           "cold_start": [], "memory": [], "throughput": [],
           "unavailable": {"ray": "No module named 'ray'"},
           "failed": {"kserve": "memory: RuntimeError: boom"},
           "notes": ["the dropped-cache cases were skipped: cannot drop caches"]}  # fmt: skip
    text = render_markdown(doc)
    assert "trims vs (no peer run)" in text
    assert "Not run: **ray** cannot run here: `No module named 'ray'`" in text
    assert "Failed: **kserve** stopped at memory: RuntimeError: boom" in text
    assert "Note: the dropped-cache cases were skipped" in text
