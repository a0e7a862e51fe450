"""``trims trace MODEL``: a leveled across-stack trace of one model, as tables, JSON and files.

Runs the model untraced and once per level up to ``--level``, prints the latency and overhead
of each level and the layer table, stores the trace in the results database (the one
``trims analyze`` uses) and optionally writes the summary JSON, the Chrome trace file, sends
the trace to an OTLP/HTTP endpoint and compares it with another trace.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from trims.config import results_db, write_atomic
from trims.evaluation.tracing.run import DEPTHS, MAX_BATCH, MAX_RUNS, make_request, trace
from trims.evaluation.tracing.workload import EXAMPLE, FRAMEWORKS

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help=f"a zoo name (resnet50), a PyTorch family model (torch:resnet18), {EXAMPLE} "
        "(examples/resnet50) or an .onnx path",
    )
    parser.add_argument("--framework", default="torch", help=f"one of {', '.join(FRAMEWORKS)}")
    parser.add_argument("--level", default="layer", help=f"depth: one of {', '.join(DEPTHS)}")
    parser.add_argument(
        "--runs", type=int, default=50, help=f"timed predicts per level, at most (1..{MAX_RUNS})"
    )
    parser.add_argument("--batch", type=int, default=1, help=f"batch size (1..{MAX_BATCH})")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument(
        "--max-time", type=float, default=5.0, help="seconds per level before it stops (5)"
    )
    parser.add_argument("--json", dest="json_out", type=Path, help="write the summary JSON here")
    parser.add_argument("--chrome", type=Path, help="write the Chrome trace-event JSON here")
    parser.add_argument("--otlp-endpoint", help="POST the trace to this OTLP/HTTP traces URL")
    parser.add_argument(
        "--db",
        help="SQLite path or SQLAlchemy URL (default $TRIMS_RESULTS_DB, else "
        "~/.local/share/trims/results.sqlite, the database trims analyze and evaluate use)",
    )
    parser.add_argument("--no-store", action="store_true", help="do not store the trace")
    parser.add_argument(
        "--compare", help="a trace id in --db or a summary JSON file to compare this trace with"
    )
    parser.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    parser.add_argument("--quick", action="store_true", help="few runs per level (smoke test)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    from trims.evaluation.tracing import analyses, store

    args.db = args.db or results_db(os.environ)

    request = make_request(
        args.model,
        framework=args.framework,
        level=args.level,
        runs=args.runs,
        batch=args.batch,
        threads=args.threads,
        max_time=args.max_time,
        quick=args.quick,
    )
    other = store.load_summary(args.compare, args.db) if args.compare else None
    result, report = trace(request)
    body = report.body
    if other is not None:
        body["compare"] = analyses.compare(other, body)
    if not args.no_store:
        store.save(args.db, result.trace, body, request.level.label)
    if args.chrome is not None:
        from trims.tracing.chrome import write_chrome

        write_chrome(result.trace, args.chrome)
    if args.otlp_endpoint:
        from trims.tracing.otlp import export

        export(result.trace, args.otlp_endpoint)
    if args.json_out is not None:
        write_atomic(args.json_out, json.dumps(body, indent=2) + "\n")
    print(report.text)
    if other is not None:
        print()
        print(analyses.compare_text(body["compare"]))
    if not args.no_store:
        print(f"stored trace {result.trace.trace_id} in {args.db}")
    for what, path in (("summary", args.json_out), ("Chrome trace", args.chrome)):
        if path is not None:
            print(f"wrote {what} {path}")
    if args.otlp_endpoint:
        print(f"sent {len(result.trace.spans)} spans to {args.otlp_endpoint}")
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        for path in report.plot(args.plots):
            print(f"wrote {path}")
    return 0
