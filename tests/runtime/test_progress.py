"""Progress of store operations: one bar per stage however the daemon interleaves its reports,
and one line per stage (no bars) when stderr is not a terminal."""

from __future__ import annotations

import io
import re

from trims.runtime.progress import ProgressBars

MIB = 1 << 20
TOTAL = 320 * MIB


def _interleaved_load(bars: ProgressBars) -> None:
    """What the daemon sends for `models load big --tier cpu`: load and verify per 4 MiB."""
    for done in range(4 * MIB, TOTAL + 1, 4 * MIB):
        bars("load", done, TOTAL)
        bars("verify", done, TOTAL)
    bars.close()


def _renders(text: str) -> list[str]:
    return [part for part in re.split(r"[\r\n]", text) if part.strip()]


def test_one_bar_per_stage_on_a_terminal() -> None:
    stream = io.StringIO()
    _interleaved_load(ProgressBars(True, stream, interactive=True))
    renders = _renders(stream.getvalue())
    for stage in ("load", "verify"):
        started = [r for r in renders if r.startswith(stage) and "  0%|" in r]
        assert len(started) == 1, f"{stage}: {len(started)} bars"
        [final] = [r for r in renders if r.startswith(stage) and "100%|" in r]
        assert "320M/320M" in final, final


def test_a_line_per_stage_when_not_a_terminal() -> None:
    stream = io.StringIO()
    _interleaved_load(ProgressBars(True, stream))  # a StringIO is no terminal
    lines = stream.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["load", "verify"]
    for line in lines:
        assert re.fullmatch(r"\w+ +320\.0 MiB in \d+\.\d\d s \([\d.]+ \S?i?B/s\)", line), line


def test_a_stage_without_a_total_ends_at_close() -> None:
    stream = io.StringIO()
    bars = ProgressBars(True, stream)
    bars("convert", 1000, None)
    bars("convert", 3000, None)
    assert stream.getvalue() == ""
    bars.close()
    assert stream.getvalue().startswith("convert  2.9 KiB in ")


def test_disabled_prints_nothing() -> None:
    stream = io.StringIO()
    _interleaved_load(ProgressBars(False, stream, interactive=True))
    assert stream.getvalue() == ""
