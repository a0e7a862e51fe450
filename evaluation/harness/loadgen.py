"""MLPerf LoadGen scenarios: the real ``mlperf_loadgen`` drives a system under test.

:func:`run_loadgen` builds LoadGen's query sample library over an in-memory list of
preprocessed samples, a SUT whose ``issue_queries`` hands LoadGen's queries to worker threads
that call ``predict`` in batches, and the :class:`LoadGenSettings` of a scenario (SingleStream,
MultiStream, Server, Offline) and mode (PerformanceOnly, AccuracyOnly). LoadGen writes its logs
to a temporary directory; the summary (``mlperf_log_summary.txt``) is kept verbatim in the
:class:`ScenarioResult` and the figures come from ``mlperf_log_detail.txt``.

Settings: LoadGen's MLPerf values (``mlperf.conf`` compiled into LoadGen: 10 minutes, per
scenario query counts, the official seeds) are far too long for a 2-core development machine,
so :class:`LoadGenSettings` applies short defaults unless ``mlperf_defaults=True``; every field
left ``None`` keeps LoadGen's value.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from trims.errors import TrimsError, ValidationError

__all__ = [
    "MODES",
    "SCENARIOS",
    "SHORT_DEFAULTS",
    "SHORT_MIN_QUERIES",
    "LoadGenSettings",
    "Predict",
    "ScenarioResult",
    "build_test_settings",
    "parse_detail",
    "run_loadgen",
]

log = logging.getLogger(__name__)

#: Scenario names as the CLI spells them -> LoadGen's TestScenario member.
SCENARIOS: dict[str, str] = {
    "single-stream": "SingleStream",
    "multi-stream": "MultiStream",
    "server": "Server",
    "offline": "Offline",
}
#: Mode names -> LoadGen's TestMode member.
MODES: dict[str, str] = {"performance": "PerformanceOnly", "accuracy": "AccuracyOnly"}

#: ``predict(batch) -> outputs``, one output per input, in order (see :mod:`.sut`).
Predict = Callable[[list[Any]], list[Any]]


@dataclass(frozen=True)
class LoadGenSettings:
    """LoadGen's test settings; ``None`` = LoadGen's own value (see the module docstring).

    With ``mlperf_defaults=False`` (the default) the fields marked *short* below take their
    short value when left ``None``; with ``mlperf_defaults=True`` they keep the values of
    LoadGen's ``mlperf.conf`` for ``mlperf_benchmark``. An explicit value always wins.
    """

    #: True: LoadGen's MLPerf values (mlperf.conf) for every field left None.
    mlperf_defaults: bool = False
    #: The mlperf.conf benchmark whose per-scenario values apply (latency bounds, query counts).
    mlperf_benchmark: str = "resnet50"
    #: Milliseconds a performance run lasts at least. Short: 2000 (MLPerf: 600000).
    min_duration_ms: int | None = None
    #: Milliseconds after which LoadGen stops issuing (0 = no cap). LoadGen's: 0.
    max_duration_ms: int | None = None
    #: Queries a performance run issues at least. Short: 64; 662 MultiStream, 512 Server (what
    #: early stopping needs at p99). MLPerf: 100 to 24576 by scenario.
    min_query_count: int | None = None
    #: Queries after which LoadGen stops issuing (0 = no cap). LoadGen's: 0.
    max_query_count: int | None = None
    #: Samples loaded for a performance run (QSL performance count). None: every sample, at
    #: most 1024 (LoadGen's usual cap, what fits in memory for image sets).
    performance_sample_count: int | None = None
    #: Seeds of the sample order, sample indices and the Server arrival schedule.
    #: LoadGen's: the official seeds of mlperf.conf (both with and without mlperf_defaults).
    qsl_rng_seed: int | None = None
    sample_index_rng_seed: int | None = None
    schedule_rng_seed: int | None = None
    #: Latency percentile each scenario reports as its result (0.9 / 0.99 / 0.99).
    single_stream_target_latency_percentile: float | None = None
    multi_stream_target_latency_percentile: float | None = None
    server_target_latency_percentile: float | None = None
    #: SingleStream/MultiStream: the expected query latency (ms); LoadGen pre-generates
    #: min_duration / expected latency queries, so too high a guess ends the run before its
    #: min duration (INVALID). Short: 0.05 (MLPerf: the benchmark's guess, e.g. 10 ms).
    single_stream_expected_latency_ms: float | None = None
    multi_stream_expected_latency_ms: float | None = None
    #: Samples per MultiStream query. LoadGen's: 8.
    multi_stream_samples_per_query: int | None = None
    #: Server: Poisson arrival rate (queries per second). Short: 100 (LoadGen's: 1).
    server_target_qps: float | None = None
    #: Server: latency bound (ms) the target percentile must meet. Short: 100 (MLPerf: 15).
    server_target_latency_ms: float | None = None
    #: Offline: the expected samples per second (sizes the one query). LoadGen's: 1.
    offline_expected_qps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The short values of LoadGenSettings (applied when mlperf_defaults is False).
SHORT_DEFAULTS: Mapping[str, Any] = {
    "min_duration_ms": 2000,
    "min_query_count": 64,
    "server_target_qps": 100.0,
    "server_target_latency_ms": 100.0,
    "single_stream_expected_latency_ms": 0.05,
    "multi_stream_expected_latency_ms": 0.4,
}

_PLAIN_FIELDS = (
    "min_duration_ms",
    "max_duration_ms",
    "min_query_count",
    "max_query_count",
    "qsl_rng_seed",
    "sample_index_rng_seed",
    "schedule_rng_seed",
    "single_stream_target_latency_percentile",
    "multi_stream_target_latency_percentile",
    "server_target_latency_percentile",
    "multi_stream_samples_per_query",
    "server_target_qps",
    "offline_expected_qps",
)


#: LoadGen's early stopping judges the 99th percentile of MultiStream and Server runs: with
#: fewer queries than these it calls a run INVALID however fast the system is.
SHORT_MIN_QUERIES: Mapping[str, int] = {"multi-stream": 662, "server": 512}

#: Fields in milliseconds -> LoadGen's nanosecond field.
_MS_FIELDS = {
    "server_target_latency_ms": "server_target_latency_ns",
    "single_stream_expected_latency_ms": "single_stream_expected_latency_ns",
    "multi_stream_expected_latency_ms": "multi_stream_expected_latency_ns",
}


@dataclass(frozen=True)
class ScenarioResult:
    """One LoadGen run: its figures, validity and LoadGen's summary text, verbatim."""

    scenario: str
    mode: str
    #: LoadGen's "Result is : VALID"; False for INVALID (reasons in ``invalid_reasons``).
    valid: bool
    #: Scenario-specific throughput: SingleStream/MultiStream samples/s with LoadGen overhead,
    #: Server completed samples/s, Offline samples/s; None in AccuracyOnly mode.
    qps: float | None
    #: p50, p90, p99 and mean latency in milliseconds (per query; empty in AccuracyOnly).
    latency_ms: Mapping[str, float]
    #: mlperf_log_summary.txt as LoadGen wrote it.
    summary: str
    #: The LoadGen settings the run used (effective values, as LoadGen logged them).
    settings: Mapping[str, Any]
    #: Why LoadGen called the run INVALID, in its words (e.g. "Min duration satisfied : NO").
    invalid_reasons: tuple[str, ...] = ()
    #: Queries LoadGen issued (Offline: 1, holding every sample).
    queries: int = 0
    #: Every mlperf_log_detail.txt entry (key -> value), for what the fields above leave out.
    detail: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("detail")
        out["latency_ms"] = dict(self.latency_ms)
        out["settings"] = dict(self.settings)
        out["invalid_reasons"] = list(self.invalid_reasons)
        return out


