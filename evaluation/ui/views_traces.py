"""Traces: the stored ones (results database) and the gateway's kept ones, each as a summary,
an SVG timeline of its span tree and a Chrome trace-event download (opens in Perfetto)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from trims.errors import AccessError, NotFound, RequestError
from trims.evaluation.db import ResultsDB, TraceInfo, TraceRecord
from trims.evaluation.ui.data import DatabaseMissing
from trims.evaluation.ui.render import render
from trims.evaluation.ui.state import require_read, session_of, state_of
from trims.evaluation.ui.timeline import LEVEL_COLOURS, timeline_svg
from trims.tracing.levels import Level
from trims.tracing.spans import Trace

__all__ = ["trace", "traces"]

_TRACE_ID = re.compile(r"[0-9a-f]{1,64}")


@dataclass(frozen=True)
class Found:
    """A trace and where it came from (``database`` or ``gateway``)."""

    trace: Trace
    source: str
    summary: dict[str, Any]
    meta: dict[str, Any]


async def traces(request: web.Request) -> web.Response:
    await require_read(request)
    state = state_of(request)
    db_error = ""
    stored: list[TraceInfo] = []
    try:
        stored = await state.results.call(lambda db: db.trace_infos())
    except DatabaseMissing as e:
        db_error = e.message
    kept: list[dict[str, str]] = []
    kept_error = ""
    try:
        doc = await state.api.call(request, "GET", "/v1/traces", token=session_of(request).token)
        kept = [  # newest first: trace_id, function, level
            {k: str(t.get(k, "")) for k in ("trace_id", "function", "level")}
            for t in (doc or {}).get("traces", [])
            if isinstance(t, dict) and _TRACE_ID.fullmatch(str(t.get("trace_id", "")))
        ]
    except AccessError:
        kept_error = (
            "Reading the traces the gateway keeps needs the trace scope (or admin): log in "
            "with such a token to list them."
        )
    return render(
        request,
        "traces.html",
        stored=stored,
        kept=kept,
        db_error=db_error,
        kept_error=kept_error,
    )


async def _find(request: web.Request, trace_id: str) -> Found:
    state = state_of(request)

    def read(db: ResultsDB) -> TraceRecord | None:
        return db.get_trace(trace_id)

    try:
        record = await state.results.call(read)
    except DatabaseMissing:
        record = None
    if record is not None:
        return Found(
            Trace.from_dict({"trace_id": record.trace_id, "spans": record.spans}),
            "database",
            record.summary,
            {
                "model": record.model,
                "framework": record.framework,
                "level": record.level,
                "created_at": record.created_at,
            },
        )
    try:
        doc = await state.api.call(
            request, "GET", f"/v1/traces/{trace_id}", token=session_of(request).token
        )
    except NotFound:
        raise NotFound(
            f"no trace {trace_id!r}: the results database ({state.results.url}) does not hold "
            "it and the gateway no longer keeps it (it keeps the newest traces only)"
        ) from None
    meta = {k: doc.get(k) for k in ("function", "level", "truncated", "error") if k in doc}
    return Found(Trace.from_dict(doc), "gateway", {}, meta)


async def trace(request: web.Request) -> web.StreamResponse:
    await require_read(request)
    trace_id = request.match_info["trace_id"]
    if not _TRACE_ID.fullmatch(trace_id):
        raise NotFound(f"no trace {trace_id!r}: a trace id is lower-case hex digits")
    fmt = request.query.get("format", "html")
    if fmt not in ("html", "chrome"):
        raise RequestError(f"format: use html or chrome, got {fmt!r}")
    found = await _find(request, trace_id)
    if fmt == "chrome":
        from trims.tracing.chrome import to_chrome

        return web.Response(
            body=json.dumps(to_chrome(found.trace)).encode(),
            content_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="{trace_id}.trace.json"'},
        )
    summary = found.summary
    layers = sorted(summary.get("layers") or [], key=lambda r: -float(r.get("latency_ms") or 0))
    return render(
        request,
        "trace.html",
        trace_id=trace_id,
        source=found.source,
        meta=found.meta,
        summary=summary,
        levels=summary.get("levels") or [],
        layers=layers[:25],
        timeline=timeline_svg(found.trace),
        colours=[(lv.label, c) for lv, c in LEVEL_COLOURS.items() if lv is not Level.NONE],
    )
