"""Chrome trace-event JSON of a :class:`~trims.tracing.spans.Trace` (Perfetto UI, chrome://tracing).

The JSON object format: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData":
{"trace_id": ...}}``. Each span is a complete event (``ph: "X"``) with ``ts``/``dur`` in
microseconds (floats, so nanoseconds survive) from the trace's first span, ``pid``/``tid``
integers numbered per track process and thread in order of first appearance, and ``args``
holding the span's attributes, ``span_id``, ``parent_id`` and ``level``. Metadata events
(``ph: "M"``: ``process_name``, ``thread_name``, plus sort indexes so the rows keep that
order) name every track. The trace's epoch start is kept in ``otherData.start_ns`` so a
reader can go back to Unix time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trims.config import write_atomic
from trims.tracing.spans import Trace

__all__ = ["to_chrome", "write_chrome"]


def to_chrome(trace: Trace) -> dict[str, Any]:
    """The trace as a Chrome trace-event JSON object (see the module docstring)."""
    spans = sorted(trace.spans, key=lambda s: (s.start_ns, -s.end_ns))
    origin = spans[0].start_ns if spans else 0
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    meta: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for s in spans:
        process, thread = s.track
        if process not in pids:
            pid = pids[process] = len(pids) + 1
            meta.append(_meta("process_name", pid, 0, {"name": process}))
            meta.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        pid = pids[process]
        if s.track not in tids:
            tid = tids[s.track] = len(tids) + 1
            meta.append(_meta("thread_name", pid, tid, {"name": thread}))
            meta.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        args: dict[str, Any] = dict(s.attributes)
        args.update(span_id=s.span_id, parent_id=s.parent_id, level=s.level.label)
        events.append(
            {
                "name": s.name,
                "cat": s.level.label,
                "ph": "X",
                "ts": (s.start_ns - origin) / 1000,
                "dur": s.duration_ns / 1000,
                "pid": pid,
                "tid": tids[s.track],
                "args": args,
            }
        )
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"trace_id": trace.trace_id, "start_ns": origin},
    }


def write_chrome(trace: Trace, path: Path | str) -> Path:
    """Write :func:`to_chrome` of the trace to ``path`` atomically; returns the path."""
    out = Path(path)
    write_atomic(out, json.dumps(to_chrome(trace), separators=(",", ":")))
    return out


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
