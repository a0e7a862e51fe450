"""One evaluation run: a system under test, a sample set, a scenario and a mode, under LoadGen.

:func:`run_scenario` takes a plain :class:`SampleSet` (preprocessed inputs, optional labels and
a post-processing function), so it does not depend on how a manifest describes a dataset. Mode
``both`` is two LoadGen runs, performance then accuracy, as MLPerf submissions do; the accuracy
run returns every sample's (post-processed) output by sample index, which the accuracy metrics
(:mod:`.accuracy`) compare with the labels. A manifest's run (checks, the model, the system
under test, accuracy) is :mod:`.manifest_run`, built on this.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import ValidationError
from trims.evaluation.harness.loadgen import (
    MODES,
    SCENARIOS,
    LoadGenSettings,
    ScenarioResult,
    run_loadgen,
)
from trims.evaluation.harness.sut import SystemUnderTest

if TYPE_CHECKING:
    pass

__all__ = ["RUN_MODES", "SampleSet", "ScenarioRun", "bare_loop_p50_ms", "run_scenario"]

log = logging.getLogger(__name__)

#: The modes :func:`run_scenario` accepts: LoadGen's two, and both (two runs).
RUN_MODES = (*MODES, "both")
#: Seconds the Offline rate is measured before a run whose expected rate is not given.
CALIBRATION_S = 0.25
#: The Offline query is sized for this many times the calibrated rate (Note [offline
#: calibration]): a system that beats its calibration by less than this still runs long enough.
CALIBRATION_MARGIN = 2.0


@dataclass(frozen=True)
class SampleSet:
    """What a run evaluates: one preprocessed input per sample, in sample-index order."""

    inputs: Sequence[Any]
    #: The label of each sample (same order), for the accuracy metric; None = none known.
    labels: Sequence[Any] | None = None
    #: Applied to each raw output in accuracy mode (e.g. logits -> class id); None = keep raw.
    postprocess: Callable[[Any], Any] | None = None
    name: str = "samples"

    def __post_init__(self) -> None:
        if self.labels is not None and len(self.labels) != len(self.inputs):
            raise ValidationError(
                f"sample set {self.name}: {len(self.labels)} labels for {len(self.inputs)} "
                "inputs; give one label per input"
            )


@dataclass(frozen=True)
class ScenarioRun:
    """The LoadGen results of one :func:`run_scenario` call and, after an accuracy run, each
    sample's post-processed output by sample index."""

    scenario: str
    sut: str
    performance: ScenarioResult | None = None
    accuracy: ScenarioResult | None = None
    outputs: Mapping[int, Any] = field(default_factory=dict, repr=False)
    #: Per stage of a SUT that times its stages (``stage_latencies()``, e.g. the pipeline SUT):
    #: stage -> {"p50", "p90", "p99", "mean"} in ms, over the performance run's queries (the
    #: accuracy run's when there is none); empty for other SUTs.
    stage_latency_ms: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def results(self) -> list[ScenarioResult]:
        return [r for r in (self.performance, self.accuracy) if r is not None]

    @property
    def valid(self) -> bool:
        return all(r.valid for r in self.results)

    def predictions(self) -> list[Any]:
        """The outputs in sample-index order (after an accuracy run, which answers each
        sample once)."""
        return [self.outputs[i] for i in sorted(self.outputs)]


def bare_loop_p50_ms(
    sut: SystemUnderTest, samples: Sequence[Any], seconds: float, min_calls: int = 64
) -> float:
    """The median latency (ms) of a plain loop of ``predict([sample])`` calls for ``seconds``
    (and at least ``min_calls``): the baseline LoadGen's SingleStream p50 is compared with."""
    import statistics
    import time

    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < min_calls:
        x = [samples[len(times) % len(samples)]]
        t0 = time.perf_counter_ns()
        sut.predict(x)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return statistics.median(times)


