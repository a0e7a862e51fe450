"""Leveled measurement: one run per level, each level's latency from the run where it is deepest.

For a depth (``layer``, say) the workload runs untraced, at ``model``, then at ``layer``
(:func:`trims.tracing.levels.levels_up_to`); each run repeats predicts until the estimate is
stable by the stopping rule of :mod:`trims.evaluation.measure` (wall clock: profilers add
threads). A level's latency is the trimmed mean of its run's model spans, and its overhead is
that latency against the untraced one, in percent. So the model latency a user reads comes from
the run with no profiler below it, and the cost of each profiler is measured, not guessed.

Note [paired untraced runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The model level needs no profiler, so its predicts alternate with untraced ones (untraced,
model, untraced, model, ...) and both estimates see the same machine: on a shared host, load
that comes and goes between two separate runs would otherwise show up as "overhead" of tens of
percent either way. Deeper levels cannot alternate (a profiler records everything while it is
on); their overhead is against the same paired untraced estimate.

Note [assembling the trace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
The trace takes one representative predict per level (the timed run closest to that level's
median): the model spans from the model run, the layer spans from the layer run, and so on. A
deeper run's spans are shifted in time so its predict starts where the model run's predict
starts, and each span whose parent was a shallower span of its own run is re-parented to the
span of the trace with the same level, name and ordinal (the model run's predict, the layer
run's operator, ...), or to the model span when there is none. A layer span may therefore end
after the model span it sits in: it was measured in a slower (profiled) run, and its attribute
``run`` says which. Coverage is computed within each run's own predict, before shifting.

Levels the stack cannot provide (``trims.tracing.sources.availability``, or a source that names
a level in ``Recording.unavailable``, or a run that recorded no span at its level) are skipped
and named in :attr:`LeveledResult.unavailable` with the reason, never dropped silently. A
profiler that fails is named in :attr:`LeveledResult.errors`; the predicts still ran.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from trims.errors import ValidationError
from trims.evaluation.measure import Measurement, MeasureSettings, stable, stop_after, summarize
from trims.evaluation.tracing.workload import TracedRuns, Workload
from trims.tracing.levels import Level, levels_up_to
from trims.tracing.spans import Span, Trace, nest, new_trace_id

log = logging.getLogger(__name__)

__all__ = [
    "LevelResult",
    "LeveledResult",
    "TraceSettings",
    "coverage_pct",
    "measure_levels",
    "top_level",
]


@dataclass(frozen=True)
class TraceSettings:
    """How deep and how long a leveled run measures."""

    #: the deepest level (``full``: every level the stack provides)
    level: Level = Level.LAYER
    #: the stopping rule per level; ``max_reps`` bounds the timed predicts of each level
    measure: MeasureSettings = field(
        default_factory=lambda: MeasureSettings(warmup=2, min_reps=7, max_reps=50, clock="wall")
    )
    #: process name of the spans this run records (the Chrome trace's process row)
    process: str = "trims trace"
    #: whether the workload runs on a CUDA device (kernel level); the workloads run on the CPU
    cuda: bool = False

    def __post_init__(self) -> None:
        if self.measure.clock != "wall":
            raise ValidationError("leveled runs use the wall clock: profilers add threads")
        if self.level < Level.MODEL:
            raise ValidationError(
                f"a leveled run needs depth model or deeper, not {self.level.label}"
            )


@dataclass(frozen=True)
class LevelResult:
    """One level's run: its latency (trimmed mean of model spans) and overhead vs untraced."""

    level: Level
    measurement: Measurement
    overhead_pct: float

    @property
    def latency_ms(self) -> float:
        return float(self.measurement.trimmed_mean_ms)


