"""Progress of long store operations (add, load) on a terminal, or as lines in a log.

The daemon reports ``(stage, done_bytes, total_bytes)`` and may interleave stages: a load
copies and hashes each chunk, so "load" and "verify" reports alternate. :class:`ProgressBars`
therefore keeps one bar per stage for the whole operation, each advanced by its own deltas, so
a stage draws one bar whose rate is its bytes over its time. When stderr is not a terminal (a
log file, CI, a pipe) it draws nothing and prints one line per stage as the stage finishes::

    load     320.0 MiB in 0.41 s (780.5 MiB/s)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from trims.config import format_size

__all__ = ["ProgressBars"]


@dataclass
class _Stage:
    started: float
    done: int = 0
    total: int | None = None
    bar: Any = None
    finished: bool = False


class ProgressBars:
    """A :data:`trims.protocol.Progress` callback drawing one tqdm bar per stage on ``stream``
    (stderr) when it is a terminal, else one line per finished stage; nothing when disabled."""

    def __init__(
        self, enabled: bool, stream: TextIO | None = None, *, interactive: bool | None = None
    ) -> None:
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._interactive = _is_terminal(self._stream) if interactive is None else interactive
        self._stages: dict[str, _Stage] = {}
        #: When the operation started or the last stage finished: where the next stage starts
        #: (its first report comes only after its first chunk).
        self._mark = time.monotonic()

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if not self.enabled:
            return
        state = self._stages.get(stage)
        if state is None or state.finished:
            if state is not None:
                self._close_stage(stage, state)
            state = self._stages[stage] = _Stage(self._mark, total=total)
            if self._interactive:
                state.bar = self._new_bar(stage, total, position=len(self._stages) - 1)
        if total is not None and total != state.total:
            state.total = total
            if state.bar is not None:
                state.bar.total = total
                state.bar.refresh()
        if done > state.done:
            if state.bar is not None:
                state.bar.update(done - state.done)
            state.done = done
        if state.total is not None and state.done >= state.total:
            self._close_stage(stage, state)

    def _new_bar(self, stage: str, total: int | None, position: int) -> Any:
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=f"{stage:<8}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=self._stream,
            position=position,
            leave=True,
        )

    def _close_stage(self, stage: str, state: _Stage) -> None:
        if state.finished:
            return
        state.finished = True
        self._mark = time.monotonic()
        if state.bar is not None:
            state.bar.close()
            state.bar = None
            return
        took = max(time.monotonic() - state.started, 1e-9)
        rate = f"{format_size(int(state.done / took))}/s"
        print(
            f"{stage:<8} {format_size(state.done)} in {took:.2f} s ({rate})",
            file=self._stream,
            flush=True,
        )

    def close(self) -> None:
        """Finish every stage still open (a stage whose total was unknown ends here)."""
        for stage, state in self._stages.items():
            self._close_stage(stage, state)
        self._stages.clear()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
