"""A traced request in the worker: its spans (worker, model, framework) and the reply they ride in.

The gateway asks for a trace by putting a level in the request meta (``"tl"``, see
:mod:`trims.runtime.wire`). The worker then records, as :class:`trims.tracing.spans.Span`:

* a ``service`` span for its part of the request, ``worker <function>``, on track
  ``("worker <pid>", "event loop")``;
* a ``model`` span around the handler (or infer) call, on the thread that ran it, child of the
  worker span;
* below ``model``, what the framework source records while the call runs at the requested level
  (``torch.profiler`` through :mod:`trims.tracing.sources.torch` when torch is imported in
  this worker); parents of those come from time containment (Note [parents] in spans.py),
  resolved by the gateway when it assembles the trace.

The spans go back in the reply meta ``"tr"`` (at most :data:`MAX_SPANS`; the longest are
kept and ``truncated`` says how many were dropped), never in the function's body.

Note [a profiler never fails the call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A profiler that fails to start, or to stop, sets ``error`` and the call runs (or its result
stands) as if untraced: the caller gets the function's answer plus ``trims-trace-error``. Only
the handler's own exceptions propagate.

Note [ONNX Runtime sessions are not profiled]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
ONNX Runtime enables profiling when a session is created, and a handler makes its sessions in
``init(ctx)``, long before a traced request arrives; profiling every session from the start
would slow every untraced call. So a traced call that ran no torch operators in a worker
where onnxruntime is imported says so (``layer: unavailable``) with the way to get ORT node
spans (``trims trace MODEL --framework onnxruntime``), never silently.
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

from trims.tracing.levels import Level, levels_up_to, parse_level
from trims.tracing.spans import Span, new_span_id

__all__ = ["MAX_SPANS", "RequestTrace"]

log = logging.getLogger(__name__)

#: Most spans one traced request sends back (a layer trace of ResNet-50 has a few thousand;
#: a kernel trace of a large model can have far more, and the reply meta is JSON).
MAX_SPANS = 20_000

_ORT_UNPROFILED = (
    "no torch operators ran, and ONNX Runtime sessions made in init are not profiled "
    "(profiling must be enabled when a session is created); trace the model with "
    "`trims trace MODEL --framework onnxruntime` for its node spans"
)
_NO_FRAMEWORK = (
    "this worker has no framework trims can profile loaded (torch); the function's own "
    "work is the model span"
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
        recording: Any = None
        source = self._source()
        if source is not None:
            try:
                recording = stack.enter_context(source)
            except Exception as e:
                self._failed("start", e)
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
            if recording is not None:
                self._take(recording)

    def _source(self) -> AbstractContextManager[Any] | None:
        """The framework source for this level, or None (and why, in ``unavailable``)."""
        if self.level <= Level.MODEL:
            return None
        if "torch" not in sys.modules:
            self._unavailable_below_model(
                _ORT_UNPROFILED if "onnxruntime" in sys.modules else _NO_FRAMEWORK
            )
            return None
        try:
            from trims.tracing.sources import torch as torch_source

            source = torch_source.profile(self.level, process=self.process)
        except Exception as e:
            self._failed("start", e)
            return None
        return source

    def _take(self, recording: Any) -> None:
        wanted = set(levels_up_to(self.level))
        for level, reason in recording.unavailable.items():
            if level in wanted:
                self.unavailable[level] = str(reason)
        if recording.error:
            self.error = str(recording.error)
        self.spans.extend(recording.spans)
        ran_layers = any(s.level is Level.LAYER for s in recording.spans)
        if not ran_layers and "onnxruntime" in sys.modules and Level.LAYER in wanted:
            self.unavailable.setdefault(Level.LAYER, _ORT_UNPROFILED)

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