@dataclass
class LeveledResult:
    """Everything a leveled run measured, and the trace assembled from it."""

    model: str
    framework: str
    batch: int
    untraced: Measurement
    levels: list[LevelResult]
    trace: Trace
    #: share of the layer run's predict covered by its top-level layer spans; None without one
    coverage_pct: float | None
    #: level -> why it was not measured
    unavailable: dict[Level, str] = field(default_factory=dict)
    #: level -> the profiler's failure message (its predicts still ran)
    errors: dict[Level, str] = field(default_factory=dict)
    #: the layer run's representative predict duration, the denominator of layer shares
    layer_predict_ns: int | None = None


def _sample(fn: Callable[[], float], settings: MeasureSettings) -> tuple[list[float], float]:
    """Warm up, then time ``fn`` (it returns its own duration in seconds) until stable."""
    start = time.perf_counter()
    for _ in range(settings.warmup):
        fn()
    elapsed = time.perf_counter() - start
    samples: list[float] = []

    def enough(s: list[float]) -> bool:
        return bool(stable(s, settings.rel_tol, settings.abs_tol_ms / 1e3))

    while not stop_after(samples, elapsed, settings, enough):
        dt = fn()
        samples.append(dt)
        elapsed += dt
    return samples, elapsed


def _untraced(workload: Workload) -> float:
    t0 = time.perf_counter()
    own = workload.run()
    return time.perf_counter() - t0 if own is None else own


def _timed(
    runs: TracedRuns,
    predicts: list[Span],
    paired: Workload | None = None,
    untraced_s: list[float] | None = None,
) -> Callable[[], float]:
    """One traced predict per call: keeps its model span, returns its duration in seconds.

    With ``paired``, each call first runs one untraced predict and appends its seconds to
    ``untraced_s`` (Note [paired untraced runs]).
    """

    def once() -> float:
        if paired is not None and untraced_s is not None:
            untraced_s.append(_untraced(paired))
        span = runs.run()
        predicts.append(span)
        return span.duration_ns / 1e9

    return once


def top_level(spans: Iterable[Span], level: Level = Level.LAYER) -> list[Span]:
    """Spans at ``level`` whose parent is not at ``level`` (operators not inside operators)."""
    spans = list(spans)
    at = {s.span_id for s in spans if s.level is level}
    return [s for s in spans if s.level is level and s.parent_id not in at]


def coverage_pct(spans: Iterable[Span], window: Span) -> float:
    """Percent of ``window`` covered by the union of ``spans`` (each clipped to it)."""
    intervals = sorted(
        (max(s.start_ns, window.start_ns), min(s.end_ns, window.end_ns))
        for s in spans
        if s.end_ns > window.start_ns and s.start_ns < window.end_ns
    )
    covered = 0
    current: tuple[int, int] | None = None
    for start, end in intervals:
        if current is None or start > current[1]:
            if current is not None:
                covered += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        covered += current[1] - current[0]
    return 100.0 * covered / window.duration_ns if window.duration_ns else 0.0


