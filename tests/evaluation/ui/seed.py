"""A results database seeded through ResultsDB's public API with real data types: three
evaluations (two models, two scenarios), one trace whose span tree runs gateway -> worker ->
model -> layers -> kernel, and layer-analysis measurements of one model."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from trims.evaluation.db import (
    AccuracyResult,
    Evaluation,
    EvaluationRecord,
    Latency,
    ResultKey,
    ResultsDB,
    TraceRecord,
)
from trims.evaluation.measure import Measurement
from trims.tracing.levels import Level
from trims.tracing.spans import Span, Trace

#: span names of the seeded trace, in walk order
SPAN_NAMES = (
    "gateway request",
    "worker invoke",
    "model mnist-cnn",
    "conv1 Conv",
    "cudnn conv kernel",
    "relu1 Relu",
    "fc1 Gemm",
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SYSTEM = {"system_id": "Test CPU x2", "cpu": "Test CPU", "cores": 2, "python": "3.11"}


@dataclass(frozen=True)
class Seeded:
    path: Path
    ids: tuple[int, ...]
    run_ids: tuple[str, ...]
    models: tuple[str, ...]
    trace_id: str


def _evaluation(model: str, scenario: str, qps: float, p90: float, acc: float) -> Evaluation:
    return Evaluation(
        manifest_name=model,
        manifest_version="1.0",
        manifest_digest="d" * 64,
        model_digest="e" * 64,
        framework="onnxruntime",
        framework_version="1.17.0",
        executor="local",
        sut="direct",
        scenario=scenario,
        mode="both",
        batch=1,
        threads=1,
        settings={"min_duration_ms": 1000, "min_query_count": 16},
        summary=f"Scenario : {scenario}\nResult is : VALID\nSamples per second: {qps}",
        valid=True,
        qps=qps,
        latency=Latency(p50=p90 * 0.6, p90=p90, p99=p90 * 1.5, mean=p90 * 0.7),
        accuracy=AccuracyResult(
            metric="top1", value=acc, reference=0.98, dataset="digits", samples=360
        ),
    )


def seed_trace() -> Trace:
    t0 = 1_700_000_000_000_000_000
    ms = 1_000_000
    gw = ("gateway", "event loop")
    wk = ("worker 4242", "main")
    spans = [
        Span("gateway request", Level.SERVICE, t0, t0 + 20 * ms, gw, span_id="a" * 16),
        Span("worker invoke", Level.SERVICE, t0 + 1 * ms, t0 + 19 * ms, wk, span_id="b" * 16,
             parent_id="a" * 16),
        Span("model mnist-cnn", Level.MODEL, t0 + 2 * ms, t0 + 18 * ms, wk, span_id="c" * 16,
             parent_id="b" * 16),
        Span("conv1 Conv", Level.LAYER, t0 + 3 * ms, t0 + 9 * ms, wk, span_id="d" * 16,
             parent_id="c" * 16, attributes={"op_type": "Conv"}),
        Span("cudnn conv kernel", Level.KERNEL, t0 + 4 * ms, t0 + 8 * ms, ("cuda:0", "stream 7"),
             span_id="e" * 16, parent_id="d" * 16),
        Span("relu1 Relu", Level.LAYER, t0 + 9 * ms, t0 + 11 * ms, wk, span_id="f" * 16,
             parent_id="c" * 16, attributes={"op_type": "Relu"}),
        Span("fc1 Gemm", Level.LAYER, t0 + 11 * ms, t0 + 17 * ms, wk, span_id="1" * 16,
             parent_id="c" * 16, attributes={"op_type": "Gemm"}),
    ]  # fmt: skip
    return Trace(TRACE_ID, tuple(spans))


def _measurement(ms: float) -> Measurement:
    return Measurement(
        trimmed_mean_ms=ms * 1.1, median_ms=ms * 1.05, spread_ms=ms * 0.1, min_ms=ms, reps=30,
        elapsed_s=1.0,
    )  # fmt: skip


def seed(path: Path) -> Seeded:
    db = ResultsDB(str(path))
    try:
        now = time.time()
        rows = [
            ("mnist-cnn-onnxruntime", "offline", 950.0, 4.0, 0.985),
            ("mnist-cnn-onnxruntime", "single-stream", 310.0, 3.2, 0.985),
            ("digits-mlp", "offline", 4200.0, 0.8, 0.962),
        ]
        ids, run_ids = [], []
        for k, (model, scenario, qps, p90, acc) in enumerate(rows):
            record = EvaluationRecord(
                evaluation=_evaluation(model, scenario, qps, p90, acc),
                run_id=f"{k:08d}-0000-4000-8000-000000000000",
                created_at=now - 3600 * (len(rows) - k),
                system_id=SYSTEM["system_id"],
                system=SYSTEM,
                revision="abc1234",
                dirty=False,
            )
            ids.append(db.put_evaluation(record))
            run_ids.append(record.run_id)
        trace = seed_trace()
        db.put_trace(
            TraceRecord(
                trace_id=trace.trace_id,
                model="mnist-cnn",
                framework="onnxruntime",
                level="kernel",
                created_at=now,
                summary={
                    "model": "mnist-cnn",
                    "framework": "onnxruntime",
                    "untraced_ms": 15.2,
                    "coverage_pct": 87.5,
                    "spans": len(trace.spans),
                    "levels": [
                        {"level": "model", "latency_ms": 15.4, "overhead_pct": 1.3, "runs": 20}
                    ],
                    "layers": [{"name": "conv1", "op_type": "Conv", "latency_ms": 6.0}],
                    "trace_id": trace.trace_id,
                },
                spans=trace.to_dict()["spans"],
            )
        )
        for kind, signature, label, ms in (
            ("layer", "sig-conv1", "mnist-cnn/conv1 Conv", 5.0),
            ("layer", "sig-relu1", "mnist-cnn/relu1 Relu", 1.0),
            ("layer", "sig-fc1", "mnist-cnn/fc1 Gemm", 4.0),
            ("model", "sig-model", "mnist-cnn", 12.0),
        ):
            key = ResultKey(
                system=SYSTEM["system_id"], framework="onnxruntime", framework_version="1.17.0",
                kind=kind, signature=signature, batch=1, variant="threads=1",
            )  # fmt: skip
            db.put(key, _measurement(ms), label)
    finally:
        db.close()
    return Seeded(
        path=path,
        ids=tuple(ids),
        run_ids=tuple(run_ids),
        models=("mnist-cnn-onnxruntime", "digits-mlp"),
        trace_id=TRACE_ID,
    )
