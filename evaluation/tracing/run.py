"""One leveled trace of one model, from settings people write to a :class:`Report`.

Shared by ``trims trace`` and the ``trace`` benchmark function: :func:`make_request` checks
every setting (level, framework, runs, batch, threads) before any model loads, and
:func:`trace` loads the workload, runs it per level and builds the report.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trims.errors import ValidationError
from trims.evaluation.analyses import Report
from trims.evaluation.measure import MeasureSettings
from trims.evaluation.tracing import analyses, workload
from trims.evaluation.tracing.leveled import LeveledResult, TraceSettings, measure_levels
from trims.evaluation.tracing.models import resolve_model
from trims.tracing.levels import Level, parse_level

log = logging.getLogger(__name__)

__all__ = ["MAX_BATCH", "MAX_RUNS", "TraceRequest", "make_request", "trace"]

#: the most timed predicts per level a request may ask for (each level also stops at max_time_s)
MAX_RUNS = 1000
#: the largest batch a request may ask for
MAX_BATCH = 256
#: depths a trace may ask for (``none`` measures nothing)
DEPTHS = ("model", "layer", "library", "kernel", "full")


@dataclass(frozen=True)
class TraceRequest:
    """What to trace, how deep and how long."""

    model: str
    framework: str
    level: Level
    #: timed predicts per level, at most (the stopping rule may stop earlier once stable)
    runs: int
    batch: int
    threads: int
    #: seconds per level before it stops, once min_reps runs are done
    max_time_s: float
    quick: bool

    def settings(self, process: str = "trims trace") -> TraceSettings:
        if self.quick:
            measure = MeasureSettings(
                warmup=1,
                min_reps=min(3, self.runs),
                max_reps=min(self.runs, 10),
                max_time_s=min(self.max_time_s, 0.5),
                clock="wall",
            )
        else:
            measure = MeasureSettings(
                warmup=2,
                min_reps=min(7, self.runs),
                max_reps=self.runs,
                max_time_s=self.max_time_s,
                clock="wall",
            )
        return TraceSettings(level=self.level, measure=measure, process=process)


def make_request(
    model: str,
    *,
    framework: str = "torch",
    level: str | Level = "layer",
    runs: int = 50,
    batch: int = 1,
    threads: int = 1,
    max_time: float = 5.0,
    quick: bool = False,
) -> TraceRequest:
    """A checked :class:`TraceRequest`; ValidationError naming the setting and what it accepts."""
    if not isinstance(model, str) or not model.strip():
        raise ValidationError(
            "model: name a zoo model, a torch:<arch> family model, "
            f"{workload.EXAMPLE}, an .onnx path or an evaluation manifest (name or .yaml path)"
        )
    fw = workload.parse_framework(framework)
    depth = parse_level(level)
    if depth.label not in DEPTHS:
        raise ValidationError(
            f"level: a trace needs a depth; use one of {', '.join(DEPTHS)}", field="level"
        )
    for what, value, low, high in (
        ("runs", runs, 1, MAX_RUNS),
        ("batch", batch, 1, MAX_BATCH),
        ("threads", threads, 1, 256),
        ("max_time", max_time, 0.01, 600.0),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise ValidationError(
                f"{what} must be between {low} and {high}, got {value!r}", field=what
            )
    return TraceRequest(
        model.strip(), fw, depth, int(runs), int(batch), int(threads), float(max_time), bool(quick)
    )


def trace(
    request: TraceRequest, process: str = "trims trace", mxnet_python: str | None = None
) -> tuple[LeveledResult, Report]:
    """Run the leveled measurement and build its report (``mxnet_python``: see
    :func:`trims.evaluation.tracing.workload.load`)."""
    with tempfile.TemporaryDirectory(prefix="trims-trace-") as work:
        w = workload.load(
            resolve_model(request.model, Path(work)),
            request.framework,
            batch=request.batch,
            threads=request.threads,
            mxnet_python=mxnet_python,
        )
        try:
            result = measure_levels(w, request.settings(process))
            try:
                ir = w.ir()
            except ValidationError as e:
                log.warning("model %s: no layer IR, so no FLOPs in the layer table (%s)", w.name, e)
                ir = None
            return result, analyses.report(result, ir)
        finally:
            w.close()
