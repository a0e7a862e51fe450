"""ONNX Runtime as a span source: its session profiling, node events as layer spans.

ONNX Runtime profiles a session only if profiling was enabled when the session was built,
and records every run from then until ``end_profiling``, which also ends it for good. So a
profiled predict is two steps around the runs::

    sess = ort.InferenceSession(model, session_options(Level.LAYER), providers=[...])
    sess.run(...)                       # as many runs as wanted, each timed by the caller
    rec = collect(sess, process="worker 42")

A model from the store gets the same options through the adapter, which takes them already:
``trims.runtime.adapters.onnxruntime.session(lease, sess_options=session_options(level))``
(``trims.tracing`` is the ground floor and does not import the runtime).

Each node event (``cat: "Node"``, name ``<node>_kernel_time``) becomes a
:attr:`Level.LAYER` span on track ``(process, "thread <tid>")`` with ``op_type`` (the ONNX
op, e.g. ``Conv``; ``ReorderOutput`` and fused nodes as ORT names them), ``name`` (the node
name ORT ran, which after graph optimization may be a fused node), ``input_shapes`` (one
JSON list of dimensions per input), ``provider`` and ``depth`` 0. Clock: the events'
``ts`` are microseconds from ``get_profiling_start_time_ns()`` (Unix epoch ns), so
``epoch_ns = start + 1000 * ts``, converted once here; ORT's resolution is 1 us.

The ``library`` level is unavailable (the CPU execution provider does not expose the MLAS
primitives it calls), and so is ``kernel`` without CUDA.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.tracing.levels import Level
from trims.tracing.sources import NO_CUDA, Recording
from trims.tracing.spans import AttrValue, Span

if TYPE_CHECKING:
    import onnxruntime

__all__ = ["NO_KERNEL_CUDA", "NO_LIBRARY", "collect", "session_options"]

log = logging.getLogger(__name__)

NO_LIBRARY = (
    "ONNX Runtime's CPU execution provider does not expose the library (MLAS) primitives "
    "it calls; the deepest CPU level for onnxruntime is layer"
)
NO_KERNEL_CUDA = (
    "ONNX Runtime's session profiler does not record CUDA kernels with their launches; "
    "trace the kernel level with the torch framework"
)
_PREFIX = "trims-ort-profile-"
_NODE_SUFFIX = "_kernel_time"


def session_options(
    level: Level, base: onnxruntime.SessionOptions | None = None
) -> onnxruntime.SessionOptions:
    """Session options that profile at ``level`` (``base`` is changed in place if given).

    Below ``layer`` profiling stays off. The profile goes to a fresh private directory
    (0700) that :func:`collect` removes with the file.
    """
    import onnxruntime as ort

    options = base if base is not None else ort.SessionOptions()
    if level >= Level.LAYER:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.mkdtemp(prefix=_PREFIX)) / "profile")
    return options


def collect(
    session: onnxruntime.InferenceSession, *, process: str, level: Level = Level.LAYER
) -> Recording:
    """End the session's profiling and turn its node events into spans (module docstring).

    Never raises for the profiler's sake: a profile that cannot be ended or read sets
    :attr:`Recording.error`.
    """
    rec = Recording()
    if level >= Level.LIBRARY:
        rec.unavailable[Level.LIBRARY] = NO_LIBRARY
    if level >= Level.KERNEL:
        rec.unavailable[Level.KERNEL] = _kernel_reason(session)
    try:
        start_ns = int(session.get_profiling_start_time_ns())
        path = session.end_profiling()
    except Exception as e:
        rec.error = f"ONNX Runtime profiling could not be ended: {type(e).__name__}: {e}"
        log.warning("%s; the layer trace of this session is lost", rec.error)
        return rec
    if not path:
        rec.error = (
            "the ONNX Runtime session was not profiling: build it with "
            "session_options(level) to get layer spans"
        )
        return rec
    try:
        events = json.loads(Path(path).read_text())
        rec.spans.extend(_spans(events, start_ns, process))
    except Exception as e:
        rec.error = f"ONNX Runtime profile {path} could not be read: {type(e).__name__}: {e}"
        log.warning("%s; the layer trace of this session is lost", rec.error)
    finally:
        _remove(Path(path))
    return rec


def _spans(events: list[dict[str, Any]], start_ns: int, process: str) -> list[Span]:
    out: list[Span] = []
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith(_NODE_SUFFIX):
            continue
        args = e.get("args") or {}
        begin = start_ns + int(e["ts"]) * 1000
        attrs: dict[str, AttrValue] = {
            "op_type": str(args.get("op_name", "")),
            "name": name[: -len(_NODE_SUFFIX)],
            "depth": 0,
            "input_shapes": [
                json.dumps(list(shape))
                for t in args.get("input_type_shape") or []
                for shape in t.values()
            ],
        }
        if "provider" in args:
            attrs["provider"] = str(args["provider"])
        out.append(
            Span(
                name=str(attrs["name"]),
                level=Level.LAYER,
                start_ns=begin,
                end_ns=begin + int(e.get("dur", 0)) * 1000,
                track=(process, f"thread {e.get('tid', 0)}"),
                attributes=attrs,
            )
        )
    return out


def _kernel_reason(session: Any) -> str:
    with contextlib.suppress(Exception):
        if "CUDAExecutionProvider" in session.get_providers():
            return NO_KERNEL_CUDA
    return NO_CUDA


def _remove(path: Path) -> None:
    """The profile file and, if trims made it, its private directory."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    if path.parent.name.startswith(_PREFIX):
        with contextlib.suppress(OSError):
            os.rmdir(path.parent)
