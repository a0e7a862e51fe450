"""PyTorch as a span source: ``torch.profiler`` operators, oneDNN primitives, CUDA kernels.

``with profile(level, process="worker 42") as rec: model(x)`` fills ``rec`` (a
:class:`~trims.tracing.sources.Recording`) when the block ends:

* ``layer``: every CPU operator ``torch.profiler`` records (``record_shapes``,
  ``profile_memory``) becomes a :attr:`Level.LAYER` span on track
  ``(process, "thread <tid>")`` with ``op_type`` (the operator, e.g. ``aten::conv2d``),
  ``name`` (``<op_type>_<k>``: the k-th call of that operator in the block, so two runs of
  one model name their layers alike), ``input_shapes`` (one JSON list of dimensions per
  input) and ``depth`` (0 for an operator the model called itself, 1 for one that operator
  called, ...). A nested operator's parent is the operator that called it.
* ``library`` (CPU): oneDNN primitives (Note [oneDNN verbose]) as :attr:`Level.LIBRARY`
  spans under the operator that ran them.
* ``kernel`` (CUDA only): CUDA runtime calls (``cudaLaunchKernel``, memcpy, ...) as launch
  spans (``kind: "launch"``) on the calling thread and the kernels they started on track
  ``("cuda:<device>", "stream <id>")``, joined by ``correlation`` (Note [parents] in
  :mod:`trims.tracing.spans`).

Note [torch clock]
~~~~~~~~~~~~~~~~~~
The profiler's event times are offsets from its trace start (``trace_start_ns``), which
Kineto takes from the Unix clock. We convert once: ``epoch_ns = trace_start_ns + offset_ns``.
In case a build's trace start is on another clock, we check it against ``time.time_ns()``
read just before the profiler starts and just after it stops; if it falls outside that
window we use the first reading as the trace start instead (the events then sit late by at
most the profiler's start-up time, and still inside the caller's model span).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from trims.tracing.levels import Level
from trims.tracing.sources import NO_CUDA, Recording
from trims.tracing.spans import AttrValue, Span, new_span_id

__all__ = ["NO_CUDA", "profile"]

log = logging.getLogger(__name__)

#: Names of CUDA runtime/driver calls: launch spans at the kernel level, not layers.
_RUNTIME_CALL = re.compile(r"^(cuda|cu[A-Z])")


@contextlib.contextmanager
def profile(level: Level, *, process: str) -> Iterator[Recording]:
    """Profile the block at ``level`` (layer and deeper; see the module docstring).

    The block's own exceptions propagate untouched; a profiler that fails to start, stop or
    report sets :attr:`Recording.error` and the block still runs.
    """
    import torch

    rec = Recording()
    if level < Level.LAYER:
        yield rec
        return
    cuda = torch.cuda.is_available()
    if level >= Level.KERNEL and not cuda:
        rec.unavailable[Level.KERNEL] = NO_CUDA
    with contextlib.ExitStack() as stack:
        prof: Any = None
        onednn: _OneDnnCapture | None = None
        before_ns = time.time_ns()
        try:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if level >= Level.KERNEL and cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(
                activities=activities, record_shapes=True, profile_memory=True
            )
            stack.enter_context(prof)
        except Exception as e:
            prof = None
            rec.error = f"torch.profiler failed to start: {type(e).__name__}: {e}"
            log.warning("%s; the block runs without the layer trace", rec.error)
        if prof is not None and level >= Level.LIBRARY:
            onednn = _OneDnnCapture()
            try:
                stack.enter_context(onednn)
            except Exception as e:
                onednn = None
                rec.unavailable[Level.LIBRARY] = f"oneDNN verbose capture failed: {e}"
        yield rec
        try:
            stack.close()
        except Exception as e:
            rec.error = f"torch.profiler failed to stop: {type(e).__name__}: {e}"
            log.warning("%s; the layer trace of this block is lost", rec.error)
            return
        after_ns = time.time_ns()
    if prof is None:
        return
    try:
        rec.spans.extend(_spans(prof, process, before_ns, after_ns, kernels=cuda))
        if onednn is not None:
            _add_primitives(rec, onednn, process)
        elif level >= Level.LIBRARY and Level.LIBRARY not in rec.unavailable:
            rec.unavailable[Level.LIBRARY] = "oneDNN verbose capture did not start"
    except Exception as e:
        rec.error = f"torch.profiler events could not be read: {type(e).__name__}: {e}"
        log.warning("%s; the layer trace of this block is lost", rec.error)


def _trace_start_ns(prof: Any, before_ns: int, after_ns: int) -> int:
    """The epoch ns of the profiler's time zero (Note [torch clock])."""
    try:
        start = int(prof.profiler.kineto_results.trace_start_ns())
    except Exception:
        return before_ns
    return start if before_ns <= start <= after_ns else before_ns


