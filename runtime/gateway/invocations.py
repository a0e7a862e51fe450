"""Asynchronous invocations: accepted with 202 and an id, the result fetched later.

Each record runs as a named task; finished records are kept ``ttl_s`` seconds and at most
``capacity`` records exist (the oldest finished ones go first; when every record is still
running, a new one is refused with 429).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

from trims.errors import NotFound, QueueFull, TrimsError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """What a finished invocation answered.

    Note [case-insensitive headers]: workers send header names lower-cased (``content-type``)
    while the gateway and handlers write ``Content-Type``; ``headers`` is therefore always a
    read-only :class:`multidict.CIMultiDictProxy`, whatever mapping it was built from, so every
    lookup (a pipeline passing a step's content type on, an async result record) finds it.
    """

    status: int
    headers: Mapping[str, str]
    body: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.headers, CIMultiDictProxy):
            object.__setattr__(self, "headers", CIMultiDictProxy(CIMultiDict(self.headers)))


@dataclass(eq=False)
class Invocation:
    id: str
    function: str
    created: float = field(default_factory=time.time)
    #: The pipeline this invocation runs (``function`` is then its first step's function).
    pipeline: str | None = None
    #: Every function the invocation calls, which a caller reading it must be allowed to
    #: invoke; empty = just ``function``.
    functions: tuple[str, ...] = ()
    finished: float | None = None
    outcome: Outcome | None = None
    error: TrimsError | None = None

    @property
    def invokes(self) -> tuple[str, ...]:
        """The functions whose invoke scope reading this record needs."""
        return self.functions or (self.function,)

    @property
    def state(self) -> str:
        if self.finished is None:
            return "running"
        return "failed" if self.error is not None else "succeeded"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "function": self.function,
            **({"pipeline": self.pipeline} if self.pipeline is not None else {}),
            "state": self.state,
            "created": self.created,
            "finished": self.finished,
        }
        if self.outcome is not None:
            out["result"] = _result_dict(self.outcome)
        if self.error is not None:
            out["error"] = {"code": self.error.code, "message": self.error.message}
        return out


def _result_dict(outcome: Outcome) -> dict[str, Any]:
    result: dict[str, Any] = {
        "status": outcome.status,
        "content_type": outcome.headers.get("Content-Type", "application/octet-stream"),
    }
    traced = {k.lower(): v for k, v in outcome.headers.items() if _is_trace_header(k)}
    if traced:
        result["trace"] = traced
    timing = outcome.headers.get("Server-Timing")
    if timing is not None:
        result["server_timing"] = timing
    try:
        result["body"] = outcome.body.decode("utf-8")
        result["encoding"] = "utf-8"
    except UnicodeDecodeError:
        result["body"] = base64.b64encode(outcome.body).decode()
        result["encoding"] = "base64"
    return result


def _is_trace_header(name: str) -> bool:
    return name.lower().startswith("trims-trace-")


class Invocations:
    def __init__(self, *, ttl_s: float, capacity: int) -> None:
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._records: OrderedDict[str, Invocation] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(
        self,
        function: str,
        work: Callable[[], Awaitable[Outcome]],
        *,
        pipeline: str | None = None,
        functions: tuple[str, ...] = (),
    ) -> Invocation:
        self._expire()
        if len(self._records) >= self._capacity and not self._drop_oldest_finished():
            raise QueueFull(
                f"{self._capacity} asynchronous invocations are still running; retry later",
                retry_after_s=5,
            )
        record = Invocation(
            id=uuid.uuid4().hex, function=function, pipeline=pipeline, functions=functions
        )
        self._records[record.id] = record
        task = asyncio.create_task(self._run(record, work), name=f"trims-invocation-{record.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return record

    async def _run(self, record: Invocation, work: Callable[[], Awaitable[Outcome]]) -> None:
        try:
            record.outcome = await work()
        except TrimsError as e:
            record.error = e
        except asyncio.CancelledError:
            record.error = TrimsError("the gateway shut down before the invocation finished")
            record.finished = time.time()
            raise
        except Exception as e:
            log.exception("async invocation %s of %s failed", record.id, record.function)
            record.error = TrimsError(f"invocation failed unexpectedly: {e}")
        record.finished = time.time()

    def get(self, invocation_id: str) -> Invocation:
        self._expire()
        record = self._records.get(invocation_id)
        if record is None:
            raise NotFound(
                f"no invocation {invocation_id!r}; it never existed or expired "
                f"({self._ttl_s:g}s after it finished)"
            )
        return record

    def _expire(self) -> None:
        cutoff = time.time() - self._ttl_s
        for key in [k for k, r in self._records.items() if r.finished and r.finished < cutoff]:
            del self._records[key]

    def _drop_oldest_finished(self) -> bool:
        for key, record in self._records.items():
            if record.finished is not None:
                del self._records[key]
                return True
        return False

    async def close(self, drain_timeout_s: float) -> None:
        """Let running invocations finish for up to ``drain_timeout_s``, then cancel them."""
        if self._tasks and drain_timeout_s > 0:
            await asyncio.wait(list(self._tasks), timeout=drain_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
