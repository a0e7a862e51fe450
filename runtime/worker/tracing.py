"""A traced request in the worker: its spans (worker, model, framework) and the reply they ride in.

The gateway asks for a trace by putting a level in the request meta (``"tl"``, see
:mod:`trims.runtime.wire`). The worker then records, as :class:`trims.tracing.spans.Span`:

* a ``service`` span for its part of the request, ``worker <function>``, on track
  ``("worker <pid>", "event loop")``;
* a ``model`` span around the handler (or infer) call, on the thread that ran it, child of the
  worker span;
* below ``model``, what the framework sources record while the call runs at the requested
  level: ``torch.profiler`` through :mod:`trims.tracing.sources.torch` when torch is imported
  in this worker, and ONNX Runtime node events from every session made through trims
  (``model.onnx_session()``) that ran in the call (Note [ONNX Runtime sessions are profiled
  by twins]); parents of those come from time containment (Note [parents] in spans.py),
  resolved by the gateway when it assembles the trace.

The spans go back in the reply meta ``"tr"`` (at most :data:`MAX_SPANS`; the longest are
kept and ``truncated`` says how many were dropped), never in the function's body.

Note [a profiler never fails the call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A profiler that fails to start, or to stop, sets ``error`` and the call runs (or its result
stands) as if untraced: the caller gets the function's answer plus ``trims-trace-error``. Only
the handler's own exceptions propagate.

Note [ONNX Runtime sessions are profiled by twins]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ONNX Runtime enables profiling when a session is created, and a handler makes its sessions in
``init(ctx)``, long before a traced request arrives; profiling every session from the start
would slow every untraced call. So around a call traced at ``layer`` or deeper the worker
activates a :class:`trims.tracing.active.ActiveTrace`; a session made through trims
(:class:`trims.runtime.adapters.onnxruntime.SharedSession`) that runs in the call runs on a
profiled twin built for the call over the same weights (Note [Profiled twins] there), and the
twin's node spans come back through the active trace when the call ends, after the model span
is closed, so collecting them is not timed as the model's work. A session the handler built
itself with ``onnxruntime.InferenceSession`` is not seen: a traced call in which no torch
operators and no trims session ran says so (``layer: unavailable``) with the fix
(``model.onnx_session()``), never silently.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from trims.tracing.active import ActiveTrace, activate
from trims.tracing.levels import Level, levels_up_to, parse_level
from trims.tracing.sources import Recording
from trims.tracing.spans import Span, new_span_id

__all__ = ["MAX_SPANS", "RequestTrace"]

log = logging.getLogger(__name__)

#: Most spans one traced request sends back (a layer trace of ResNet-50 has a few thousand;
#: a kernel trace of a large model can have far more, and the reply meta is JSON).
MAX_SPANS = 20_000

_ORT_UNSEEN = (
    "no torch operators and no ONNX Runtime session made through trims ran: a session the "
    "handler builds itself with onnxruntime.InferenceSession is not profiled; build it with "
    "ctx.models[NAME].onnx_session() (or open_model(...).onnx_session()), whose traced calls "
    "run on a profiled twin"
)
_NO_FRAMEWORK = (
    "this worker ran no framework trims can profile (torch, or an ONNX Runtime session from "
    "model.onnx_session()); the function's own work is the model span"
)


class RequestTrace:
    """The spans of one traced request; :meth:`wrap` the call, then :meth:`finish`."""

    def __init__(self, level: str, function: str, instance: str) -> None:
        self.level = parse_level(level, field="trims-trace-level")
        self.function = function
        self.instance = instance
        self.process = f"worker {os.getpid()}"
        self.start_ns = time.time_ns()
        self.span_id = new_span_id()
        self.spans: list[Span] = []
        self.unavailable: dict[Level, str] = {}
        self.error: str | None = None

    def wrap(self, fn: Callable[..., Any], is_async: bool, name: str) -> Callable[..., Any]:
        """``fn`` run inside the profiler at this trace's level, with a model span around it.

        The wrapper runs where ``fn`` would (the worker's thread pool for a sync handler), so
        the profiler sees the thread that runs the model.
        """
        if is_async:

            async def run_async(*args: Any) -> Any:
                with self._profiled(name):
                    return await fn(*args)

            return run_async

        def run(*args: Any) -> Any:
            with self._profiled(name):
                return fn(*args)

        return run

    @contextlib.contextmanager
    def _profiled(self, name: str) -> Iterator[None]:
        stack = contextlib.ExitStack()
        recording: Recording | None = None
        source = self._source()
        if source is not None:
            try:
                recording = stack.enter_context(source)
            except Exception as e:
                self._failed("start", e)
        active: ActiveTrace | None = None
        if self.level >= Level.LAYER:
            active = stack.enter_context(activate(ActiveTrace(self.level, process=self.process)))
        start = time.time_ns()
        try:
            yield
        finally:
            end = time.time_ns()
            try:
                stack.close()
            except Exception as e:
                self._failed("stop", e)
            self.spans.append(
                Span(
                    name,
                    Level.MODEL,
                    start,
                    end,
                    (self.process, threading.current_thread().name),
                    parent_id=self.span_id,
                    attributes={"function": self.function},
                )
            )
            if active is not None:
                self._take(recording, active.close())

    def _source(self) -> AbstractContextManager[Any] | None:
        """The torch source for this level, or None (no torch here, or below ``layer``)."""
        if self.level <= Level.MODEL or "torch" not in sys.modules:
            return None
        try:
            from trims.tracing.sources import torch as torch_source

            source = torch_source.profile(self.level, process=self.process)
        except Exception as e:
            self._failed("start", e)
            return None
        return source

    def _take(self, torch_recording: Recording | None, ort_recordings: list[Recording]) -> None:
        """The sources' spans, unavailable levels and errors; ``layer`` is unavailable only
        when neither torch nor a trims ONNX Runtime session was profiled (Note [ONNX Runtime
        sessions are profiled by twins])."""
        wanted = set(levels_up_to(self.level))
        recordings = [torch_recording] if torch_recording is not None else []
        for recording in [*recordings, *ort_recordings]:
            for level, reason in recording.unavailable.items():
                if level in wanted:
                    self.unavailable[level] = str(reason)
            if recording.error:
                self.error = f"{self.error}; {recording.error}" if self.error else recording.error
            self.spans.extend(recording.spans)
        if any(s.level is Level.LAYER for s in self.spans) or ort_recordings:
            return
        if "torch" in sys.modules:
            # torch was profiled and ran no operators, or its profiler failed (``error``).
            if torch_recording is not None and "onnxruntime" in sys.modules:
                self.unavailable.setdefault(Level.LAYER, _ORT_UNSEEN)
            return
        self._unavailable_below_model(
            _ORT_UNSEEN if "onnxruntime" in sys.modules else _NO_FRAMEWORK
        )

    def _unavailable_below_model(self, reason: str) -> None:
        for level in levels_up_to(self.level):
            if level > Level.MODEL:
                self.unavailable.setdefault(level, reason)

    def _failed(self, when: str, e: Exception) -> None:
        self.error = f"the {self.level.label} profiler failed to {when}: {type(e).__name__}: {e}"
        log.warning(
            "traced request of %s: %s; the call runs untraced below the model span",
            self.function, self.error,
        )  # fmt: skip

    def finish(self) -> dict[str, Any]:
        """The reply meta's ``"tr"``: spans (worker span first), unavailable levels, error."""
        worker = Span(
            f"worker {self.function}",
            Level.SERVICE,
            self.start_ns,
            time.time_ns(),
            (self.process, "event loop"),
            span_id=self.span_id,
            attributes={"function": self.function, "instance": self.instance},
        )
        spans = [worker, *self.spans]
        truncated = len(spans) - MAX_SPANS
        if truncated > 0:
            head = [s for s in spans if s.level <= Level.MODEL]
            rest = sorted((s for s in spans if s.level > Level.MODEL), key=lambda s: -s.duration_ns)
            spans = head + rest[: max(0, MAX_SPANS - len(head))]
            log.info(
                "traced request of %s: %d spans over the limit of %d dropped (shortest first)",
                self.function, truncated, MAX_SPANS,
            )  # fmt: skip
        out: dict[str, Any] = {"spans": [s.to_dict() for s in spans]}
        if self.unavailable:
            out["unavailable"] = {lv.label: r for lv, r in sorted(self.unavailable.items())}
        if self.error is not None:
            out["error"] = self.error
        if truncated > 0:
            out["truncated"] = truncated
        return out
