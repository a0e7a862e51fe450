"""Do the layer analyses reproduce with their defaults? Run them N times, compare the runs.

    python bench/analysis_repro.py --runs 3 --json OUT.json

Each run is what a user gets from the defaults, one analysis after the other, each a fresh
``trims analyze`` process on a fresh results database (nothing is reused between runs):

- ``bricks --models zoo`` (the nine onnx-wheel models, G = 1, 5, 20),
- ``bricks --models families --granularity 1`` (ResNet-18..152, VGG-11..19),
- ``lowerbound --models zoo``.

Per model it reports the spread over runs (min, median, max) of the measured time, the brick
estimate and its error at G = 1, how many runs put the model within 10% with 95% confidence,
whether the same models were within every time, and which were within in every run and which
in some only (a model at the line); per run the wall time and, for the
families, the benchmarking time whole models took against bricks. For the lower bound: the
spread of the measured time and of the sequential bound. ``--quick`` passes ``--quick`` to the
bricks runs (rough, labelled so). Writes ``OUT.json`` and ``OUT.md`` (the tables) or prints both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import machine, write_report

#: name -> the ``trims analyze`` arguments of that analysis
ANALYSES: dict[str, list[str]] = {
    "zoo": ["bricks", "--models", "zoo"],
    "families": ["bricks", "--models", "families", "--granularity", "1"],
    "lowerbound": ["lowerbound", "--models", "zoo"],
}
LIMIT_PCT = 10.0


def run_analysis(name: str, folder: Path, quick: bool, models: str) -> tuple[dict[str, Any], float]:
    """One ``trims analyze`` process on a fresh database; its JSON and wall seconds."""
    args = [models if a == "zoo" else a for a in ANALYSES[name]]
    if quick and args[0] == "bricks":
        args.append("--quick")
    out = folder / f"{name}.json"
    cmd = [sys.executable, "-m", "trims", "analyze", *args, "--db", str(folder / f"{name}.db")]
    start = time.perf_counter()
    done = subprocess.run(
        [*cmd, "--json", str(out), "--no-progress"], capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc, wall


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize_bricks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model over runs, at the study's first granularity (G = 1)."""
    names = [m["name"] for m in runs[0]["models"]]
    models = []
    for name in names:
        rows = [next(m for m in run["models"] if m["name"] == name) for run in runs]
        models.append(
            {
                "name": name,
                "measured_ms": spread([r["measured_ms"] for r in rows]),
                "estimated_ms": spread([r["estimated_ms"] for r in rows]),
                "error_pct": spread([r["error_pct"] for r in rows]),
                "error_ci_pct": [r["error_ci_pct"] for r in rows],
                "verdicts": [r["within_10pct"] for r in rows],
                "runs_within": sum(r["within_10pct"] == "within" for r in rows),
            }
        )
    # a model at the line can be within in some runs only: that alone makes the runs' sets of
    # models within differ, however many were within in every run
    some = [m["name"] for m in models if 0 < m["runs_within"] < len(runs)]
    return {
        "granularity": runs[0]["granularity"],
        "models": models,
        "within_per_run": [
            sum(m["within_10pct"] == "within" for m in run["models"]) for run in runs
        ],
        "same_models_within": not some,
        "within_every_run": [m["name"] for m in models if m["runs_within"] == len(runs)],
        "within_some_runs": some,
        "time_whole_s": [r["time_whole_s"] for r in runs],
        "time_bricks_s": [r["time_bricks_s"] for r in runs],
        "saving": [r["time_whole_s"] / r["time_bricks_s"] for r in runs],
        "quick": any(r.get("quick") for r in runs),
        "coarser": summarize_coarser(runs),
    }


