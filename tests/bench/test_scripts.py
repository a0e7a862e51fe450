"""The benchmark scripts run end to end at toy sizes and write the JSON their docs promise.

Performance lives in bench/, never in tests: these only catch a script that no longer runs (a
spec or API change under it) or writes another shape of JSON. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script: str, out: Path, *args: str) -> Any:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_acquire(tmp_path: Path) -> None:
    doc = _run("acquire.py", tmp_path / "a.json", "--sizes-mb", "4", "--runs", "1",
               "--instances", "2", "--memory-mb", "4")  # fmt: skip
    methods = {r["method"] for r in doc["results"]}
    assert {"trims", "torch_load", "torch_load_mmap", "safetensors"} <= methods
    for r in doc["results"]:
        assert {"size_mb", "method", "median_s", "min_s", "max_s"} <= set(r)
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
    assert doc["memory"]["instances"] == 2
    assert {"trims", "baseline"} <= set(doc["memory"]["pss_mb"])


@pytest.mark.slow
def test_coldstart(tmp_path: Path) -> None:
    doc = _run("coldstart.py", tmp_path / "c.json", "--model-mb", "2", "--runs", "1")
    modes = {r["mode"] for r in doc["results"]}
    assert modes == {"no_store", "store", "store_zygote", "standby", "warm"}
    for r in doc["results"]:
        assert {"mode", "model_mb", "median_s", "min_s", "max_s"} <= set(r)


def test_gateway(tmp_path: Path) -> None:
    doc = _run("gateway.py", tmp_path / "g.json", "--concurrency", "2", "--seconds", "1",
               "--repeat", "1")  # fmt: skip
    assert {"echo_rps", "echo_p50_ms", "echo_p99_ms", "bare_rps", "echo_web_rps"} <= set(doc)
    assert doc["errors"] == 0 and doc["echo_rps"] > 0 and doc["bare_rps"] > 0
    assert doc["echo_web_rps"] > 0


def test_idle_memory(tmp_path: Path) -> None:
    doc = _run("idle_memory.py", tmp_path / "i.json", "--quick", "--idle", "0,0.01", "--runs", "1")
    assert doc["quick"] is True and doc["mb"] == 64
    assert [r["idle_s"] for r in doc["results"]] == [0.0, 0.01]
    for r in doc["results"]:
        assert {"idle_s", "after_idle_ms", "warm_ms", "ratio", "touch_ms", "runs"} <= set(r)
        assert r["after_idle_ms"] > 0 and r["warm_ms"] > 0 and r["runs"] == 1
        assert r["ratio"] == pytest.approx(r["after_idle_ms"] / r["warm_ms"])


def test_tier_loads(tmp_path: Path) -> None:
    doc = _run("tier_loads.py", tmp_path / "t.json", "--quick", "--runs", "1")
    assert doc["quick"] is True and doc["mb"] == 64
    rows = {(r["backing"], r["load"]): r for r in doc["results"]}
    loads = {(b, load) for b in ("memfd", "file") for load in ("first", "again", "restart")}
    disk = {("disk", op) for op in ("commit", "commit+chunks", "verify", "scrub")}
    assert set(rows) == loads | disk
    for r in rows.values():
        assert r["ms"] > 0 and r["runs"] == 1 and r["min_ms"] <= r["ms"] <= r["max_ms"]
    # a memfd copy is hashed every time (by chunks after the first); an unchanged file is not,
    # until a restart forgets that it was verified
    hashed = {key: r["hashed_mib"] for key, r in rows.items()}
    assert hashed == {("memfd", "first"): 64, ("memfd", "again"): 64, ("memfd", "restart"): 64,
                      ("file", "first"): 64, ("file", "again"): 0, ("file", "restart"): 64,
                      ("disk", "commit"): 64, ("disk", "commit+chunks"): 64,
                      ("disk", "verify"): 64, ("disk", "scrub"): 64}  # fmt: skip
    assert rows[("memfd", "first")]["vs_first"] == rows[("disk", "commit")]["vs_first"] == 1.0


@pytest.mark.parametrize("pool", ["auto", "0"])
def test_backings(tmp_path: Path, pool: str) -> None:
    before = _hugepages()
    doc = _run("backings.py", tmp_path / "b.json", "--quick", "--runs", "1", "--mb", "8",
               "--hugetlb-pool", pool)  # fmt: skip
    assert _hugepages() == before, "the hugetlb pool was not put back"
    rows = {r["backing"]: r for r in doc["results"]}
    assert {"memfd", "file"} <= set(rows) <= {"memfd", "file", "hugetlb"}
    for r in rows.values():
        assert r["runs"] == 1 and r["first_ms"] > 0 and r["again_ms"] > 0 and r["faults"] > 0
    assert rows["memfd"]["reserved_mib"] == rows["file"]["reserved_mib"] == 0
    if "hugetlb" in rows:  # a private mapping reserves a whole copy's worth of the pool
        assert rows["hugetlb"]["reserved_mib"] == 8 and rows["hugetlb"]["mapping"] == "private"
        assert rows["hugetlb"]["faults"] < rows["memfd"]["faults"]
    else:
        assert any("hugetlb skipped" in n for n in doc["notes"])


def _hugepages() -> str:
    path = Path("/proc/sys/vm/nr_hugepages")
    return path.read_text() if path.exists() else ""


@pytest.mark.slow
def test_density(tmp_path: Path) -> None:
    doc = _run("density.py", tmp_path / "d.json", "--model-mb", "2", "--instances", "2",
               "--churn-models", "3", "--churn-mb", "1", "--seconds", "1", "--concurrency", "2",
               "--budget-gib", "1", "--idle-s", "1")  # fmt: skip
    assert {"density", "churn", "model_mb"} <= set(doc)
    for mode in ("store", "no_store"):
        assert doc["density"][mode]["instances"] == 2
        assert doc["churn"][mode]["errors"] == 0 and doc["churn"][mode]["requests"] > 0


def test_case_study_plan_covers_the_frameworks_scenarios_and_suts() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "case_study.py"), "--plan"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = json.loads(proc.stdout)["steps"]
    models = {s["model"] for s in steps}
    assert len(models) >= 12
    for model in models:
        scenarios = {s["scenario"] for s in steps if s["model"] == model}
        assert {"single-stream", "offline"} <= scenarios, model
    server = {s["model"] for s in steps if s["scenario"] == "server"}
    assert len(server) >= 3
    assert {"direct", "gateway"} == {s["sut"] for s in steps}


def test_case_study_quick(tmp_path: Path) -> None:
    doc = _run("case_study.py", tmp_path / "cs.json", "--quick")
    assert doc["quick"] is True and Path(doc["db"]) == tmp_path / "cs.sqlite"
    assert doc["skipped"] == []
    seen = {(e["model"], e["scenario"], e["sut"]) for e in doc["evaluations"]}
    assert seen == {
        (m, scenario, sut)
        for m in ("digits-mlp", "mnist-cnn-onnxruntime")
        for scenario in ("single-stream", "offline", "server")
        for sut in ("direct", "gateway")
    }
    for e in doc["evaluations"]:
        assert e["accuracy"] is not None and e["accuracy"]["samples"] == 450
    assert {h["model"] for h in doc["harness"]} == {"digits-mlp", "mnist-cnn-onnxruntime"}
    assert "QUICK RUN" in (tmp_path / "cs.md").read_text()
    from trims.evaluation.harness.results import list_evaluations

    assert len(list_evaluations(doc["db"])) == len(doc["evaluations"])
