"""Traces in the results database (:mod:`trims.evaluation.db`), and finding one to compare with.

A stored trace is its summary (the JSON ``trims trace`` writes) and its spans
(:meth:`trims.tracing.spans.Trace.to_dict`), keyed by trace id.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from trims.errors import NotFound, ValidationError
from trims.evaluation.db import ResultsDB, TraceRecord
from trims.tracing.spans import Trace

log = logging.getLogger(__name__)

__all__ = ["load_summary", "load_trace", "save"]


def save(db_url: str, trace: Trace, summary: dict[str, Any], level: str) -> None:
    """Store ``trace`` and its summary under the trace id."""
    db = ResultsDB(db_url)
    try:
        db.put_trace(
            TraceRecord(
                trace_id=trace.trace_id,
                model=str(summary["model"]),
                framework=str(summary["framework"]),
                level=level,
                created_at=time.time(),
                summary=summary,
                spans=trace.to_dict()["spans"],
            )
        )
    finally:
        db.close()
    log.info("trace %s of %s stored in %s", trace.trace_id, summary["model"], db_url)


def load_trace(db_url: str, trace_id: str) -> tuple[Trace, dict[str, Any]]:
    """The stored trace and its summary; NotFound naming the database."""
    db = ResultsDB(db_url)
    try:
        record = db.get_trace(trace_id)
    finally:
        db.close()
    if record is None:
        raise NotFound(f"no trace {trace_id!r} in {db_url}; list them with the results database")
    return Trace.from_dict({"trace_id": record.trace_id, "spans": record.spans}), record.summary


def load_summary(ref: str, db_url: str | None) -> dict[str, Any]:
    """A trace summary from a JSON file ``trims trace --json`` wrote, or by trace id."""
    path = Path(ref)
    if path.is_file():
        try:
            body = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValidationError(f"{ref}: not a trace summary JSON file: {e}") from e
        if not isinstance(body, dict):
            raise ValidationError(f"{ref}: not a trace summary JSON file (not an object)")
        return body
    if db_url is None:
        raise NotFound(f"{ref!r} is not a file, and there is no results database to look it up in")
    return load_trace(db_url, ref)[1]
