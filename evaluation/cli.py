"""``trims analyze lowerbound|bricks|layers``: model analyses with tables, JSON and plots."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from trims.evaluation.families import FAMILIES

log = logging.getLogger(__name__)

T = TypeVar("T")

_ZOO = "alexnet,densenet121,inception_v1,inception_v2,resnet50,shufflenet,squeezenet,vgg19,zfnet512"
#: model sets ``--models`` accepts by name, alone or among other models
MODEL_SETS = {"zoo": _ZOO, "families": ",".join(FAMILIES)}


@dataclass(frozen=True)
class AnalyzeSettings:
    """Everything an analysis run needs, built once from argv in :func:`run`."""

    analysis: str
    models: tuple[str, ...]
    frameworks: tuple[str, ...]
    variants: tuple[str, ...]
    threads: int
    batch: int
    granularities: tuple[int, ...]
    db: str
    json_out: Path | None
    plots: Path | None
    force: bool
    max_time_s: float
    min_reps: int
    target_rel: float
    progress: bool
    mxnet_python: str | None


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
        "--db", default="trims-results.sqlite", help="SQLite path or SQLAlchemy URL"
    )
    parser.add_argument("--json", dest="json_out", type=Path, help="write results as JSON here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    parser.add_argument("--force", action="store_true", help="re-measure what the DB already has")
    parser.add_argument(
        "--max-time", type=float, default=0.5, help="seconds per benchmark before it stops"
    )
    parser.add_argument(
        "--min-reps",
        type=int,
        help="timed runs per benchmark, at least (default 7; bricks: 3, then --target-rel)",
    )
    parser.add_argument(
        "--target-rel",
        type=float,
        default=0.02,
        help="bricks: standard error asked of each model's time, measured whole or "
        "reconstructed from bricks, as a fraction of it (default 0.02)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--mxnet-python",
        help="python of the MXNet environment (default: $TRIMS_MXNET_VENV/bin/python or "
        "/tmp/trims-mxnet-venv/bin/python)",
    )


def _settings(args: argparse.Namespace) -> AnalyzeSettings:
    variants = tuple(
        f"{v.strip()},threads={args.threads}" for v in args.variants.split(",") if v.strip()
    )
    return AnalyzeSettings(
        analysis=args.analysis,
        models=_models(args.models),
        frameworks=tuple(f.strip() for f in args.framework.split(",") if f.strip()),
        variants=variants,
        threads=args.threads,
        batch=args.batch,
        granularities=tuple(int(g) for g in args.granularity.split(",") if g.strip()),
        db=args.db,
        json_out=args.json_out,
        plots=args.plots,
        force=args.force,
        max_time_s=args.max_time,
        min_reps=args.min_reps or (3 if args.analysis == "bricks" else 7),
        target_rel=args.target_rel,
        progress=not args.no_progress and sys.stderr.isatty(),
        mxnet_python=args.mxnet_python,
    )


def _models(spec: str) -> tuple[str, ...]:
    """Expand the model sets in ``--models`` and drop repeats, keeping the order."""
    names: list[str] = []
    for item in (m.strip() for m in spec.split(",")):
        for name in MODEL_SETS[item].split(",") if item in MODEL_SETS else [item]:
            if name and name not in names:
                names.append(name)
    return tuple(names)


def _progress(items: Sequence[T], desc: str, enabled: bool) -> Iterable[T]:
    from tqdm import tqdm

    return tqdm(items, desc=desc, disable=not enabled, leave=False, file=sys.stderr)


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    return "\n".join(out)


def _load(settings: AnalyzeSettings) -> list[Any]:
    from trims.evaluation.ir import load_ir

    return [
        load_ir(m, settings.batch)
        for m in _progress(list(settings.models), "loading models", settings.progress)
    ]


def _bencher(settings: AnalyzeSettings, db: Any, framework: str, variant: str) -> Any:
    from trims.evaluation.generator import Bencher
    from trims.evaluation.measure import MeasureSettings

    # one intra-op thread computes on the calling thread, whose CPU time ignores preemption;
    # with more threads only the wall clock sees all the work
    measure = MeasureSettings(
        min_reps=settings.min_reps,
        max_time_s=settings.max_time_s,
        clock="thread" if settings.threads == 1 else "wall",
    )
    return Bencher(
        db, framework, variant, settings.batch, measure, settings.force, settings.mxnet_python
    )


def _write_json(path: Path | None, body: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {path}")


def _layer_json(ir: Any, layer: Any) -> dict[str, Any]:
    return {
        "name": layer.name,
        "op_type": layer.op_type,
        "input_shapes": layer.input_shapes,
        "output_shapes": layer.output_shapes,
        "param_bytes": layer.param_bytes,
        "flops": layer.flops,
        "mem_bytes": layer.mem_bytes,
        "signature": layer.signature,
        "preds": ir.preds[layer.index],
    }


def _layers(settings: AnalyzeSettings) -> int:
    from trims.evaluation.ir import unique_layers

    irs = _load(settings)
    unique = unique_layers(irs)
    rows = [
        [
            ir.name,
            len(ir.layers),
            len({layer.signature for layer in ir.layers}),
            ir.flops / 1e9,
            ir.param_bytes / 2**20,
        ]
        for ir in irs
    ]
    print(_table(["model", "layers", "unique", "GFLOPs(MAC)", "params MiB"], rows))
    total = sum(len(ir.layers) for ir in irs)
    print(f"\n{len(unique)} unique layer configurations across {total} layers")
    _write_json(
        settings.json_out,
        {
            "batch": settings.batch,
            "unique_layers": len(unique),
            "models": [
                {
                    "name": ir.name,
                    "flops": ir.flops,
                    "param_bytes": ir.param_bytes,
                    "layers": [_layer_json(ir, layer) for layer in ir.layers],
                }
                for ir in irs
            ],
        },
    )
    return 0


def _lowerbound(settings: AnalyzeSettings) -> int:
    from trims.evaluation import analyzer, plots
    from trims.evaluation.db import ResultsDB

    irs = _load(settings)
    db = ResultsDB(settings.db)
    try:
        results: list[analyzer.ModelBound] = []
        fusions: list[analyzer.FusionResult] = []
        for framework in settings.frameworks:
            variants = (
                settings.variants
                if framework == "onnxruntime"
                else (f"threads={settings.threads}",)
            )
            benchers = [_bencher(settings, db, framework, v) for v in variants]
            best = analyzer.layer_times(
                irs,
                benchers,
                lambda items, fw=framework: _progress(
                    list(items), f"{fw} layers", settings.progress
                ),
            )
            measured = benchers[0]
            chains: dict[str, float] = {}
            if framework == "onnxruntime":
                fusions = analyzer.fusion(irs, measured, best)
                chains = {f.signature: f.fused_ms for f in fusions}
            for ir in _progress(irs, f"{framework} models", settings.progress):
                results.append(analyzer.bound(ir, measured, best, chains))
    finally:
        db.close()
    rows = [
        [
            r.name,
            r.framework,
            r.measured_ms,
            r.sequential_lb_ms,
            r.parallel_lb_ms,
            r.fused_sequential_lb_ms,
            r.fused_parallel_lb_ms,
            r.measured_ms / r.sequential_lb_ms if r.sequential_lb_ms else float("inf"),
            ", ".join(f"{t.name}({t.op_type})" for t in r.top_layers(2)),
        ]
        for r in results
    ]
    print(
        _table(
            [
                "model",
                "framework",
                "measured ms",
                "seq LB ms",
                "par LB ms",
                "fused seq",
                "fused par",
                "meas/seq",
                "top layers",
            ],
            rows,
        )
    )
    below = [r for r in results if r.measured_ms < r.sequential_lb_ms]
    if below:
        print(
            "\nmeasured below the sequential bound (the framework fuses layers the bound times "
            "one by one; compare the fused bounds): "
            + ", ".join(f"{r.name}/{r.framework}" for r in below)
        )
    if fusions:
        print("\nfusion opportunities (Conv chains, ms):")
        print(
            _table(
                ["chain", "unfused", "fused", "saving"],
                [[f.label, f.unfused_ms, f.fused_ms, f.saving_ms] for f in fusions[:8]],
            )
        )
    primary = [r for r in results if r.framework == settings.frameworks[0]]
    body: dict[str, Any] = {
        "models": [
            {
                "name": r.name,
                "measured_ms": r.measured_ms,
                "sequential_lb_ms": r.sequential_lb_ms,
                "parallel_lb_ms": r.parallel_lb_ms,
                "fused_sequential_lb_ms": r.fused_sequential_lb_ms,
                "fused_parallel_lb_ms": r.fused_parallel_lb_ms,
                "measured_spread_ms": r.measured_spread_ms,
                "gap_ms": r.gap_ms,
                "top_layers": [
                    {"name": t.name, "op_type": t.op_type, "ms": t.best_ms, "variant": t.variant}
                    for t in r.top_layers(5)
                ],
            }
            for r in primary
        ],
        "frameworks": [
            {
                "framework": r.framework,
                "name": r.name,
                "measured_ms": r.measured_ms,
                "sequential_lb_ms": r.sequential_lb_ms,
                "parallel_lb_ms": r.parallel_lb_ms,
            }
            for r in results
        ],
        "fusion": [
            {"chain": f.label, "unfused_ms": f.unfused_ms, "fused_ms": f.fused_ms} for f in fusions
        ],
        "variants": list(settings.variants),
        "batch": settings.batch,
    }
    _write_json(settings.json_out, body)
    if settings.plots:
        settings.plots.mkdir(parents=True, exist_ok=True)
        folder = settings.plots
        print(f"wrote {plots.bounds_vs_measured(primary, folder / 'evaluation_lowerbound.png')}")
        print(f"wrote {plots.layer_breakdown(primary, folder / 'evaluation_layer_breakdown.png')}")
    return 0


def _bricks(settings: AnalyzeSettings) -> int:
    from trims.evaluation import bricks, plots
    from trims.evaluation.db import ResultsDB

    irs = _load(settings)
    db = ResultsDB(settings.db)
    try:
        bencher = _bencher(settings, db, settings.frameworks[0], settings.variants[0])
        studies = bricks.study(
            irs,
            bencher,
            list(settings.granularities),
            lambda items, desc: _progress(items, desc, settings.progress),
            settings.target_rel,
        )
    finally:
        db.close()
    for s in studies:
        print(
            f"\nG={s.granularity}: {s.unique_bricks} unique of {s.total_bricks} bricks; "
            f"benchmarking {s.time_bricks_s:.1f} s with bricks vs {s.time_whole_s:.1f} s whole "
            f"({s.time_whole_s / max(s.time_bricks_s, 1e-9):.2f}x); run-time sharing "
            f"{s.sharing:.2f}x (the most bricks can save when both sides run alike)"
        )
        print(
            _table(
                ["model", "bricks", "measured ms", "estimated ms", "error %"],
                [[m.name, m.bricks, m.measured_ms, m.estimated_ms, m.error_pct] for m in s.models],
            )
        )
    main = studies[0]
    body: dict[str, Any] = {
        "granularity": main.granularity,
        "models": [
            {
                "name": m.name,
                "measured_ms": m.measured_ms,
                "estimated_ms": m.estimated_ms,
                "error_pct": m.error_pct,
            }
            for m in main.models
        ],
        "time_whole_s": main.time_whole_s,
        "time_bricks_s": main.time_bricks_s,
        "by_granularity": [
            {
                "granularity": s.granularity,
                "unique_bricks": s.unique_bricks,
                "total_bricks": s.total_bricks,
                "time_bricks_s": s.time_bricks_s,
                "unique_bricks_ms": s.unique_bricks_ms,
                "sharing": s.sharing,
                "models": [
                    {
                        "name": m.name,
                        "estimated_ms": m.estimated_ms,
                        "error_pct": m.error_pct,
                        "bricks": m.bricks,
                    }
                    for m in s.models
                ],
            }
            for s in studies
        ],
        "variant": settings.variants[0],
        "batch": settings.batch,
        "min_reps": settings.min_reps,
        "target_rel": settings.target_rel,
    }
    _write_json(settings.json_out, body)
    if settings.plots:
        settings.plots.mkdir(parents=True, exist_ok=True)
        path = settings.plots / "evaluation_bricks_error.png"
        print(f"wrote {plots.estimation_error(studies, path)}")
    return 0


def run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    logging.basicConfig(level=logging.WARNING)
    handlers = {"layers": _layers, "lowerbound": _lowerbound, "bricks": _bricks}
    return handlers[settings.analysis](settings)
