"""The trace active in the calling context: how code far below the worker joins a traced request.

The worker activates an :class:`ActiveTrace` around a call traced at ``layer`` or deeper
(``with activate(ActiveTrace(level, process=...)):``); code that can profile on its own but is
not called by the worker (a framework adapter: the ONNX Runtime ``SharedSession``) looks it up
with :func:`current` and, when there is one, profiles through it::

    active = current()                  # one ContextVar lookup: all an untraced call pays
    if active is None:
        return session.run(...)
    twin = active.resource(key, start=make_profiled, finish=collect_it)
    ...

Both sides need it and neither may import the other's package, so it sits on the ground floor.
The context is the :mod:`contextvars` one: the worker runs a sync handler in its thread pool
under a copy of the request's context, so the handler's own calls see the trace; threads the
handler starts itself do not (their work is outside the trace, as it is outside the call).

Note [one resource per key and traced call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A profiler that must exist before the work it observes (an ONNX Runtime session profiles only
if built profiling) is a *resource* of the traced call: made by ``start`` the first time its
key is asked for, reused by every later ask in the same call, and finished once, by ``finish``,
when the worker :meth:`closes <ActiveTrace.close>` the trace after the call; the
:class:`Recording` ``finish`` returns joins the trace. A ``start`` that raises is recorded as
the trace's error and remembered (``resource`` then answers None, and the caller runs
untraced): a profiler never fails the call it observes, and is not retried on every run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from trims.tracing.levels import Level
from trims.tracing.sources import Recording

__all__ = ["ActiveTrace", "activate", "current"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_ACTIVE: ContextVar[ActiveTrace | None] = ContextVar("trims_active_trace", default=None)


class ActiveTrace:
    """A traced call as code below the worker sees it: its level, its process name, and where
    recordings go (see the module docstring)."""

    def __init__(self, level: Level, *, process: str) -> None:
        self.level = level
        #: The track process name spans recorded for this call use (e.g. ``"worker 4242"``).
        self.process = process
        self._recordings: list[Recording] = []
        #: key -> (resource or None when its start failed, its finish).
        self._resources: dict[object, tuple[Any, Callable[[Any], Recording]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def add(self, recording: Recording) -> None:
        """Hand a finished recording to the trace."""
        with self._lock:
            self._recordings.append(recording)

    def resource(
        self, key: object, start: Callable[[], T], finish: Callable[[T], Recording]
    ) -> T | None:
        """The call's resource under ``key`` (hashable; ``str(key)`` names it in errors),
        started on first ask; None if it failed to start or the trace is closed (Note [one
        resource per key and traced call])."""
        with self._lock:
            if self._closed:
                return None
            if key in self._resources:
                return self._resources[key][0]  # type: ignore[no-any-return]
            try:
                made: Any = start()
            except Exception as e:
                made = None
                error = f"the profiler for {key} failed to start: {type(e).__name__}: {e}"
                self._recordings.append(Recording(error=error))
                log.warning("%s; its work runs untraced in this call", error)
            self._resources[key] = (made, finish)
            return made  # type: ignore[no-any-return]

    def close(self) -> list[Recording]:
        """Finish every resource (in the order they started) and return all recordings.

        A ``finish`` that raises becomes a recording with its error; later asks for a resource
        answer None.
        """
        with self._lock:
            self._closed = True
            resources = list(self._resources.items())
            self._resources.clear()
        finished: list[Recording] = []
        for key, (made, finish) in resources:
            if made is None:
                continue
            try:
                finished.append(finish(made))
            except Exception as e:
                error = f"the profiler for {key} failed to stop: {type(e).__name__}: {e}"
                log.warning("%s; its spans of this call are lost", error)
                finished.append(Recording(error=error))
        with self._lock:
            return [*self._recordings, *finished]


def current() -> ActiveTrace | None:
    """The trace active in this context, or None (the untraced case)."""
    return _ACTIVE.get()


@contextlib.contextmanager
def activate(trace: ActiveTrace) -> Iterator[ActiveTrace]:
    """Make ``trace`` the active one for the block (in this context only)."""
    token = _ACTIVE.set(trace)
    try:
        yield trace
    finally:
        _ACTIVE.reset(token)
