"""Framework profilers as span sources: each turns its profiler's events into :class:`Span`.

The contract every source keeps (the modules beside this one implement it per framework):

* it records the levels **below** ``model`` (the caller times and records the model span
  itself, so a model span exists at every level, profiled or not);
* it converts its profiler's clock to Unix epoch nanoseconds once (see
  :mod:`trims.tracing.spans`), and puts spans on tracks ``(process, thread)`` where
  ``process`` is the name the caller gives (e.g. ``"worker 4242"``, ``"trims trace"``);
* layer spans carry ``op_type`` and, where the profiler knows them, ``input_shapes``
  (list of shape strings) and the framework's node ``name``; kernel spans carry
  ``correlation`` and their launch spans the same value (Note [parents] in spans.py);
* a level it cannot provide is named in :attr:`Recording.unavailable` with the reason, never
  silently dropped; a profiler that fails sets :attr:`Recording.error` and the profiled work
  still runs and returns its result.

Sources: :mod:`.torch` (``torch.profiler``: operators with shapes and memory, oneDNN
primitives at the library level where available, CUDA kernels via CUPTI on a GPU),
:mod:`.onnxruntime` (session profiling: node events; it must be enabled when the session is
created), :mod:`.mxnet` (the MXNet profiler, run in the MXNet environment).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trims.errors import ValidationError
from trims.tracing.levels import Level
from trims.tracing.spans import Span

__all__ = ["FRAMEWORKS", "NO_CUDA", "Recording", "availability"]

#: The frameworks with a span source, as users name them.
FRAMEWORKS = ("torch", "onnxruntime", "mxnet")
NO_CUDA = "no CUDA device: the kernel level needs a GPU (CUPTI)"


@dataclass
class Recording:
    """What one profiled region produced: spans, and what could not be recorded and why."""

    spans: list[Span] = field(default_factory=list)
    #: level -> why the stack cannot provide it (e.g. "kernel: no CUDA device").
    unavailable: dict[Level, str] = field(default_factory=dict)
    #: The profiler failed (message); the work it observed ran and its result stands.
    error: str | None = None


def availability(framework: str, level: Level, *, cuda: bool) -> str | None:
    """Why ``framework`` cannot trace at ``level`` on this stack, or None if it can.

    ``full`` is always available: it means every level the stack provides, and the run
    reports the missing ones in :attr:`Recording.unavailable`. ``cuda``: whether a CUDA
    device is present. Unknown frameworks raise ValidationError listing the known ones.
    """
    if framework not in FRAMEWORKS:
        raise ValidationError(
            f"framework: unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}",
            field="framework",
        )
    if level in (Level.SERVICE, Level.NONE, Level.MODEL, Level.LAYER, Level.FULL):
        return None
    if framework == "torch":
        return None if level is Level.LIBRARY or cuda else NO_CUDA
    if framework == "onnxruntime":
        from trims.tracing.sources import onnxruntime as ort_source

        if level is Level.LIBRARY:
            return ort_source.NO_LIBRARY
        return ort_source.NO_KERNEL_CUDA if cuda else NO_CUDA
    from trims.tracing.sources import mxnet as mx_source

    return mx_source.NO_LIBRARY if level is Level.LIBRARY else mx_source.NO_KERNEL
