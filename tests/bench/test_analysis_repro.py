"""bench/analysis_repro.py runs the analyses N times on fresh databases and compares the runs.

A toy size (one small model, --quick): this only catches a script that no longer runs or
writes another shape of JSON; the figures are the benchmark's, never asserted here.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _repro() -> ModuleType:
    """bench/analysis_repro.py as a module (bench/ is scripts, not a package)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("analysis_repro")
    finally:
        sys.path.remove(str(BENCH))


def test_two_quick_runs_of_one_model(tmp_path: Path) -> None:
    out = tmp_path / "repro.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "analysis_repro.py"), "--runs", "2", "--only", "zoo",
         "--models", "squeezenet", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    zoo = doc["zoo"]
    assert doc["runs"] == 2 and zoo["quick"] and len(zoo["saving"]) == 2
    (model,) = zoo["models"]
    assert model["name"] == "squeezenet" and len(model["verdicts"]) == 2
    assert model["runs_within"] == sum(v == "within" for v in model["verdicts"])
    spread = model["error_pct"]
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert all(w > 0 for w in doc["wall_s"]["zoo"])
    # the coarser granularities (the zoo's default 1, 5, 20) are summarized too
    assert [c["granularity"] for c in zoo["coarser"]] == [5, 20]
    assert all(
        len(c["within_per_run"]) == 2 and "squeezenet" in c["error_pct"] for c in zoo["coarser"]
    )
    table = out.with_suffix(".md").read_text()
    assert "QUICK" in table and "| squeezenet |" in table and "G=5: within 10% per run" in table


def test_an_unknown_analysis_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "analysis_repro.py"), "--only", "bricks"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--only takes zoo, families, lowerbound" in proc.stderr


def _lowerbound_row(measured: list[float], bound: list[float], precise: bool) -> dict[str, Any]:
    """One model of one `trims analyze lowerbound --json` run (the keys the summary reads):
    ``measured`` and ``bound`` are [value, lo, hi]."""
    return {
        "name": "squeezenet",
        "measured_ms": measured[0],
        "measured_ci_ms": measured[1:],
        "sequential_lb_ms": bound[0],
        "sequential_lb_ci_ms": bound[1:],
        "precise": precise,
    }


def test_lowerbound_summary_counts_precise_runs_and_whether_the_runs_agree() -> None:
    repro = _repro()
    runs = [
        {"models": [_lowerbound_row([10.0, 9.8, 10.2], [8.0, 7.9, 8.1], True)]},
        {"models": [_lowerbound_row([10.1, 9.9, 10.3], [8.5, 8.4, 8.6], False)]},
    ]
    summary = repro.summarize_lowerbound(runs)
    (model,) = summary["models"]
    assert summary["runs"] == 2 and model["runs_precise"] == 1
    # the measured intervals share [9.9, 10.2]; the bounds' ([7.9, 8.1], [8.4, 8.6]) do not
    assert model["measured_agree"] and not model["bound_agree"]
    assert model["measured_range_pct"] == pytest.approx(1.0)
    assert model["bound_range_pct"] == pytest.approx(6.25)
    table = repro.lowerbound_table(summary)
    assert "| squeezenet |" in table and "| 1/2 |" in table and "| yes / no |" in table


def _bricks_run(verdicts: dict[str, str]) -> dict[str, Any]:
    """One `trims analyze bricks --json` run with a verdict per model (the keys the summary
    reads; the times are placeholders the test does not look at)."""
    return {
        "granularity": 1,
        "time_whole_s": 4.0,
        "time_bricks_s": 1.0,
        "models": [
            {
                "name": name,
                "measured_ms": 5.0,
                "estimated_ms": 4.6,
                "error_pct": -8.0,
                "error_ci_pct": [-9.0, -7.0],
                "within_10pct": verdict,
            }
            for name, verdict in verdicts.items()
        ],
    }


def test_bricks_summary_tells_models_within_every_run_from_models_at_the_line() -> None:
    repro = _repro()
    runs = [
        _bricks_run({"alexnet": "within", "shufflenet": "within", "vgg19": "outside"}),
        _bricks_run({"alexnet": "within", "shufflenet": "straddles", "vgg19": "outside"}),
        _bricks_run({"alexnet": "within", "shufflenet": "straddles", "vgg19": "straddles"}),
    ]
    summary = repro.summarize_bricks(runs)
    assert summary["within_per_run"] == [2, 1, 1] and not summary["same_models_within"]
    assert summary["within_every_run"] == ["alexnet"]
    assert summary["within_some_runs"] == ["shufflenet"]  # vgg19 never: not at the line
    head = repro.bricks_table("bricks zoo", summary).splitlines()[0]
    assert "same models every run: no (within every run: 1; in some runs only: shufflenet)" in head
    steady = repro.summarize_bricks(runs[1:])  # shufflenet straddles in both
    assert steady["same_models_within"] and steady["within_some_runs"] == []
    head = repro.bricks_table("bricks zoo", steady).splitlines()[0]
    assert "same models every run: yes (within every run: 1);" in head