def _lg() -> Any:
    try:
        import mlperf_loadgen
    except ImportError as e:
        raise TrimsError(
            "MLPerf LoadGen is not installed: pip install mlcommons-loadgen (import mlperf_loadgen)"
        ) from e
    return mlperf_loadgen


def build_test_settings(scenario: str, mode: str, settings: LoadGenSettings) -> Any:
    """LoadGen's TestSettings for ``scenario`` and ``mode`` (CLI names, see SCENARIOS/MODES)."""
    lg = _lg()
    if scenario not in SCENARIOS:
        raise ValidationError(
            f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}",
            field="scenario",
        )
    if mode not in MODES:
        raise ValidationError(
            f"unknown mode {mode!r}; choose one of {', '.join(MODES)} (or both: two runs)",
            field="mode",
        )
    ts = lg.TestSettings()
    ts.scenario = getattr(lg.TestScenario, SCENARIOS[scenario])
    ts.mode = getattr(lg.TestMode, MODES[mode])
    # Note [mlperf.conf]: conf_type 0 loads only the mlperf.conf compiled into LoadGen (its
    # values for this benchmark and scenario, the official seeds); the path is not read.
    if ts.FromConfig("", settings.mlperf_benchmark, SCENARIOS[scenario], 0) != 0:
        raise ValidationError(
            f"LoadGen has no mlperf.conf settings for benchmark {settings.mlperf_benchmark!r}; "
            "use one of MLPerf's names (resnet50, bert, retinanet, ...)",
            field="mlperf_benchmark",
        )
    short = {} if settings.mlperf_defaults else dict(SHORT_DEFAULTS)
    if not settings.mlperf_defaults:
        short["min_query_count"] = SHORT_MIN_QUERIES.get(scenario, short["min_query_count"])
    values = {k: v for k, v in short.items() if getattr(settings, k) is None}
    values.update(
        {k: getattr(settings, k) for k in _PLAIN_FIELDS if getattr(settings, k) is not None}
    )
    for key in _MS_FIELDS:
        if getattr(settings, key) is not None:
            values[key] = getattr(settings, key)
    for key, value in values.items():
        if key in _MS_FIELDS:
            setattr(ts, _MS_FIELDS[key], int(value * 1e6))
        else:
            setattr(ts, key, value)
    return ts


