"""``trims analyze lowerbound|bricks|layers``: model analyses with tables, JSON and plots."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from trims.config import results_db, write_atomic
from trims.evaluation.analyses import AnalyzeSettings, analyze, make_settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("analysis", choices=("lowerbound", "bricks", "layers"))
    parser.add_argument(
        "--models",
        default="zoo",
        help="comma-separated zoo names, PyTorch family models (torch:resnet101), .onnx paths "
        "or the sets 'zoo' (the nine onnx-wheel models, the default) and 'families' "
        "(ResNet-18..152 and VGG-11..19 exported from PyTorch)",
    )
    parser.add_argument(
        "--framework",
        default="onnxruntime",
        help="comma-separated: onnxruntime, pytorch, mxnet (the first one is used for bricks)",
    )
    parser.add_argument(
        "--variants",
        default="opt=all,opt=extended",
        help="ONNX Runtime graph optimization levels to benchmark layers under "
        "(disable, basic, extended, all); the lower bound takes each layer's best",
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--granularity", default="1,5,20", help="brick sizes G (layers)")
    parser.add_argument(
        "--db",
        help="SQLite path or SQLAlchemy URL (default $TRIMS_RESULTS_DB, else "
        "~/.local/share/trims/results.sqlite)",
    )
    parser.add_argument("--json", dest="json_out", type=Path, help="write results as JSON here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    parser.add_argument("--force", action="store_true", help="re-measure what the DB already has")
    parser.add_argument(
        "--max-time",
        type=float,
        help="seconds per benchmark before it stops (default 0.5; bricks and lowerbound: 60, "
        "a guard: --precision decides; MXNet's and the fusion chains stop when stable, 0.5)",
    )
    parser.add_argument(
        "--min-reps",
        type=int,
        help="timed runs per benchmark, at least (default 7; bricks and lowerbound: 3, then "
        "--precision)",
    )
    parser.add_argument(
        "--precision",
        type=float,
        help="bricks, lowerbound: half-width of the 95%% confidence interval asked of each "
        "model's time, measured whole and estimated from bricks (or its sequential bound), as "
        "a fraction of it (default 0.02; --quick: 0.05)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="bricks, lowerbound: a fast, rough run (+-5%%, at most 2 s per benchmark), "
        "labelled as such; the defaults reproduce run after run",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--mxnet-python",
        help="python of the MXNet environment (default: $TRIMS_MXNET_VENV/bin/python or "
        "/tmp/trims-mxnet-venv/bin/python)",
    )


def _settings(args: argparse.Namespace) -> AnalyzeSettings:
    return make_settings(
        args.analysis,
        models=args.models,
        framework=args.framework,
        variants=args.variants,
        threads=args.threads,
        batch=args.batch,
        granularity=args.granularity,
        db=args.db or results_db(os.environ),
        force=args.force,
        max_time=args.max_time,
        min_reps=args.min_reps,
        precision=args.precision,
        quick=args.quick,
        progress=not args.no_progress and sys.stderr.isatty(),
        mxnet_python=args.mxnet_python,
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    report = analyze(_settings(args))
    print(report.text)
    if args.json_out is not None:
        write_atomic(args.json_out, json.dumps(report.body, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        for path in report.plot(args.plots):
            print(f"wrote {path}")
    return 0