def summarize_coarser(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per granularity after the first (G = 5, 20 for the zoo): models within 10% per run and
    each model's error over the runs."""
    out = []
    for i, first in enumerate(runs[0].get("by_granularity", [])[1:], start=1):
        studies = [run["by_granularity"][i] for run in runs]
        errors = {
            m["name"]: spread(
                [
                    next(x for x in s["models"] if x["name"] == m["name"])["error_pct"]
                    for s in studies
                ]
            )
            for m in first["models"]
        }
        out.append(
            {
                "granularity": first["granularity"],
                "within_per_run": [
                    sum(m["within_10pct"] == "within" for m in s["models"]) for s in studies
                ],
                "error_pct": errors,
            }
        )
    return out


def summarize_lowerbound(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = [m["name"] for m in runs[0]["models"]]
    models = []
    for name in names:
        rows = [next(m for m in run["models"] if m["name"] == name) for run in runs]
        measured = [r["measured_ms"] for r in rows]
        bound = [r["sequential_lb_ms"] for r in rows]
        models.append(
            {
                "name": name,
                "measured_ms": spread(measured),
                "sequential_lb_ms": spread(bound),
                "measured_range_pct": 100 * (max(measured) / min(measured) - 1),
                "bound_range_pct": 100 * (max(bound) / min(bound) - 1),
                # runs whose measurement and bound both reached the precision asked
                "runs_precise": sum(bool(r["precise"]) for r in rows),
                # whether every run's 95% interval overlaps every other's (the runs agree
                # within their own uncertainty)
                "measured_agree": _intervals_overlap([r["measured_ci_ms"] for r in rows]),
                "bound_agree": _intervals_overlap([r["sequential_lb_ci_ms"] for r in rows]),
            }
        )
    return {"models": models, "runs": len(runs)}


def _intervals_overlap(intervals: list[list[float]]) -> bool:
    """Whether some value lies in every interval ``[lo, hi]``."""
    return max(lo for lo, _ in intervals) <= min(hi for _, hi in intervals)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _ms(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def bricks_table(title: str, summary: dict[str, Any]) -> str:
    rows = [
        [
            m["name"],
            _ms(m["measured_ms"]),
            _ms(m["estimated_ms"]),
            f"{m['error_pct']['median']:+.1f} ({m['error_pct']['min']:+.1f} to "
            f"{m['error_pct']['max']:+.1f})",
            f"{m['runs_within']}/{len(m['verdicts'])}",
            ", ".join(m["verdicts"]),
        ]
        for m in summary["models"]
    ]
    saving = ", ".join(f"{x:.2f}x" for x in summary["saving"])
    partly = summary["within_some_runs"]
    some = f"; in some runs only: {', '.join(partly)}" if partly else ""
    head = (
        f"**{title}**, G={summary['granularity']}"
        + (" (QUICK: rough)" if summary["quick"] else "")
        + f": within {LIMIT_PCT:g}% per run {summary['within_per_run']}, same models every run: "
        + _yes(summary["same_models_within"])
        + f" (within every run: {len(summary['within_every_run'])}{some})"
        + f"; benchmarking time whole / bricks per run: {saving}\n\n"
    )
    coarser = "".join(
        f"\n\nG={c['granularity']}: within {LIMIT_PCT:g}% per run {c['within_per_run']}; "
        "median errors "
        + ", ".join(f"{name} {e['median']:+.1f}%" for name, e in c["error_pct"].items())
        for c in summary["coarser"]
    )
    return (
        head
        + markdown_table(
            ["model", "measured ms", "estimated ms", "error %", "runs within 10%", "verdicts"],
            rows,
            align="lrrrrl",
        )
        + coarser
    )


def lowerbound_table(summary: dict[str, Any]) -> str:
    rows = [
        [
            m["name"],
            _ms(m["measured_ms"]),
            f"{m['measured_range_pct']:.1f}%",
            _ms(m["sequential_lb_ms"]),
            f"{m['bound_range_pct']:.1f}%",
            f"{m['runs_precise']}/{summary['runs']}",
            f"{_yes(m['measured_agree'])} / {_yes(m['bound_agree'])}",
        ]
        for m in summary["models"]
    ]
    return "**lowerbound**, zoo\n\n" + markdown_table(
        [
            "model",
            "measured ms",
            "max/min - 1",
            "sequential bound ms",
            "max/min - 1",
            "runs precise",
            "95% CIs overlap (measured / bound)",
        ],
        rows,
        align="lrrrrrl",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument(
        "--only",
        default=",".join(ANALYSES),
        help=f"comma-separated subset of {', '.join(ANALYSES)}",
    )
    parser.add_argument("--quick", action="store_true", help="bricks with --quick (rough)")
    parser.add_argument(
        "--models",
        default="zoo",
        help="the models of the zoo and lowerbound analyses (default: the zoo set)",
    )
    parser.add_argument("--json", type=Path, help="write JSON here and the tables beside it")
    args = parser.parse_args(argv)
    only = [a.strip() for a in args.only.split(",") if a.strip()]
    unknown = [a for a in only if a not in ANALYSES]
    if unknown or args.runs < 1:
        parser.error(f"--only takes {', '.join(ANALYSES)}; --runs at least 1")
    docs: dict[str, list[dict[str, Any]]] = {name: [] for name in only}
    walls: dict[str, list[float]] = {name: [] for name in only}
    started = machine()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="trims-repro-") as folder:
            for name in only:
                doc, wall = run_analysis(name, Path(folder), args.quick, args.models)
                docs[name].append(doc)
                walls[name].append(wall)
                print(f"run {run + 1}/{args.runs} {name}: {wall:.0f} s", file=sys.stderr)
    out: dict[str, Any] = {"machine": started, "runs": args.runs, "wall_s": walls}
    text = [f"{args.runs} runs, {started}\n"]
    for name in only:
        if name == "lowerbound":
            out[name] = summarize_lowerbound(docs[name])
            text.append(lowerbound_table(out[name]))
        else:
            out[name] = summarize_bricks(docs[name])
            text.append(bricks_table(f"bricks {name}", out[name]))
    text.append(
        "wall seconds per run: "
        + "; ".join(f"{n} " + ", ".join(f"{w:.0f}" for w in walls[n]) for n in only)
    )
    write_report(args.json, out, "\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
