"""Chrome trace-event JSON: the structure Perfetto UI and chrome://tracing load."""

from __future__ import annotations

import json
from pathlib import Path

from tests.trims.tracing.traces import T0, sample_trace
from trims.tracing.chrome import to_chrome, write_chrome
from trims.tracing.spans import Trace


def test_every_event_is_complete_and_every_track_named(tmp_path: Path) -> None:
    trace = sample_trace()
    path = write_chrome(trace, tmp_path / "out" / "t.trace.json")
    doc = json.loads(path.read_text())
    assert doc["displayTimeUnit"] == "ms"
    assert doc["otherData"] == {"trace_id": trace.trace_id, "start_ns": T0}
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert len(xs) == len(trace.spans)
    for e in xs:
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {e["pid"] for e in xs} <= set(procs)
    assert {(e["pid"], e["tid"]) for e in xs} <= set(threads)
    assert sorted(procs.values()) == ["gateway", "worker 4242"]
    assert sorted(threads.values()) == ["event loop", "thread 1", "thread 2"]
    # two tracks of one process share its pid, with distinct tids
    worker = next(p for p, n in procs.items() if n == "worker 4242")
    assert len({tid for (pid, tid) in threads if pid == worker}) == 2


def test_times_args_and_parents_survive() -> None:
    trace = sample_trace()
    doc = to_chrome(trace)
    by_name = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    conv = by_name["aten::conv2d"]
    assert conv["ts"] == 1100.0 and conv["dur"] == 3900.123
    assert conv["args"]["op_type"] == "aten::conv2d" and conv["args"]["level"] == "layer"
    assert conv["args"]["parent_id"] == by_name["predict"]["args"]["span_id"]
    assert by_name["predict"]["args"]["parent_id"] == by_name["invoke"]["args"]["span_id"]
    assert conv["cat"] == "layer"


def test_empty_trace_is_valid() -> None:
    doc = to_chrome(Trace("0" * 31 + "1", ()))
    assert doc["traceEvents"] == [] and json.dumps(doc)
