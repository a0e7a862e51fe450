"""The analyses behind ``trims analyze`` and the ``evaluation`` benchmark function.

Each analysis takes :class:`AnalyzeSettings` and returns a :class:`Report`: the JSON body (its
shape is documented in docs/evaluation.md), the human tables, and a function that draws its
plots into a folder. The command prints and writes them; the benchmark function returns the
body.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from trims.config import results_db
from trims.evaluation.families import FAMILIES
from trims.evaluation.measure import Z95
from trims.tables import text_table

log = logging.getLogger(__name__)

T = TypeVar("T")

_ZOO = "alexnet,densenet121,inception_v1,inception_v2,resnet50,shufflenet,squeezenet,vgg19,zfnet512"
#: model sets ``--models`` accepts by name, alone or among other models
MODEL_SETS = {"zoo": _ZOO, "families": ",".join(FAMILIES)}


@dataclass(frozen=True)
class AnalyzeSettings:
    """Everything an analysis run needs: from argv (``trims analyze``) or a request body."""

    analysis: str
    models: tuple[str, ...]
    frameworks: tuple[str, ...]
    variants: tuple[str, ...]
    threads: int
    batch: int
    granularities: tuple[int, ...]
    db: str
    force: bool
    max_time_s: float
    min_reps: int
    #: bricks: half-width of the 95% confidence interval asked of each model's time, measured
    #: and estimated, as a fraction of it
    precision: float
    #: the fast, rough run (``--quick``): looser precision and budgets, labelled in the output
    quick: bool
    progress: bool
    mxnet_python: str | None
    #: models given as ONNX protos rather than by name (the function's store models), by name
    provided: Mapping[str, Any] = field(default_factory=dict)
    #: seconds per benchmark for those that stop when stable (MXNet's, the fusion chains)
    stable_max_time_s: float = 0.5


def _items(value: str | Sequence[Any]) -> list[str]:
    parts = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    return [p.strip() for p in parts if p.strip()]


def make_settings(
    analysis: str,
    *,
    models: str | Sequence[str] = "zoo",
    framework: str | Sequence[str] = "onnxruntime",
    variants: str | Sequence[str] = "opt=all,opt=extended",
    threads: int = 1,
    batch: int = 1,
    granularity: str | Sequence[int] = "1,5,20",
    db: str | None = None,
    force: bool = False,
    max_time: float | None = None,
    min_reps: int | None = None,
    precision: float | None = None,
    quick: bool = False,
    progress: bool = False,
    mxnet_python: str | None = None,
    provided: Mapping[str, Any] | None = None,
) -> AnalyzeSettings:
    """Settings from the forms people write: comma-separated text or lists, and defaults.

    ``min_reps`` defaults to 7 (3 for bricks and lowerbound, which then follow ``precision``);
    ``max_time`` (seconds per benchmark) to 0.5 (bricks and lowerbound: 60, a guard: their
    precision decides; MXNet's and the fusion chains, which stop when stable, keep 0.5 s);
    ``precision`` to 0.02 (each model's time, measured and estimated or bounded, to +-2% at 95%
    confidence).
    ``quick`` trades accuracy for time: +-5% with at most 2 s per benchmark. Each ONNX Runtime
    variant gets the thread count.
    """
    from trims.errors import ValidationError

    try:
        sizes = tuple(int(g) for g in _items(granularity))
    except ValueError:
        raise ValidationError(
            f"granularity must be whole numbers of layers, got {granularity!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise ValidationError(f"granularity must be one or more sizes >= 1, got {granularity!r}")
    for what, value, low, high in (
        ("threads", threads, 1, 256),
        ("batch", batch, 1, 1024),
        ("min_reps", 1 if min_reps is None else min_reps, 1, 100_000),
        ("max_time", 1.0 if max_time is None else max_time, 1e-3, 3600.0),
        ("precision", 0.02 if precision is None else precision, 1e-3, 0.5),
    ):
        if not low <= value <= high:
            raise ValidationError(f"{what} must be between {low} and {high}, got {value!r}")
    from trims.evaluation.generator import FRAMEWORKS
    from trims.evaluation.ort_backend import OrtVariant

    frameworks = tuple(_items(framework))
    unknown = [f for f in frameworks if f not in FRAMEWORKS] or ([] if frameworks else [""])
    if unknown:
        raise ValidationError(f"unknown framework {unknown[0]!r}; choose from {FRAMEWORKS}")
    keys = tuple(f"{v},threads={threads}" for v in _items(variants))
    for key in keys:
        OrtVariant.parse(key)  # refuses an unknown optimization level now, not after loading
    return AnalyzeSettings(
        analysis=analysis,
        models=expand_models(",".join(_items(models))),
        frameworks=frameworks,
        variants=keys,
        threads=threads,
        batch=batch,
        granularities=sizes,
        db=db if db is not None else results_db(os.environ),
        force=force,
        max_time_s=max_time if max_time is not None else _default_max_time(analysis, quick),
        min_reps=min_reps or (3 if analysis in PRECISION_RULED else 7),
        precision=precision if precision is not None else (0.05 if quick else 0.02),
        quick=quick,
        progress=progress,
        mxnet_python=mxnet_python,
        provided=dict(provided or {}),
        stable_max_time_s=max_time if max_time is not None else STABLE_MAX_TIME_S,
    )


#: the analyses whose benchmarks run until each model's result has the precision asked
PRECISION_RULED = ("bricks", "lowerbound")
#: their run cap per benchmark: high enough that only the time budget stops a benchmark
_MAX_REPS = 1_000_000


#: seconds per benchmark that stops when stable (the layers' rule before the precision one)
STABLE_MAX_TIME_S = 0.5


def _default_max_time(analysis: str, quick: bool) -> float:
    """Seconds per benchmark: a guard where the precision decides, the budget else."""
    if analysis not in PRECISION_RULED:
        return STABLE_MAX_TIME_S
    return 2.0 if quick else 60.0


def _no_plots(folder: Path) -> list[Path]:
    return []


@dataclass
class Report:
    """What an analysis found: the JSON body, human tables, and a way to draw its plots."""

    body: dict[str, Any]
    text: str
    #: draws the analysis' figures into an existing folder and returns their paths
    plot: Callable[[Path], list[Path]] = _no_plots


def expand_models(spec: str) -> tuple[str, ...]:
    """Expand the model sets in ``--models`` and drop repeats, keeping the order."""
    names: list[str] = []
    for item in (m.strip() for m in spec.split(",")):
        for name in MODEL_SETS[item].split(",") if item in MODEL_SETS else [item]:
            if name and name not in names:
                names.append(name)
    return tuple(names)


def _framework_progress(
    framework: str, enabled: bool, items: Sequence[T], desc: str
) -> Iterable[T]:
    return progress(items, f"{framework} {desc}", enabled)


def progress(items: Sequence[T], desc: str, enabled: bool) -> Iterable[T]:
    from tqdm import tqdm

    bar: Iterable[T] = tqdm(items, desc=desc, disable=not enabled, leave=False, file=sys.stderr)
    return bar


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A text table: first column left, the rest right-aligned, floats to 2 decimals."""
    return text_table(headers, rows, align="l" + "r" * len(headers), rule=True, float_format=".2f")


def _load(settings: AnalyzeSettings) -> list[Any]:
    from trims.evaluation import zoo
    from trims.evaluation.ir import load_ir, model_ir

    out = []
    for name in progress(list(settings.models), "loading models", settings.progress):
        given = settings.provided.get(name)
        if given is None:
            out.append(load_ir(name, settings.batch))
        else:  # as graph.load treats a file: light weights become real initializers
            out.append(model_ir(zoo.materialize_constants(given, name), name, settings.batch))
    return out


def _bencher(
    settings: AnalyzeSettings, db: Any, framework: str, variant: str, stable: bool = False
) -> Any:
    """A bencher for the analysis; ``stable``: for benchmarks that stop when stable (the fusion
    chains), which keep the stability rule's run cap and time budget."""
    from trims.evaluation.generator import Bencher
    from trims.evaluation.measure import MeasureSettings

    precision_ruled = settings.analysis in PRECISION_RULED and framework != "mxnet" and not stable
    measure = MeasureSettings(
        min_reps=settings.min_reps,
        # where the precision decides, the time budget alone guards: a 3 us empty model that
        # is subtracted 200 times may need thousands of runs, and they cost milliseconds
        max_reps=_MAX_REPS if precision_ruled else MeasureSettings.max_reps,
        max_time_s=settings.max_time_s if precision_ruled else settings.stable_max_time_s,
        # one intra-op thread computes on the calling thread, whose CPU time ignores
        # preemption; with more threads only the wall clock sees all the work
        clock="thread" if settings.threads == 1 else "wall",
    )
    return Bencher(
        db, framework, variant, settings.batch, measure, settings.force, settings.mxnet_python
    )


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


def layers(settings: AnalyzeSettings) -> Report:
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
    total = sum(len(ir.layers) for ir in irs)
    text = [
        table(["model", "layers", "unique", "GFLOPs(MAC)", "params MiB"], rows),
        f"\n{len(unique)} unique layer configurations across {total} layers",
    ]
    return Report(
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
        "\n".join(text),
    )


def lowerbound(settings: AnalyzeSettings) -> Report:
    from trims.evaluation import analyzer, generator, plots
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
            measured = benchers[0]
            if framework == "mxnet":  # batches in its own process: the stability rule
                times = analyzer.layer_times(
                    irs,
                    benchers,
                    lambda items: progress(list(items), "mxnet layers", settings.progress),
                )
                wholes = {
                    ir.name: measured.run(generator.model_benchmark(ir)).measurement for ir in irs
                }
            else:
                times, wholes = analyzer.precise_times(
                    irs,
                    benchers,
                    settings.precision / Z95,
                    functools.partial(_framework_progress, framework, settings.progress),
                )
            chains: dict[str, analyzer.FusionResult] = {}
            if framework == "onnxruntime":
                chains_bencher = _bencher(settings, db, framework, variants[0], stable=True)
                fusions = analyzer.fusion(irs, chains_bencher, times)
                chains = {f.signature: f for f in fusions}
            for ir in irs:
                results.append(analyzer.bound(ir, framework, wholes[ir.name], times, chains))
    finally:
        db.close()
    rows = [
        [
            r.name,
            r.framework,
            _plus_minus(r.measured_ms, r.measured_se_ms),
            _plus_minus(r.sequential_lb_ms, r.sequential_lb_se_ms)
            + ("" if r.precise else " (imprecise)"),
            _plus_minus(r.parallel_lb_ms, r.parallel_lb_se_ms),
            _plus_minus(r.fused_sequential_lb_ms, r.fused_sequential_lb_se_ms),
            _plus_minus(r.fused_parallel_lb_ms, r.fused_parallel_lb_se_ms),
            r.measured_ms / r.sequential_lb_ms if r.sequential_lb_ms else float("inf"),
            ", ".join(f"{t.name}({t.op_type})" for t in r.top_layers(2)),
        ]
        for r in results
    ]
    text = [
        _heading(settings),
        table(
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
        ),
    ]
    below = [r for r in results if r.measured_ms < r.sequential_lb_ms]
    if below:
        text.append(
            "\nmeasured below the sequential bound (the framework fuses layers the bound times "
            "one by one; compare the fused bounds): "
            + ", ".join(f"{r.name}/{r.framework}" for r in below)
        )
    if fusions:
        text.append("\nfusion opportunities (Conv chains, ms):")
        text.append(
            table(
                ["chain", "unfused", "fused", "saving"],
                [
                    [
                        f.label,
                        _plus_minus(f.unfused_ms, f.unfused_se_ms),
                        _plus_minus(f.fused_ms, f.fused_se_ms),
                        f.saving_ms,
                    ]
                    for f in fusions[:8]
                ],
            )
        )
    primary = [r for r in results if r.framework == settings.frameworks[0]]
    body: dict[str, Any] = {
        "models": [
            {
                "name": r.name,
                "measured_ms": r.measured_ms,
                "measured_ci_ms": _interval(r.measured_ms, r.measured_se_ms),
                "sequential_lb_ms": r.sequential_lb_ms,
                "sequential_lb_ci_ms": _interval(r.sequential_lb_ms, r.sequential_lb_se_ms),
                "precise": r.precise,
                "parallel_lb_ms": r.parallel_lb_ms,
                "parallel_lb_ci_ms": _interval(r.parallel_lb_ms, r.parallel_lb_se_ms),
                "fused_sequential_lb_ms": r.fused_sequential_lb_ms,
                "fused_sequential_lb_ci_ms": _interval(
                    r.fused_sequential_lb_ms, r.fused_sequential_lb_se_ms
                ),
                "fused_parallel_lb_ms": r.fused_parallel_lb_ms,
                "fused_parallel_lb_ci_ms": _interval(
                    r.fused_parallel_lb_ms, r.fused_parallel_lb_se_ms
                ),
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
            {
                "chain": f.label,
                "unfused_ms": f.unfused_ms,
                "unfused_ci_ms": _interval(f.unfused_ms, f.unfused_se_ms),
                "fused_ms": f.fused_ms,
                "fused_ci_ms": _interval(f.fused_ms, f.fused_se_ms),
            }
            for f in fusions
        ],
        "variants": list(settings.variants),
        "batch": settings.batch,
        "precision": settings.precision,
        "confidence": 0.95,
        "quick": settings.quick,
    }

    def draw(folder: Path) -> list[Path]:
        return [
            plots.bounds_vs_measured(primary, folder / "evaluation_lowerbound.png"),
            plots.layer_breakdown(primary, folder / "evaluation_layer_breakdown.png"),
        ]

    return Report(body, "\n".join(text), draw)


def bricks(settings: AnalyzeSettings) -> Report:
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
            lambda items, desc: progress(items, desc, settings.progress),
            settings.precision / Z95,
        )
    finally:
        db.close()
    text = [_heading(settings)]
    for s in studies:
        text.append(
            f"\nG={s.granularity}: {s.unique_bricks} unique of {s.total_bricks} bricks; "
            f"benchmarking {s.time_bricks_s:.1f} s with bricks vs {s.time_whole_s:.1f} s whole "
            f"({s.time_whole_s / max(s.time_bricks_s, 1e-9):.2f}x); run-time sharing "
            f"{s.sharing:.2f}x (the most bricks can save when both sides run alike)"
        )
        text.append(_estimates_table(s.models))
        text.append(_verdicts(s.models))
    main = studies[0]
    body: dict[str, Any] = {
        "granularity": main.granularity,
        "models": [_estimate_json(m) for m in main.models],
        "time_whole_s": main.time_whole_s,
        "time_bricks_s": main.time_bricks_s,
        "by_granularity": [
            {
                "granularity": s.granularity,
                "unique_bricks": s.unique_bricks,
                "total_bricks": s.total_bricks,
                "time_whole_s": s.time_whole_s,
                "time_bricks_s": s.time_bricks_s,
                "unique_bricks_ms": s.unique_bricks_ms,
                "sharing": s.sharing,
                "models": [_estimate_json(m) for m in s.models],
            }
            for s in studies
        ],
        "variant": settings.variants[0],
        "batch": settings.batch,
        "min_reps": settings.min_reps,
        "max_time_s": settings.max_time_s,
        "precision": settings.precision,
        "confidence": 0.95,
        "quick": settings.quick,
    }

    def draw(folder: Path) -> list[Path]:
        return [plots.estimation_error(studies, folder / "evaluation_bricks_error.png")]

    return Report(body, "\n".join(text), draw)


#: the accuracy line a brick estimate is judged against, in percent
LIMIT_PCT = 10.0


def _heading(settings: AnalyzeSettings) -> str:
    """What the analysis measured to: the precision rule, and QUICK for a rough run."""
    what = "estimated" if settings.analysis == "bricks" else "its sequential bound"
    precision = f"each model's time, measured and {what}, to +-{settings.precision:.1%}"
    line = f"{precision} at 95% confidence (budget {settings.max_time_s:g} s per benchmark)"
    if settings.analysis == "lowerbound" and "mxnet" in settings.frameworks:
        line += "; MXNet's benchmarks, run in batches, until stable"
    if settings.quick:
        return f"QUICK RUN (rough, not for comparison): {line}"
    return line


def _estimates_table(models: Sequence[Any]) -> str:
    return table(
        ["model", "bricks", "measured ms", "estimated ms", "corrected", "error %", "95% CI", "10%"],
        [
            [
                m.name,
                m.bricks,
                _plus_minus(m.measured_ms, m.measured_se_ms),
                _plus_minus(m.estimated_ms, m.estimated_se_ms),
                f"{m.correction_pct:.1f}%",
                m.error_pct,
                "[{:+.1f}, {:+.1f}]".format(*m.error_ci_pct),
                m.verdict(LIMIT_PCT) + ("" if m.precise else " (imprecise)"),
            ]
            for m in models
        ],
    )


def _verdicts(models: Sequence[Any]) -> str:
    counts = {
        v: [m.name for m in models if m.verdict(LIMIT_PCT) == v]
        for v in ("within", "straddles", "outside")
    }
    line = f"within {LIMIT_PCT:g}%: {len(counts['within'])} of {len(models)}" + "".join(
        f"; {v}: {', '.join(names)}" for v, names in counts.items() if v != "within" and names
    )
    imprecise = [m.name for m in models if not m.precise]
    if imprecise:
        line += f"; budget spent before the precision asked: {', '.join(imprecise)}"
    return line


def _estimate_json(m: Any) -> dict[str, Any]:
    lo, hi = m.error_ci_pct
    return {
        "name": m.name,
        "bricks": m.bricks,
        "measured_ms": m.measured_ms,
        "measured_ci_ms": _interval(m.measured_ms, m.measured_se_ms),
        "estimated_ms": m.estimated_ms,
        "estimated_ci_ms": _interval(m.estimated_ms, m.estimated_se_ms),
        "error_pct": m.error_pct,
        "error_ci_pct": [lo, hi],
        "within_10pct": m.verdict(LIMIT_PCT),
        "raw_ms": m.raw_ms,
        "overhead_ms": m.overhead_ms,
        "layout_ms": m.layout_ms,
        "floor_ms": m.floor_ms,
        "correction_pct": m.correction_pct,
        "precise": m.precise,
    }


def _plus_minus(value: float, se: float) -> str:
    """``value +- half-width`` of its 95% interval, in two decimals, or as many more (at most
    four) as the half-width needs to show a significant digit: a 4 us interval on a 0.1 ms
    fusion chain reads ``0.100 +-0.004``, not ``0.10 +-0.00``."""
    half = Z95 * se
    decimals = 2
    if 0 < half < 0.01:
        decimals = min(4, -math.floor(math.log10(half)))
    return f"{value:.{decimals}f} +-{half:.{decimals}f}"


def _interval(value: float, se: float) -> list[float]:
    return [value - Z95 * se, value + Z95 * se]


#: analysis name -> the function that runs it
ANALYSES: dict[str, Callable[[AnalyzeSettings], Report]] = {
    "layers": layers,
    "lowerbound": lowerbound,
    "bricks": bricks,
}


def analyze(settings: AnalyzeSettings) -> Report:
    """Run the analysis ``settings.analysis`` names."""
    from trims.errors import NotFound

    try:
        fn = ANALYSES[settings.analysis]
    except KeyError:
        raise NotFound(
            f"no analysis {settings.analysis!r}; choose one of {', '.join(ANALYSES)}"
        ) from None
    return fn(settings)