def run_scenario(
    sut: SystemUnderTest,
    samples: SampleSet,
    scenario: str,
    mode: str = "performance",
    settings: LoadGenSettings | None = None,
    *,
    batch: int = 1,
    workers: int = 1,
    warmup: int = 1,
    log_dir: str | Path | None = None,
) -> ScenarioRun:
    """Run ``sut`` over ``samples`` under LoadGen's ``scenario`` in ``mode``.

    ``batch``: the most samples per ``predict`` call (the Offline batch size to sweep);
    ``workers``: threads calling ``predict`` at once; ``warmup``: ``predict`` calls on the first
    sample before LoadGen starts (a cold function instance, lazy framework initialization),
    not timed; ``log_dir``: keep LoadGen's logs there (one subfolder per mode).
    """
    if scenario not in SCENARIOS:
        raise ValidationError(
            f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}",
            field="scenario",
        )
    if mode not in RUN_MODES:
        raise ValidationError(
            f"unknown mode {mode!r}; choose one of {', '.join(RUN_MODES)}", field="mode"
        )
    if not samples.inputs:
        raise ValidationError(f"sample set {samples.name} is empty", field="samples")
    for _ in range(warmup):
        sut.predict([samples.inputs[0]])
    settings = settings or LoadGenSettings()
    if scenario == "offline" and mode != "accuracy" and _needs_offline_rate(settings):
        rate = CALIBRATION_MARGIN * _calibrate(sut, samples, batch)
        settings = replace(settings, offline_expected_qps=rate)
        log.info("%s on %s: offline expected rate %.1f samples/s (calibrated)", samples.name,
                 sut.name, rate)  # fmt: skip
    _stage_percentiles(sut)  # the warmup's stage times are not the run's
    stage_ms: dict[str, dict[str, dict[str, float]]] = {}
    modes = ("performance", "accuracy") if mode == "both" else (mode,)
    found: dict[str, ScenarioResult] = {}
    outputs: dict[int, Any] = {}
    for one in modes:
        result, raw = run_loadgen(
            sut.predict,
            samples.inputs,
            scenario,
            one,
            settings,
            batch=batch,
            workers=workers,
            log_dir=Path(log_dir) / one if log_dir is not None else None,
        )
        found[one] = result
        stage_ms[one] = _stage_percentiles(sut)
        if one == "accuracy":
            post = samples.postprocess
            outputs = {i: post(out) if post else out for i, out in raw.items()}
    log.info(
        "%s on %s, %s %s: %s",
        samples.name,
        sut.name,
        scenario,
        mode,
        ", ".join(f"{r.mode} {'VALID' if r.valid else 'INVALID'}" for r in found.values()),
    )
    return ScenarioRun(
        scenario=scenario,
        sut=sut.name,
        performance=found.get("performance"),
        accuracy=found.get("accuracy"),
        outputs=outputs,
        stage_latency_ms=stage_ms.get("performance") or stage_ms.get("accuracy", {}),
    )


def _stage_percentiles(sut: SystemUnderTest) -> dict[str, dict[str, float]]:
    """p50/p90/p99/mean (ms) of each stage a SUT with ``stage_latencies()`` timed since it was
    last asked (the asking starts its record afresh); {} for a SUT without stages."""
    stage_latencies = getattr(sut, "stage_latencies", None)
    if stage_latencies is None:
        return {}
    out: dict[str, dict[str, float]] = {}
    for stage, values in stage_latencies().items():
        if len(values):
            ms = np.asarray(values, dtype=np.float64)
            q50, q90, q99 = np.percentile(ms, (50, 90, 99))
            out[stage] = {
                "p50": float(q50),
                "p90": float(q90),
                "p99": float(q99),
                "mean": float(ms.mean()),
            }
    return out


def _needs_offline_rate(settings: LoadGenSettings) -> bool:
    return settings.offline_expected_qps is None and not settings.mlperf_defaults


def _calibrate(sut: SystemUnderTest, samples: SampleSet, batch: int) -> float:
    """Samples per second of ``predict`` on one batch, over about :data:`CALIBRATION_S`.

    Note [offline calibration]: LoadGen sizes the one Offline query from the expected rate
    (LoadGen's default: 1 sample/s); a guess far below the real rate ends the query before
    the min duration and makes the run INVALID, so short runs measure the rate first, as
    MLPerf submitters set it from a previous run. The run then asks for
    :data:`CALIBRATION_MARGIN` times the measured rate: a quarter second of one batch at a time
    underestimates a system that warms up or overlaps its batches (a gateway's Offline runs
    came out 1.4x faster than calibrated and ended before the min duration, INVALID); asking
    for more only makes the one query longer, and LoadGen reports the rate it measured.
    """
    chunk = [samples.inputs[i % len(samples.inputs)] for i in range(batch)]
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < CALIBRATION_S or done == 0:
        sut.predict(chunk)
        done += len(chunk)
    return done / max(elapsed, 1e-9)