def _representative(predicts: Sequence[Span]) -> Span:
    durations = sorted(p.duration_ns for p in predicts)
    median = durations[len(durations) // 2]
    return min(predicts, key=lambda p: abs(p.duration_ns - median))


def _run_spans(spans: Sequence[Span], predict: Span) -> list[Span]:
    """The spans of one predict: its own model spans and source spans centred inside it."""
    out = []
    for s in spans:
        if s.level is Level.MODEL:
            if s is predict or s.parent_id == predict.span_id:
                out.append(s)
        elif predict.start_ns <= (s.start_ns + s.end_ns) // 2 <= predict.end_ns:
            out.append(s)
    return out


def _keys(spans: Iterable[Span]) -> dict[tuple[Level, str, int], Span]:
    """(level, name, ordinal among same level and name in start order) -> span."""
    seen: dict[tuple[Level, str], int] = defaultdict(int)
    out: dict[tuple[Level, str, int], Span] = {}
    for s in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        n = seen[(s.level, s.name)]
        seen[(s.level, s.name)] += 1
        out[(s.level, s.name, n)] = s
    return out


def _graft(trace: list[Span], run: list[Span], level: Level, anchor: Span, predict: Span) -> None:
    """Add the ``level`` spans of one run to ``trace`` (Note [assembling the trace])."""
    offset = anchor.start_ns - predict.start_ns
    in_trace = _keys(trace)
    mapping = {
        s.span_id: in_trace[key].span_id
        for key, s in _keys(x for x in run if x.level < level).items()
        if key in in_trace
    }
    own = {s.span_id for s in run if s.level is level}
    for s in run:
        if s.level is not level:
            continue
        parent = s.parent_id
        if parent not in own:
            parent = mapping.get(parent or "", anchor.span_id)
        trace.append(
            replace(
                s,
                start_ns=s.start_ns + offset,
                end_ns=s.end_ns + offset,
                parent_id=parent,
                attributes={**s.attributes, "run": level.label},
            )
        )


def measure_levels(workload: Workload, settings: TraceSettings) -> LeveledResult:
    """Run ``workload`` untraced and once per level up to ``settings.level``."""
    from trims.tracing.sources import availability

    ms = settings.measure
    results: list[LevelResult] = []
    unavailable: dict[Level, str] = {}
    errors: dict[Level, str] = {}
    trace_spans: list[Span] = []
    anchor: Span | None = None
    coverage: float | None = None
    layer_predict_ns: int | None = None
    untraced: Measurement | None = None
    for level in levels_up_to(settings.level):
        reason = availability(workload.framework, level, cuda=settings.cuda)
        if reason is not None:
            unavailable[level] = reason
            log.warning("%s level %s skipped: %s", workload.name, level.label, reason)
            continue
        predicts: list[Span] = []
        untraced_s: list[float] = []
        paired = workload if level is Level.MODEL else None
        with workload.traced(level, process=settings.process) as runs:
            samples, elapsed = _sample(_timed(runs, predicts, paired, untraced_s), ms)
        if level is Level.MODEL:
            untraced = summarize(untraced_s[ms.warmup :], sum(untraced_s), ms.trim)
        assert untraced is not None  # levels_up_to starts at the model level
        recording = runs.recording
        if recording.error is not None:
            errors[level] = recording.error
            log.warning(
                "%s level %s: profiler failed (%s); predicts ran untraced",
                workload.name,
                level.label,
                recording.error,
            )
        for lv, why in recording.unavailable.items():
            unavailable.setdefault(lv, why)
        measurement = summarize(samples, elapsed, ms.trim)
        overhead = 100.0 * (measurement.trimmed_mean_ms / untraced.trimmed_mean_ms - 1.0)
        if level in unavailable:
            continue
        predict = _representative(predicts[ms.warmup :])
        run = nest(_run_spans(recording.spans, predict))
        if level is Level.MODEL:
            anchor = predict
            trace_spans.extend(run)
        elif not any(s.level is level for s in run):
            unavailable[level] = (
                f"the {workload.framework} profiler recorded no {level.label} spans "
                f"(error: {recording.error})"
                if recording.error
                else f"the {workload.framework} profiler recorded no {level.label} spans here"
            )
            continue
        elif anchor is None:
            unavailable[level] = "no model-level run to attach it to"
            continue
        else:
            _graft(trace_spans, run, level, anchor, predict)
        if level is Level.LAYER:
            coverage = coverage_pct(top_level(run), predict)
            layer_predict_ns = predict.duration_ns
        results.append(LevelResult(level, measurement, overhead))
        log.info(
            "%s/%s level %s: %.2f ms (%+.1f%%) over %d runs",
            workload.name,
            workload.framework,
            level.label,
            measurement.trimmed_mean_ms,
            overhead,
            measurement.reps,
        )
    if untraced is None:
        raise ValidationError(f"{workload.name}: the model level could not run, so nothing was")
    return LeveledResult(
        model=workload.name,
        framework=workload.framework,
        batch=workload.batch,
        untraced=untraced,
        levels=results,
        trace=Trace(new_trace_id(), tuple(trace_spans)),
        coverage_pct=coverage,
        unavailable=unavailable,
        errors=errors,
        layer_predict_ns=layer_predict_ns,
    )