def _spans(prof: Any, process: str, before_ns: int, after_ns: int, *, kernels: bool) -> list[Span]:
    from torch.profiler import DeviceType

    zero = _trace_start_ns(prof, before_ns, after_ns)
    events = [
        e
        for e in prof.events()
        if e.device_type == DeviceType.CPU and not e.name.startswith("[memory]")
    ]
    ids = {id(e): new_span_id() for e in events}
    calls: dict[str, int] = defaultdict(int)
    out: list[Span] = []
    for e in events:
        if _RUNTIME_CALL.match(e.name):
            continue  # CUDA runtime calls: launch spans, below
        depth, parent = 0, e.cpu_parent
        while parent is not None:
            depth, parent = depth + 1, parent.cpu_parent
        attrs: dict[str, AttrValue] = {
            "op_type": e.name,
            "name": f"{e.name}_{calls[e.name]}",
            "depth": depth,
            "input_shapes": [json.dumps(list(s)) for s in (e.input_shapes or [])],
        }
        calls[e.name] += 1
        memory = int(getattr(e, "cpu_memory_usage", 0) or 0)
        if memory:
            attrs["cpu_memory_bytes"] = memory
        start = zero + round(e.time_range.start * 1000)
        out.append(
            Span(
                name=e.name,
                level=Level.LAYER,
                start_ns=start,
                end_ns=max(start, zero + round(e.time_range.end * 1000)),
                track=(process, f"thread {e.thread}"),
                span_id=ids[id(e)],
                parent_id=None if e.cpu_parent is None else ids.get(id(e.cpu_parent)),
                attributes=attrs,
            )
        )
    if kernels:
        out.extend(_cuda_spans(prof, process, zero))
    return out


def _cuda_spans(prof: Any, process: str, zero: int) -> list[Span]:
    """Launch and kernel spans from the Kineto events (same clock as the operators)."""
    from torch.profiler import DeviceType

    results = prof.profiler.kineto_results
    shift = zero - int(results.trace_start_ns())
    out: list[Span] = []
    for k in results.events():
        corr = int(k.correlation_id())
        start = int(k.start_ns()) + shift
        end = start + max(0, int(k.duration_ns()))
        if k.device_type() == DeviceType.CUDA:
            out.append(
                Span(
                    name=k.name(),
                    level=Level.KERNEL,
                    start_ns=start,
                    end_ns=end,
                    track=(f"cuda:{k.device_index()}", f"stream {k.device_resource_id()}"),
                    attributes={"correlation": corr, "kind": "kernel"},
                )
            )
        elif _RUNTIME_CALL.match(k.name()) and corr > 0:
            out.append(
                Span(
                    name=k.name(),
                    level=Level.KERNEL,
                    start_ns=start,
                    end_ns=end,
                    track=(process, f"thread {k.start_thread_id()}"),
                    attributes={"correlation": corr, "kind": "launch"},
                )
            )
    return out


