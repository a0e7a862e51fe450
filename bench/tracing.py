"""Leveled tracing: model-level latency vs untraced, overhead per level, layer coverage.

    python bench/tracing.py [--models example:resnet50] [--frameworks torch,onnxruntime]
                            [--runs 30] [--max-time 10] --json OUT.json [--docs docs/evaluation.md]

For each model and framework it runs ``trims trace``'s leveled measurement to the layer level
(untraced, model, layer; each repeated until stable or ``--runs``/``--max-time``) and
reports: the untraced latency, each level's latency and overhead against it (the model level's
is the leveling target: within 3%), and the share of model time the layer spans cover
(target: at least 90%). Writes OUT.json, OUT.md and, with ``--docs``, the block between
``<!-- bench:tracing:start -->`` and ``<!-- bench:tracing:end -->`` in that file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from runtime_common import write_report

from trims.config import write_atomic

START, END = "<!-- bench:tracing:start -->", "<!-- bench:tracing:end -->"


def measure(model: str, framework: str, runs: int, max_time: float, threads: int) -> dict[str, Any]:
    from trims.evaluation.tracing.run import make_request, trace

    request = make_request(
        model, framework=framework, level="layer", runs=runs, max_time=max_time, threads=threads
    )
    _, report = trace(request, process="bench tracing")
    body = report.body
    levels = {lv["level"]: lv for lv in body["levels"]}
    return {
        "model": model,
        "framework": framework,
        "untraced_ms": body["untraced_ms"],
        "untraced_runs": body["untraced_runs"],
        "model_ms": levels["model"]["latency_ms"],
        "model_overhead_pct": levels["model"]["overhead_pct"],
        "model_runs": levels["model"]["runs"],
        "layer_ms": levels.get("layer", {}).get("latency_ms"),
        "layer_overhead_pct": levels.get("layer", {}).get("overhead_pct"),
        "layer_runs": levels.get("layer", {}).get("runs"),
        "coverage_pct": body["coverage_pct"],
        "layers": len(body["layers"]),
        "matched": body["layer_match"]["matched"],
        "unavailable": body["unavailable"],
    }


def markdown(rows: list[dict[str, Any]], machine: str) -> str:
    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = [
        f"Machine: {machine}. Leveled to the layer level; latency = trimmed mean of each level's "
        "runs (wall clock); overhead vs the untraced run.",
        "",
        "| model | framework | untraced ms | model-level ms | model overhead % | layer-level ms "
        "| layer overhead % | layer coverage % | layers (matched to IR) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['framework']} | {f(r['untraced_ms'])} | {f(r['model_ms'])} | "
            f"{f(r['model_overhead_pct'])} | {f(r['layer_ms'])} | {f(r['layer_overhead_pct'])} "
            f"| {f(r['coverage_pct'])} | {r['layers']} ({r['matched']}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="example:resnet50")
    parser.add_argument("--frameworks", default="torch,onnxruntime")
    parser.add_argument("--runs", type=int, default=30, help="timed predicts per level, at most")
    parser.add_argument("--max-time", type=float, default=10.0, help="seconds per level, at most")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--docs", type=Path)
    args = parser.parse_args(argv)
    rows = [
        measure(model, framework, args.runs, args.max_time, args.threads)
        for model in args.models.split(",")
        for framework in args.frameworks.split(",")
    ]
    from trims.evaluation.db import system_id

    machine = f"{system_id()}, {args.threads} intra-op thread(s)"
    table = markdown(rows, machine)
    write_report(args.json, {"results": rows, "machine": machine}, table)
    if args.docs is not None:
        text = args.docs.read_text()
        if START in text and END in text:
            head, rest = text.split(START, 1)
            _, tail = rest.split(END, 1)
            write_atomic(args.docs, f"{head}{START}\n{table}{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