class _Dispatcher:
    """LoadGen's SUT: ``issue_queries`` queues batches; ``workers`` threads call ``predict``.

    Note [issue returns at once]: LoadGen calls ``issue_queries`` on its own issue thread and
    times each query from the moment it was scheduled. In the Server scenario the callback only
    enqueues: blocking there would delay the next Poisson arrival and hide the SUT's queueing
    from the latencies. SingleStream, MultiStream and Offline issue a query only when the
    previous one completed (Offline issues one), so with one worker the batches run inline on
    LoadGen's thread: a thread handoff per query would be harness overhead in the latencies.
    """

    def __init__(
        self,
        predict: Predict,
        samples: Sequence[Any],
        batch: int,
        workers: int,
        keep_outputs: bool,
        inline: bool,
    ) -> None:
        self.predict = predict
        self.samples = samples
        self.batch = batch
        self.keep_outputs = keep_outputs
        self.outputs: dict[int, list[Any]] = {}
        self.error: Exception | None = None
        self._queue: queue.Queue[list[Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._lg = _lg()
        self._inline = inline
        self._threads = [
            threading.Thread(target=self._work, name=f"loadgen-sut-{i}", daemon=True)
            for i in range(0 if inline else workers)
        ]
        for t in self._threads:
            t.start()

    def issue(self, queries: list[Any]) -> None:
        for start in range(0, len(queries), self.batch):
            chunk = queries[start : start + self.batch]
            if self._inline:
                self._answer(chunk)
            else:
                self._queue.put(chunk)

    def flush(self) -> None:
        pass

    def _work(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._answer(chunk)

    def _answer(self, chunk: list[Any]) -> None:
        lg = self._lg
        try:
            outputs = self.predict([self.samples[q.index] for q in chunk])
            if len(outputs) != len(chunk):
                raise TrimsError(
                    f"the system under test answered {len(outputs)} outputs for a batch "
                    f"of {len(chunk)}: predict must return one output per input"
                )
        except Exception as e:  # recorded; run_loadgen raises it after LoadGen ends
            log.exception("system under test failed a batch of %d; the run fails", len(chunk))
            with self._lock:
                self.error = self.error or e
            outputs = [None] * len(chunk)
        if self.keep_outputs:
            with self._lock:
                for q, out in zip(chunk, outputs, strict=True):
                    self.outputs.setdefault(q.index, []).append(out)
        lg.QuerySamplesComplete([lg.QuerySampleResponse(q.id, 0, 0) for q in chunk])

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()


def run_loadgen(
    predict: Predict,
    samples: Sequence[Any],
    scenario: str,
    mode: str,
    settings: LoadGenSettings | None = None,
    *,
    batch: int = 1,
    workers: int = 1,
    log_dir: str | Path | None = None,
) -> tuple[ScenarioResult, dict[int, Any]]:
    """One LoadGen run of ``predict`` over ``samples``; the result and, in accuracy mode, each
    sample's output by sample index (every sample exactly once; empty in performance mode).

    ``batch``: at most this many samples per ``predict`` call (Offline and MultiStream queries
    carry many samples). ``workers``: threads calling ``predict`` concurrently. ``log_dir``:
    keep LoadGen's logs there (default: a temporary directory, removed).
    """
    if not samples:
        raise ValidationError("no samples to run: the sample set is empty", field="samples")
    if batch < 1 or workers < 1:
        raise ValidationError(f"batch and workers must be >= 1, got {batch} and {workers}")
    settings = settings or LoadGenSettings()
    lg = _lg()
    ts = build_test_settings(scenario, mode, settings)
    total = len(samples)
    perf_count = min(total, settings.performance_sample_count or min(total, 1024))
    # mlperf.conf sets the benchmark's own count (1024 for resnet50); a QSL smaller than that
    # must say how many samples it really holds.
    ts.performance_sample_count_override = perf_count
    dispatcher = _Dispatcher(
        predict,
        samples,
        batch,
        workers,
        keep_outputs=mode == "accuracy",
        inline=workers == 1 and scenario != "server",
    )
    sut = lg.ConstructSUT(dispatcher.issue, dispatcher.flush)
    # The samples are already in memory: load and unload have nothing to do.
    qsl = lg.ConstructQSL(total, perf_count, lambda _: None, lambda _: None)
    try:
        with _log_directory(log_dir) as outdir:
            out = lg.LogOutputSettings()
            out.outdir = str(outdir)
            out.copy_summary_to_stdout = False
            out.copy_detail_to_stdout = False
            log_settings = lg.LogSettings()
            log_settings.log_output = out
            log.info(
                "loadgen %s %s over %d samples (batch %d, %d workers), logs in %s",
                scenario,
                mode,
                total,
                batch,
                workers,
                outdir,
            )
            # An audit.config in the working directory would silently change the test: point
            # LoadGen at a name that does not exist.
            lg.StartTestWithLogSettings(sut, qsl, ts, log_settings, str(outdir / "no-audit.config"))
            summary = (outdir / "mlperf_log_summary.txt").read_text()
            detail = parse_detail((outdir / "mlperf_log_detail.txt").read_text())
    finally:
        dispatcher.close()
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)
    if dispatcher.error is not None:
        raise TrimsError(
            f"the system under test failed during the {scenario} run: {dispatcher.error}"
        ) from dispatcher.error
    result = _result(scenario, mode, summary, detail)
    outputs: dict[int, Any] = {}
    if mode == "accuracy":
        outputs = {index: seen[0] for index, seen in dispatcher.outputs.items()}
        # LoadGen does not judge an accuracy run: it is valid when every sample was answered
        # exactly once.
        repeated = sorted(i for i, seen in dispatcher.outputs.items() if len(seen) > 1)
        missing = total - len(outputs)
        reasons = []
        if missing:
            reasons.append(f"{missing} of {total} samples got no output")
        if repeated:
            reasons.append(f"{len(repeated)} samples were answered more than once")
        result = replace(result, valid=not reasons, invalid_reasons=tuple(reasons), queries=total)
    log.info(
        "loadgen %s %s: %s, qps %s, p50 %s ms",
        scenario,
        mode,
        "VALID" if result.valid else "INVALID",
        f"{result.qps:.1f}" if result.qps is not None else "-",
        f"{result.latency_ms['p50']:.3f}" if "p50" in result.latency_ms else "-",
    )
    return result, outputs


@contextlib.contextmanager
def _log_directory(keep: str | Path | None) -> Iterator[Path]:
    """``keep`` (created), or a temporary directory removed afterwards."""
    if keep is not None:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix="trims-loadgen-") as tmp:
        yield Path(tmp)


_MLLOG = re.compile(r":::MLLOG (\{.*\})\s*$")


def parse_detail(text: str) -> dict[str, Any]:
    """``key -> value`` of every ``:::MLLOG`` line of mlperf_log_detail.txt (last one wins;
    ``error``/``warning`` lines are collected in lists under those keys)."""
    out: dict[str, Any] = {}
    for line in text.splitlines():
        m = _MLLOG.search(line)
        if m is None:
            continue
        try:
            doc = json.loads(m.group(1))
        except ValueError:
            continue
        key = doc.get("key")
        if not isinstance(key, str):
            continue
        if key in ("error", "warning"):
            out.setdefault(key, []).append(doc.get("value"))
        else:
            out[key] = doc.get("value")
    return out


def _lines(summary: str) -> Iterator[tuple[str, str]]:
    for line in summary.splitlines():
        if ":" in line:
            key, _, value = line.partition(":")
            yield key.strip(), value.strip()


_QPS_KEYS = {
    "single-stream": "result_qps_with_loadgen_overhead",
    "server": "result_completed_samples_per_sec",
    "offline": "result_samples_per_second",
}


def _result(scenario: str, mode: str, summary: str, detail: Mapping[str, Any]) -> ScenarioResult:
    verdict = detail.get("result_validity")
    if verdict is None:
        verdict = next((v for k, v in _lines(summary) if k == "Result is"), None)
    reasons = [
        f"{k} : {v}"
        for k, v in _lines(summary)
        if k.endswith("satisfied") and v.lower().startswith("no")
    ]
    for key in ("result_invalid_reason", "early_stopping_result"):
        text = detail.get(key)
        if verdict != "VALID" and isinstance(text, str) and text.strip():
            reasons.append(" ".join(text.split()))
    latency: dict[str, float] = {}
    for name, key in (
        ("p50", "result_50.00_percentile_latency_ns"),
        ("p90", "result_90.00_percentile_latency_ns"),
        ("p99", "result_99.00_percentile_latency_ns"),
        ("mean", "result_mean_latency_ns"),
    ):
        value = detail.get(key)
        if isinstance(value, int | float):
            latency[name] = value / 1e6
    qps: Any = detail.get(_QPS_KEYS.get(scenario, ""))
    per_query = detail.get("effective_samples_per_query")
    if scenario == "multi-stream" and latency.get("mean") and isinstance(per_query, int):
        # MultiStream reports query latency only: its throughput is samples per query over
        # the mean query latency.
        qps = per_query * 1000.0 / latency["mean"]
    effective = {
        k.removeprefix("effective_"): v for k, v in detail.items() if k.startswith("effective_")
    }
    queries = detail.get("result_query_count")
    performance = mode == "performance"
    return ScenarioResult(
        scenario=scenario,
        mode=mode,
        valid=verdict == "VALID",
        qps=float(qps) if isinstance(qps, int | float) and performance else None,
        latency_ms=latency if performance else {},
        summary=summary,
        settings=effective,
        invalid_reasons=tuple(reasons),
        queries=int(queries) if isinstance(queries, int | float) else 0,
        detail=dict(detail),
    )