# Note [oneDNN verbose]
# ~~~~~~~~~~~~~~~~~~~~~
# oneDNN reports each primitive it executes only through its verbose mode, which prints
# ``onednn_verbose,v1,<timestamp ms>,primitive,exec,cpu,<primitive>,<impl>,...,<time ms>``
# to the C stdout. We turn verbose on around the block (``torch.backends.mkldnn.verbose``)
# with ``ONEDNN_VERBOSE_TIMESTAMP=1`` and point fd 1 at a temp file meanwhile. The timestamp
# is the primitive's start on the Unix clock in ms (microsecond resolution), the last field
# its duration; together they place the primitive in time, and its parent is the deepest
# operator span that overlaps it most. oneDNN reads the timestamp setting once, at its first
# verbose line in the process: if verbose was on earlier without it, lines come without
# timestamps and the library level is reported unavailable rather than guessed from order.
# The redirect is process-wide: whatever other threads print during the block is held and
# written to the real stdout when the block ends. Primitives run through MKL (not oneDNN),
# e.g. ``aten::addmm``'s sgemm, are not visible.


class _OneDnnCapture:
    """fd 1 -> a temp file with oneDNN verbose on; :attr:`lines` after exit."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._saved_fd = -1
        self._file: Any = None
        self._verbose: Any = None

    def __enter__(self) -> _OneDnnCapture:
        import sys

        import torch

        os.environ.setdefault("ONEDNN_VERBOSE_TIMESTAMP", "1")
        sys.stdout.flush()
        _c_fflush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved_fd = os.dup(1)
        os.dup2(self._file.fileno(), 1)
        try:
            self._verbose = torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON)  # type: ignore[no-untyped-call]
            self._verbose.__enter__()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._verbose.__exit__(None, None, None)
        finally:
            self._restore()

    def _restore(self) -> None:
        import sys

        sys.stdout.flush()
        _c_fflush()
        os.dup2(self._saved_fd, 1)
        os.close(self._saved_fd)
        self._file.seek(0)
        text = self._file.read().decode(errors="replace")
        self._file.close()
        other: list[str] = []
        for line in text.splitlines(keepends=True):
            (self.lines if line.startswith("onednn_verbose,") else other).append(line)
        if other:
            sys.stdout.write("".join(other))
            sys.stdout.flush()


def _c_fflush() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def _add_primitives(rec: Recording, capture: _OneDnnCapture, process: str) -> None:
    execs = [line.rstrip("\n").split(",") for line in capture.lines]
    execs = [f for f in execs if "exec" in f[2:5] and "primitive" in f[2:5]]
    if any(f[3] != "primitive" for f in execs):
        rec.unavailable[Level.LIBRARY] = (
            "oneDNN verbose lines carry no timestamps (verbose was on in this process before "
            "tracing set ONEDNN_VERBOSE_TIMESTAMP=1); start the process with it set"
        )
        return
    ops = [s for s in rec.spans if s.level is Level.LAYER]
    for f in execs:
        try:
            start = round(float(f[2]) * 1e6)
            end = start + round(float(f[-1]) * 1e6)
        except ValueError:
            continue
        parent = _best_parent(ops, start, end)
        track = parent.track if parent is not None else (process, "onednn")
        rec.spans.append(
            Span(
                name=f"onednn::{f[6]}",
                level=Level.LIBRARY,
                start_ns=start,
                end_ns=end,
                track=track,
                parent_id=None if parent is None else parent.span_id,
                attributes={
                    "op_type": f[6],
                    "implementation": f[7],
                    "problem": f[-2],
                    "library": "oneDNN",
                },
            )
        )


def _best_parent(ops: list[Span], start: int, end: int) -> Span | None:
    """The operator overlapping [start, end) most; of equal overlaps the deepest (shortest)."""
    best: Span | None = None
    best_key = (0, 0)
    for op in ops:
        overlap = min(op.end_ns, end) - max(op.start_ns, start)
        if overlap < 0 or (overlap == 0 and not (op.start_ns <= start <= op.end_ns)):
            continue
        key = (overlap, -op.duration_ns)
        if best is None or key > best_key:
            best, best_key = op, key
    return best
