"""Stand-ins for the evaluate and trace benchmark functions, deployed by the UI tests under
those names: each records a result in the database named by its config (``db``) and answers
as the real one does. When the config names a ``gate`` (a Unix socket the test listens on),
the handler first connects to it and blocks until the test answers, so a test sees the run
while it is still running."""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any

from trims.evaluation.db import (
    Evaluation,
    EvaluationRecord,
    Latency,
    ResultsDB,
    TraceRecord,
)
from trims.runtime.functions.context import Context, Request


def _wait(ctx: Context) -> None:
    gate = ctx.config.get("gate")
    if gate:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(gate)
            sock.recv(16)


def evaluate(request: Request, ctx: Context) -> dict[str, Any]:
    body = request.json()
    _wait(ctx)
    record = EvaluationRecord(
        evaluation=Evaluation(
            manifest_name=body["models"][0],
            manifest_version="1.0",
            manifest_digest="d" * 64,
            model_digest="e" * 64,
            framework="onnxruntime",
            framework_version="1.17.0",
            executor="local",
            sut="direct",
            scenario=body.get("scenario", "single-stream"),
            mode=body.get("mode", "performance"),
            batch=body.get("batch", 1),
            settings=body.get("settings", {}),
            summary="Result is : VALID",
            valid=True,
            qps=123.0,
            latency=Latency(p50=1.0, p90=2.0, p99=3.0, mean=1.2),
        ),
        run_id=str(uuid.uuid4()),
        created_at=time.time(),
        system_id="Test CPU x2",
        system={"system_id": "Test CPU x2"},
        revision="abc1234",
        dirty=False,
    )
    if ctx.config.get("record", True):
        db = ResultsDB(str(ctx.config["db"]))
        try:
            db.put_evaluation(record)
        finally:
            db.close()
    return {"system": {}, "evaluations": [{"run_id": record.run_id, "model": body["models"][0]}]}


def trace(request: Request, ctx: Context) -> dict[str, Any]:
    body = request.json()
    _wait(ctx)
    trace_id = uuid.uuid4().hex
    t0 = time.time_ns()
    spans = [
        {
            "name": f"model {body['model']}",
            "level": "model",
            "start_ns": t0,
            "end_ns": t0 + 5_000_000,
            "track": ["trace function", "main"],
            "span_id": "a" * 16,
            "parent_id": None,
            "attributes": {},
        }
    ]
    db = ResultsDB(str(ctx.config["db"]))
    try:
        db.put_trace(
            TraceRecord(
                trace_id,
                body["model"],
                body["framework"],
                body["level"],
                time.time(),
                {"model": body["model"], "trace_id": trace_id},
                spans,
            )
        )
    finally:
        db.close()
    return {"model": body["model"], "trace_id": trace_id}


def echo(request: Request, ctx: Context) -> bytes:
    return request.body
