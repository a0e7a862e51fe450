"""bench/serverless.py: the trace's shape (seeded, Azure-like popularity and bursts, models
against the budget), the Azure file replay, the harness's measures, search and cgroup, and one
end-to-end run of both trims systems at toy sizes. No timing is asserted."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from serverless_harness import Cgroup, Replay, measure, search  # noqa: E402
from serverless_trace import (  # noqa: E402
    MAX_CV,
    MIB,
    TraceParams,
    _arrivals,
    azure,
    describe,
    read_trace,
    synthetic,
    write_trace,
)

SYSTEM_KEYS = {"system", "sustainable_rate", "errors", "oom_kills", "peak_memory_mib",
               "budget_mib", "rates"}  # fmt: skip
RATE_KEYS = {"scale", "offered_rps", "requests", "slo_attainment", "goodput_rps", "head",
             "tail", "errors", "oom_kills", "peak_memory_mib", "cold_starts"}  # fmt: skip


def test_one_seed_gives_one_trace_and_another_seed_another() -> None:
    params = TraceParams(functions=50, minutes=2)
    assert synthetic(params) == synthetic(params)
    assert synthetic(params).requests != synthetic(TraceParams(functions=50, minutes=2, seed=1))


def test_a_few_functions_carry_most_invocations_and_most_are_rare() -> None:
    trace = synthetic(TraceParams())
    d = describe(trace)
    assert d["functions"] == 200 and d["duration_s"] == 600
    # the head (80% of the invocations) is a few percent of the functions
    assert d["head_share"] >= 0.8 and d["head_functions"] <= 0.05 * 200
    assert d["top_5pct_share"] >= 0.85
    # most functions are invoked a few times an hour or less: at most 2 in these 10 minutes
    counts = trace.counts()
    assert sum(1 for c in counts if c <= 2) >= 0.5 * len(counts)
    # the tail is invoked now and then, not never
    assert d["functions_invoked"] >= 0.4 * len(counts)


@pytest.mark.parametrize("cv", [1.0, 2.0, MAX_CV])
def test_arrivals_have_the_inter_arrival_cv_asked_for(cv: float) -> None:
    times = _arrivals(20.0, cv, 4000.0, np.random.default_rng(3))
    gaps = np.diff(times)
    assert len(times) == pytest.approx(80_000, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)
    assert times.min() >= 0 and times.max() < 4000


def test_functions_mix_poisson_and_bursty_arrivals_up_to_cv_4() -> None:
    cvs = [f.cv for f in synthetic(TraceParams()).functions]
    assert all(c is not None and 1.0 <= c <= MAX_CV for c in cvs)
    assert sum(1 for c in cvs if c == 1.0) >= 0.15 * len(cvs)
    assert max(c for c in cvs if c is not None) >= 3.5


def test_models_span_a_few_mib_to_a_gib_and_total_four_budgets() -> None:
    trace = synthetic(TraceParams())
    sizes = sorted(f.model.bytes / MIB for f in trace.functions)
    assert 3.5 <= sizes[0] <= 8 and 512 <= sizes[-1] <= 1024 * 1.02
    assert sum(sizes) == pytest.approx(12 * 1024, rel=0.02)
    # log-normal: most are small, a few are big
    assert sizes[len(sizes) // 2] < 64 and sum(1 for s in sizes if s >= 256) >= 5
    from serverless import default_budget_mib

    assert sum(sizes) >= 4 * default_budget_mib(trace) - 1e-6
    # every model's file holds exactly what the trace says
    for f in trace.functions:
        assert (
            f.model.layers >= 1
            and f.model.bytes == f.model.layers * (f.model.width**2 + f.model.width) * 4
        )


def test_a_trace_file_replays_exactly(tmp_path: Path) -> None:
    trace = synthetic(TraceParams(functions=30, minutes=1))
    write_trace(trace, tmp_path / "t.json")
    assert read_trace(tmp_path / "t.json") == trace


def _azure_csv(path: Path) -> None:
    header = ["HashOwner", "HashApp", "HashFunction", "Trigger", *map(str, range(1, 1441))]
    rows = {
        "quiet": [0] * 1440,
        "busy": [30, 10, 50] + [1] * 1437,
        "tail": [0, 1, 0] + [0] * 1437,
        "mid": [5, 5, 5] + [100] * 1437,  # busy later, not in the first 3 minutes
        "burst": [0, 0, 40] + [0] * 1437,
    }
    lines = [",".join(header)]
    for name, counts in rows.items():
        lines.append(",".join(["owner", "app", name, "http", *map(str, counts)]))
    path.write_text("\n".join(lines) + "\n")


def test_an_azure_file_replays_its_top_functions_minute_by_minute(tmp_path: Path) -> None:
    _azure_csv(tmp_path / "d01.csv")
    params = TraceParams(functions=3, minutes=3, total_mib=24, min_mib=1, max_mib=16)
    trace = azure(tmp_path / "d01.csv", params)
    assert trace == azure(tmp_path / "d01.csv", params)
    assert trace.duration_s == 180 and trace.source == "azure:d01.csv"
    # the top 3 by invocations in those minutes: busy (90), burst (40), mid (15)
    per_minute: dict[int, list[int]] = {}
    for t, i in trace.requests:
        per_minute.setdefault(i, [0, 0, 0])[int(t // 60)] += 1
    assert [per_minute[i] for i in range(3)] == [[30, 10, 50], [0, 0, 40], [5, 5, 5]]
    assert len(trace.functions) == 3 and trace.head() == frozenset({0, 1})
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b,c\n")
    with pytest.raises(ValueError, match="HashOwner,HashApp,HashFunction,Trigger"):
        azure(bad, params)


def test_measures_split_head_and_tail_and_count_errors_by_kind() -> None:
    run = Replay(
        outcomes=[
            (0, 0.0, 0.010, "ok"),
            (0, 0.1, 0.020, "ok"),
            (0, 0.2, None, "http 503"),
            (1, 0.3, 2.5, "ok"),  # answered, but past its 1 s SLO
            (1, 0.4, 0.5, "ok"),
            (1, 0.5, None, "disconnected"),
        ]
    )
    r = measure(run, slo_s=[1.0, 1.0], head=frozenset({0}), window_s=2.0)
    assert r["requests"] == 6 and r["answered"] == 4 and r["slo_met"] == 3
    assert r["slo_attainment"] == 0.5 and r["goodput_rps"] == 1.5
    assert r["errors"] == {"disconnected": 1, "http 503": 1}
    assert r["head"]["p50_ms"] == pytest.approx(10) and r["head"]["p99_ms"] == pytest.approx(20)
    assert r["tail"]["p99_ms"] == pytest.approx(2500)
    # the warm-up's requests were sent but are not measured
    r = measure(run, slo_s=[1.0, 1.0], head=frozenset({0}), window_s=2.0, warmup_s=0.25)
    assert r["requests"] == 3 and r["warmup_requests"] == 3 and r["slo_met"] == 1
    assert r["errors"] == {"disconnected": 1} and r["goodput_rps"] == pytest.approx(1 / 1.75)


def test_the_search_doubles_then_bisects_within_its_runs() -> None:
    tried: list[float] = []

    async def at(scale: float) -> dict[str, Any]:
        tried.append(scale)
        return {"scale": scale, "slo_attainment": 1.0 if scale <= 5 else 0.5}

    runs, held = asyncio.run(search(at, 1.0, max_runs=6))
    assert tried == [1, 2, 4, 8, 6, 5] and held == 5 and len(runs) == 6

    tried.clear()
    runs, held = asyncio.run(search(at, 16.0, max_runs=3))
    assert tried == [16, 8, 4] and held == 4

    async def never(scale: float) -> dict[str, Any]:
        return {"scale": scale, "slo_attainment": 0.0}

    assert asyncio.run(search(never, 1.0, max_runs=2))[1] is None


FORK_AND_WAIT = """
import os, sys
if os.fork() == 0:
    sys.stdin.read()
    os._exit(0)
