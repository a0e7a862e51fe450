"""Tables for people: aligned plain text for terminals, markdown for reports.

One renderer for every CLI listing and benchmark report, so columns line up the same way
everywhere. A table is a header and rows of cells; a cell is formatted by :func:`cell` (floats
to ``float_format``, None as ``-``) unless it is already a string. ``align`` gives one letter a
column, ``l`` (left) or ``r`` (right); columns past its end are left-aligned, so ``"lrr"``
right-aligns the second and third columns of a table of any width.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["cell", "markdown_table", "text_table"]

#: what a missing value (None) shows as
MISSING = "-"


def cell(value: object, float_format: str = ".4g") -> str:
    """One cell's text: ``value`` as is when it is a string, floats per ``float_format``."""
    if value is None:
        return MISSING
    if isinstance(value, float):
        return format(value, float_format)
    return str(value)


def _aligns(align: str, columns: int) -> list[str]:
    bad = set(align) - {"l", "r"}
    if bad:
        raise ValueError(f"align takes 'l' and 'r' only, not {''.join(sorted(bad))!r}")
    return [align[i] if i < len(align) else "l" for i in range(columns)]


def _cells(
    header: Sequence[str], rows: Sequence[Sequence[object]], float_format: str
) -> list[list[str]]:
    out = [[str(h) for h in header]]
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"row {i} has {len(row)} cells; the header has {len(header)}")
        out.append([cell(v, float_format) for v in row])
    return out


def text_table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str = "",
    rule: bool = False,
    float_format: str = ".4g",
    gap: str = "  ",
) -> str:
    """Columns padded to their widest cell, ``gap`` apart, trailing blanks stripped; ``rule``
    adds a line of dashes under the header."""
    table = _cells(header, rows, float_format)
    aligns = _aligns(align, len(header))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = (
            c.rjust(w) if a == "r" else c.ljust(w)
            for c, w, a in zip(cells, widths, aligns, strict=True)
        )
        return gap.join(padded).rstrip()

    lines = [line(table[0])]
    if rule:
        lines.append(line(["-" * w for w in widths]))
    lines += [line(r) for r in table[1:]]
    return "\n".join(lines)


def markdown_table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str = "",
    float_format: str = ".4g",
) -> str:
    """A GitHub-flavoured markdown table; ``r`` columns get a ``---:`` rule."""
    table = _cells(header, rows, float_format)
    aligns = _aligns(align, len(header))

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join("---:" if a == "r" else "---" for a in aligns) + "|"
    return "\n".join([line(table[0]), rule, *(line(r) for r in table[1:])])
