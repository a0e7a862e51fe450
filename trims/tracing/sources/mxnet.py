"""MXNet as a span source: the MXNet profiler's operator events as layer spans.

Runs in the MXNet environment (mxnet 1.9.1, its own venv); this module imports mxnet only
inside :func:`profile`, so it imports anywhere. ``with profile(level, process=...) as rec:``
records the operators the block runs (imperative ``mx.nd`` and symbolic) as
:attr:`Level.LAYER` spans with ``op_type`` (the operator, e.g. ``Convolution``), ``name``
(``<op_type>_<k>``, the k-th call in the block) and ``depth`` 0, on track
``(process, "thread <tid>")`` (MXNet's engine thread id). MXNet's engine runs operators
asynchronously: the block ends with ``mx.nd.waitall()`` so every operator it started is
recorded. MXNet does not record input shapes, nor the oneDNN/MKL primitives under an
operator (``library`` is unavailable) and the environment is a CPU build (``kernel`` is
unavailable). Engine bookkeeping (``DeleteVariable``, ``WaitForVar``, ...) is left out.

Note [MXNet profiler session]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
MXNet 1.9's profiler takes ``set_config`` once per process (a second call fails) and its
final ``dump(finished=True)`` ends its output for good. So the first :func:`profile` call
configures it to write one file in a private temp directory (removed at exit), and every
block ends with ``dump(finished=False)``, which appends that block's events to the file
unterminated. We read the bytes past what earlier blocks read and decode the event objects
one by one. A process that configured the MXNet profiler itself cannot use this source.

Note [MXNet clock]
~~~~~~~~~~~~~~~~~~
MXNet stamps events in microseconds of its own clock. At the start of each block we emit a
profiler marker (``Marker.mark``) between two ``time.time_ns()`` readings; the marker's
timestamp names the same instant on MXNet's clock, so ``offset = midpoint - 1000 * ts``. On
Linux MXNet's clock is the Unix clock in microseconds: when the offset is smaller than the
bracket around the marker, the clocks agree and we use offset 0 (no added jitter); otherwise
the marker's offset is applied, accurate to half the bracket (a few microseconds).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trims.tracing.levels import Level
from trims.tracing.sources import NO_CUDA, Recording
from trims.tracing.spans import AttrValue, Span

__all__ = ["NO_LIBRARY", "profile"]

log = logging.getLogger(__name__)

NO_LIBRARY = (
    "MXNet's profiler records operators, not the oneDNN/MKL primitives they call; the "
    "deepest level for mxnet is layer"
)
NO_KERNEL = f"{NO_CUDA}; the MXNet environment is a CPU build"
#: Engine bookkeeping, not model operators.
_ENGINE_OPS = frozenset({"DeleteVariable", "WaitForVar", "WaitForAll", "DeleteOperator"})
_MARKER = "trims.clock"


class _Session:
    """The process's one MXNet profiler configuration (Note [MXNet profiler session])."""

    def __init__(self, mx: Any) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="trims-mxnet-profile-"))
        self.path = self.dir / "profile.json"
        self.offset = 0
        mx.profiler.set_config(
            profile_symbolic=True,
            profile_imperative=True,
            profile_memory=False,
            profile_api=False,
            aggregate_stats=False,
            filename=str(self.path),
        )
        domain = mx.profiler.Domain("trims")
        self.marker = mx.profiler.Marker(domain, _MARKER)
        atexit.register(shutil.rmtree, self.dir, True)

    def new_events(self) -> list[dict[str, Any]]:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read().decode(errors="replace")
        self.offset += len(data.encode())
        return _decode_events(data)


_session: _Session | None = None


@contextlib.contextmanager
def profile(level: Level, *, process: str) -> Iterator[Recording]:
    """Profile the block at ``level`` (layer; deeper levels are reported unavailable).

    The block's own exceptions propagate untouched; a profiler that fails sets
    :attr:`Recording.error` and the block still runs.
    """
    global _session
    rec = Recording()
    if level < Level.LAYER:
        yield rec
        return
    if level >= Level.LIBRARY:
        rec.unavailable[Level.LIBRARY] = NO_LIBRARY
    if level >= Level.KERNEL:
        rec.unavailable[Level.KERNEL] = NO_KERNEL
    import mxnet as mx

    session: _Session | None = None
    offset_ns = 0
    try:
        session = _session = _session or _Session(mx)
        mx.nd.waitall()
        mx.profiler.set_state("run")
        before = time.time_ns()
        session.marker.mark("process")
        after = time.time_ns()
    except Exception as e:
        session = None
        rec.error = f"MXNet profiler failed to start: {type(e).__name__}: {e}"
        log.warning("%s; the block runs without the layer trace", rec.error)
    try:
        yield rec
    finally:
        if session is not None:
            try:
                mx.nd.waitall()
                mx.profiler.set_state("stop")
                mx.profiler.dump(finished=False)
                events = session.new_events()
                offset_ns = _offset_ns(events, before, after)
                rec.spans.extend(_spans(events, offset_ns, process))
            except Exception as e:
                rec.error = f"MXNet profiler failed to stop or report: {type(e).__name__}: {e}"
                log.warning("%s; the layer trace of this block is lost", rec.error)


def _decode_events(data: str) -> list[dict[str, Any]]:
    """The event objects in a (possibly unterminated, possibly concatenated) trace file."""
    decoder = json.JSONDecoder()
    out: list[dict[str, Any]] = []
    i = data.find("[") + 1 if '"traceEvents"' in data[:200] else 0
    while i < len(data):
        j = data.find("{", i)
        if j < 0:
            break
        try:
            obj, i = decoder.raw_decode(data, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _offset_ns(events: list[dict[str, Any]], before: int, after: int) -> int:
    """epoch ns - MXNet ns at the marker (Note [MXNet clock])."""
    marks = [e for e in events if e.get("name") == _MARKER and "ts" in e]
    if not marks:
        return 0
    offset = (before + after) // 2 - int(marks[-1]["ts"]) * 1000
    return 0 if abs(offset) <= (after - before) + 1000 else offset


def _spans(events: list[dict[str, Any]], offset_ns: int, process: str) -> list[Span]:
    """Operator B/E pairs (per thread, nested by a stack) to spans."""
    open_: dict[tuple[Any, str], list[int]] = defaultdict(list)
    calls: dict[str, int] = defaultdict(int)
    pairs: list[tuple[int, int, str, Any]] = []
    for e in events:  # in the order MXNet wrote them: each thread's B before its E
        if e.get("cat") != "operator" or e.get("ph") not in ("B", "E"):
            continue
        key = (e.get("tid"), str(e["name"]))
        if e["ph"] == "B":
            open_[key].append(int(e["ts"]))
        elif open_[key]:
            pairs.append((open_[key].pop(), int(e["ts"]), str(e["name"]), e.get("tid")))
    out: list[Span] = []
    for start, end, name, tid in sorted(pairs):
        if name in _ENGINE_OPS:
            continue
        attrs: dict[str, AttrValue] = {"op_type": name, "name": f"{name}_{calls[name]}", "depth": 0}
        calls[name] += 1
        out.append(
            Span(
                name=name,
                level=Level.LAYER,
                start_ns=start * 1000 + offset_ns,
                end_ns=end * 1000 + offset_ns,
                track=(process, f"thread {tid}"),
                attributes=attrs,
            )
        )
    return out