print("forked", flush=True)
sys.stdin.read()
"""


def _hold(group: Cgroup, code: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*group.command_prefix(), sys.executable, "-c", code],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_a_cgroup_holds_a_process_and_what_it_forks_and_counts_its_oom_kills() -> None:
    group = Cgroup.create(f"trims-bench-test-{os.getpid()}", 64 * MIB)
    try:
        # a parent that forks a child, both waiting on the parent's stdin
        parent = _hold(group, FORK_AND_WAIT)
        assert parent.stdout is not None and parent.stdout.readline().strip() == "forked"
        pids = group.pids()
        assert parent.pid in pids and len(pids) == 2
        assert group.oom_kills() == 0 and 0 < group.usage() <= 64 * MIB
        parent.communicate("")
        # one that touches more than the limit is OOM-killed, and the cgroup says so
        hog = _hold(group, "b = bytearray(256 << 20)\nb[::4096] = b'x' * len(b[::4096])")
        hog.communicate()
        assert hog.returncode == -9 and group.oom_kills() == 1
        assert (group.peak() or 64 * MIB) <= 64 * MIB
    finally:
        group.remove()
    assert not group.path.exists()


@pytest.mark.slow
def test_both_trims_systems_replay_one_trace_in_their_cgroups(tmp_path: Path) -> None:
    out, md, fig = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "serverless.py"), "--functions", "4", "--minutes", "0.2",
         "--total-mib", "12", "--min-mib", "1", "--max-mib", "8", "--budget-mib", "1024",
         "--rate", "3", "--run-seconds", "6", "--max-runs", "1", "--write-trace", str(trace),
         "--systems", "trims,trims store off", "--models-dir", str(tmp_path / "models"),
         "--json", str(out), "--markdown", str(md), "--figure", str(fig)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert read_trace(trace).requests and doc["trace"]["functions"] == 4
    assert [s["system"] for s in doc["systems"]] == ["trims", "trims store off"]
    for s in doc["systems"]:
        assert set(s) >= SYSTEM_KEYS and s["budget_mib"] == 1024
        (r,) = s["rates"]
        assert set(r) >= RATE_KEYS and r["scale"] == 1.0
        # every request sent has an outcome: an answer or an error of some kind
        assert r["requests"] > 0 and r["answered"] + sum(r["errors"].values()) == r["requests"]
        assert 0 < r["peak_memory_mib"] <= 1024 and r["oom_kills"] == 0
    assert "| trims store off |" in md.read_text()
    assert doc["slo"]["points"] and all(p["warm_ms"] > 0 for p in doc["slo"]["points"])
    pytest.importorskip("matplotlib")
    assert fig.stat().st_size > 0
