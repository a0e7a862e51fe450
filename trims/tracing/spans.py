"""Spans and traces: what every source produces and every export and analysis reads.

One clock for all: Unix epoch nanoseconds (``time.time_ns()``). A source whose profiler keeps
its own clock (torch.profiler's microseconds since its start, ONNX Runtime's offsets from
``get_profiling_start_time_ns``) converts once, when it makes spans.

A span sits on a **track**: the process and thread (or device stream) it ran on, e.g.
``("gateway", "event loop")``, ``("worker 4242", "thread 7")``, ``("cuda:0", "stream 7")``.
Tracks become the process/thread rows of the Chrome trace.

Note [parents]
~~~~~~~~~~~~~~
A span names its parent by ``parent_id`` when its source knows it (OpenTelemetry spans, a
model span that wraps the framework spans it recorded). Where it does not (framework events),
:func:`nest` derives it from time containment on one track: the parent of a span is the
shortest span of the same track that contains it. A span that no span of its own track
contains is given the shortest span of a shallower level that contains it on any track of the
same process (``track[0]``): a layer running on an intra-op thread belongs to the model
span on the calling thread. GPU kernels are the exception: they run asynchronously, so a
kernel's parent is the launch that shares its ``correlation`` attribute, never containment.
A launch (``cudaLaunchKernel``) is recorded at the kernel level too, so it is told from the
kernel by ``kind: "launch"`` (kernels carry ``kind: "kernel"``).
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trims.tracing.levels import Level

__all__ = ["Span", "Trace", "Track", "nest", "new_span_id", "new_trace_id"]

#: (process, thread) a span ran on; see the module docstring.
Track = tuple[str, str]
#: Attribute values a span may carry (what OTLP and Chrome traces can both hold).
AttrValue = str | int | float | bool | list[str] | list[int] | list[float]


def new_trace_id() -> str:
    """A W3C trace id: 32 lower-case hex digits, not all zero."""
    return secrets.token_hex(16)


def new_span_id() -> str:
    """A W3C span id: 16 lower-case hex digits, not all zero."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Span:
    """One timed piece of work at one level."""

    name: str
    level: Level
    start_ns: int
    end_ns: int
    track: Track
    span_id: str = field(default_factory=new_span_id)
    parent_id: str | None = None
    #: e.g. ``op_type``, ``input_shapes``, ``correlation`` (GPU launch <-> kernel),
    #: ``function``; values as :data:`AttrValue`.
    attributes: Mapping[str, AttrValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.end_ns < self.start_ns:
            raise ValueError(f"span {self.name!r} ends ({self.end_ns}) before it starts")

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def contains(self, other: Span) -> bool:
        return self.start_ns <= other.start_ns and other.end_ns <= self.end_ns

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "level": self.level.label,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "track": list(self.track),
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "attributes": dict(self.attributes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Span:
        process, thread = d["track"]
        return cls(
            name=str(d["name"]),
            level=Level[str(d["level"]).upper()],
            start_ns=int(d["start_ns"]),
            end_ns=int(d["end_ns"]),
            track=(str(process), str(thread)),
            span_id=str(d["span_id"]),
            parent_id=None if d.get("parent_id") is None else str(d["parent_id"]),
            attributes=dict(d.get("attributes") or {}),
        )


@dataclass(frozen=True)
class Trace:
    """All spans of one trace id, parents resolved (see :func:`nest`)."""

    trace_id: str
    spans: tuple[Span, ...]

    def by_level(self, level: Level) -> list[Span]:
        return [s for s in self.spans if s.level is level]

    def children(self) -> dict[str | None, list[Span]]:
        """parent_id -> its children in start order (``None``: the roots)."""
        out: dict[str | None, list[Span]] = defaultdict(list)
        for s in sorted(self.spans, key=lambda s: (s.start_ns, -s.end_ns)):
            out[s.parent_id].append(s)
        return out

    def walk(self) -> Iterator[tuple[int, Span]]:
        """(depth, span) depth-first from the roots, children in start order."""
        children = self.children()
        known = {s.span_id for s in self.spans}
        roots = [s for s in self.spans if s.parent_id is None or s.parent_id not in known]
        stack = [(0, s) for s in sorted(roots, key=lambda s: s.start_ns, reverse=True)]
        while stack:
            depth, span = stack.pop()
            yield depth, span
            stack.extend((depth + 1, c) for c in reversed(children.get(span.span_id, [])))

    def to_dict(self) -> dict[str, Any]:
        return {"trace_id": self.trace_id, "spans": [s.to_dict() for s in self.spans]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trace:
        return cls(str(d["trace_id"]), tuple(Span.from_dict(s) for s in d["spans"]))


def nest(spans: Iterable[Span]) -> list[Span]:
    """The spans with ``parent_id`` filled in where it was None (Note [parents])."""
    spans = list(spans)
    launches = {s.attributes["correlation"]: s for s in spans if _is_launch(s)}
    by_track: dict[Track, list[Span]] = defaultdict(list)
    by_process: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_track[s.track].append(s)
        by_process[s.track[0]].append(s)
    order = {id(s): i for i, s in enumerate(spans)}
    out: list[Span] = []
    for s in spans:
        if s.parent_id is not None:
            out.append(s)
            continue
        parent: Span | None = None
        if s.level is Level.KERNEL and "correlation" in s.attributes and not _is_launch(s):
            parent = launches.get(s.attributes["correlation"])
        if parent is None:
            parent = _smallest_container(s, by_track[s.track], order, same_track=True)
        if parent is None:
            parent = _smallest_container(s, by_process[s.track[0]], order, same_track=False)
        out.append(s if parent is None else replace(s, parent_id=parent.span_id))
    return out


def _is_launch(span: Span) -> bool:
    """A span that started GPU work: ``kind: "launch"`` or any non-kernel span with a
    ``correlation`` (Note [parents])."""
    if "correlation" not in span.attributes:
        return False
    return span.attributes.get("kind") == "launch" or span.level is not Level.KERNEL


def _smallest_container(
    span: Span, candidates: Sequence[Span], order: Mapping[int, int], *, same_track: bool
) -> Span | None:
    """The shortest candidate containing ``span``. Of two spans with the same extent, the
    shallower level (then the one listed first) is the parent, so no two spans parent each
    other."""
    best: Span | None = None
    for c in candidates:
        if c is span or not c.contains(span):
            continue
        if not same_track and c.level >= span.level:
            continue
        if (c.start_ns, c.end_ns) == (span.start_ns, span.end_ns) and (c.level, order[id(c)]) > (
            span.level,
            order[id(span)],
        ):
            continue
        if best is None or c.duration_ns < best.duration_ns:
            best = c
    return best
