"""``trims kernels tcu|klap|transfer|als``: run a study, print a table, write JSON and plots.

Examples::

    trims kernels tcu --max-log2 20 --json tcu.json --plots docs/img
    trims kernels klap --json klap.json
    trims kernels transfer --full --json transfer.json
    trims kernels als --dataset ml-100k --json als.json

``--backend cupy`` runs a study's GPU path (CuPy and an NVIDIA GPU required).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trims.config import write_atomic
from trims.errors import ValidationError
from trims.kernels import studies
from trims.tables import markdown_table

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="study", required=True, metavar="STUDY")

    def common(p: argparse.ArgumentParser, backend: bool = True) -> None:
        p.add_argument("--json", type=Path, metavar="OUT.json", help="write the results here")
        p.add_argument("--plots", type=Path, metavar="DIR", help="write PNG figures here")
        p.add_argument("-v", "--verbose", action="store_true", help="log every measurement")
        if backend:
            p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy",
                           help="numpy (any machine) or cupy (NVIDIA GPU)")  # fmt: skip

    p = sub.add_parser("tcu", help="reduction and scan as 16x16 matrix multiplications")
    common(p)
    p.add_argument("--min-log2", type=int, default=12, help="smallest total size, log2 elements")
    p.add_argument("--max-log2", type=int, default=20,
                   help="largest total size, log2 elements (the study goes to 28)")  # fmt: skip
    p.add_argument("--segments", default="16,256,1024,4096,16384,0",
                   help="comma-separated segment sizes; 0 is the full operation")  # fmt: skip
    p.add_argument("--repeat", type=int, default=5)

    p = sub.add_parser("klap", help="kernel launch aggregation on irregular nested parallelism")
    common(p)
    p.add_argument("--rmat-scale", type=int, default=12, help="BFS/SSSP graph: 2^scale vertices")
    p.add_argument("--spmv-rows", type=int, default=4096)
    p.add_argument("--mandelbrot-size", type=int, default=256)
    p.add_argument("--tree-nodes", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=3)

    p = sub.add_parser("transfer", help="data-transfer bandwidth vs size per modality")
    common(p, backend=False)
    p.add_argument("--min-log2", type=int, default=8)
    p.add_argument("--max-log2", type=int, default=24, help="largest size, log2 bytes")
    p.add_argument("--full", action="store_true", help="sizes up to 2^30 bytes (slow)")
    p.add_argument("--gpu", action="store_true", help="also the CuPy GPU modalities")
    p.add_argument("--no-ipc", action="store_true", help="skip the between-process modalities")
    p.add_argument("--repeat", type=int, default=5)

    p = sub.add_parser("als", help="explicit and implicit ALS beside the implicit library")
    common(p)
    p.add_argument("--dataset", choices=("ml-100k", "synthetic"), default="ml-100k")
    p.add_argument("--factors", type=int, default=64, help="implicit ALS factors")
    p.add_argument("--iterations", type=int, default=15, help="implicit ALS iterations")
    p.add_argument("--explicit-iterations", type=int, default=15)
    p.add_argument("--no-peer", action="store_true", help="do not run the implicit library")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")  # fmt: skip
    handler = {"tcu": _tcu, "klap": _klap, "transfer": _transfer, "als": _als}[args.study]
    result = handler(args)
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
        print(f"results written to {args.json}")
    return 0


def markdown(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of ``columns`` from ``rows`` (floats to 4 significant digits)."""
    return markdown_table(columns, [[r.get(c) for c in columns] for r in rows])


def _tcu(args: argparse.Namespace) -> dict[str, Any]:
    try:
        segments = [int(s) for s in args.segments.split(",") if s.strip()]
    except ValueError as e:
        raise ValidationError(f"--segments takes comma-separated integers: {e}") from e
    settings = studies.settings_from("tcu", {
        "min_log2": args.min_log2, "max_log2": args.max_log2, "segments": segments,
        "backend": args.backend, "repeat": args.repeat,
    })  # fmt: skip
    result = studies.run("tcu", settings)
    print(markdown(result["rows"], ("operation", "segment", "total", "method", "elements_per_s",
                                    "copy_fraction", "error_ratio")))  # fmt: skip
    if args.plots:
        from trims.kernels import plots

        plots.tcu(result["rows"], args.plots)
    return result


def _klap(args: argparse.Namespace) -> dict[str, Any]:
    settings = studies.settings_from("klap", {
        "rmat_scale": args.rmat_scale, "spmv_rows": args.spmv_rows,
        "mandelbrot_size": args.mandelbrot_size, "tree_nodes": args.tree_nodes,
        "repeat": args.repeat, "backend": args.backend,
    })  # fmt: skip
    result = studies.run("klap", settings)
    print(markdown(result["rows"], ("app", "variant", "launch_side", "seconds", "launches",
                                    "speedup", "correct")))  # fmt: skip
    print("\ngeometric-mean speedup over per-parent launches: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in result["geomean_speedup"].items()))  # fmt: skip
    if args.plots:
        from trims.kernels import plots

        plots.klap(result["rows"], args.plots)
    return result


def _transfer(args: argparse.Namespace) -> dict[str, Any]:
    from trims.kernels.transfer import FULL_MAX_LOG2

    settings = studies.settings_from("transfer", {
        "min_log2": args.min_log2, "max_log2": FULL_MAX_LOG2 if args.full else args.max_log2,
        "repeat": args.repeat, "ipc": not args.no_ipc, "gpu": args.gpu,
    })  # fmt: skip
    result = studies.run("transfer", settings)
    print(markdown(result["rows"], ("domain", "modality", "size", "cache", "seconds",
                                    "bandwidth")))  # fmt: skip
    if args.plots:
        from trims.kernels import plots

        plots.transfer(result["rows"], args.plots)
    return result


def _als(args: argparse.Namespace) -> dict[str, Any]:
    settings = studies.settings_from("als", {
        "dataset": args.dataset, "backend": args.backend, "implicit_factors": args.factors,
        "implicit_iterations": args.iterations,
        "explicit_iterations": args.explicit_iterations, "peer": not args.no_peer,
    })  # fmt: skip
    result = studies.run("als", settings)
    print(markdown([{"part": k, **v} for k, v in result.items()],
                   ("part", "rmse", "precision_at_10", "peer_precision_at_10", "s_per_iter",
                    "peer_s_per_iter")))  # fmt: skip
    if args.plots:
        from trims.kernels import plots

        plots.als(result, args.plots)
    return result
