"""The one table renderer: aligned text for terminals, markdown for reports."""

from __future__ import annotations

import pytest

from trims.tables import cell, markdown_table, text_table


def test_text_table_pads_to_the_widest_cell_and_aligns_per_column() -> None:
    out = text_table(["NAME", "READY", "HANDLER"], [["echo", 1, "h:h"], ["a-long-name", 12, ""]],
                     align="lr")  # fmt: skip
    assert out.splitlines() == [
        "NAME         READY  HANDLER",
        "echo             1  h:h",
        "a-long-name     12",
    ]


def test_text_table_rule_floats_and_missing_values() -> None:
    out = text_table(["model", "ms"], [["m", 1.23456], ["n", None]], align="lr", rule=True,
                     float_format=".2f")  # fmt: skip
    assert out.splitlines() == ["model    ms", "-----  ----", "m      1.23", "n         -"]


def test_text_table_of_no_rows_is_its_header() -> None:
    assert text_table(["A", "B"], []) == "A  B"


def test_markdown_table_right_aligned_columns_and_escaped_pipes() -> None:
    out = markdown_table(["size", "what"], [[4, "a|b"], [0.5, None]], align="r")
    assert out.splitlines() == [
        "| size | what |",
        "|---:|---|",
        "| 4 | a\\|b |",
        "| 0.5 | - |",
    ]


def test_cell_formats_floats_and_keeps_strings() -> None:
    assert cell(2 / 3) == "0.6667"
    assert cell(2 / 3, ".1f") == "0.7"
    assert cell("1.0") == "1.0"
    assert cell(None) == "-"


@pytest.mark.parametrize("render", [text_table, markdown_table])
def test_a_row_of_the_wrong_width_is_refused(render: object) -> None:
    with pytest.raises(ValueError, match="row 1 has 1 cells; the header has 2"):
        render(["a", "b"], [[1, 2], [3]])  # type: ignore[operator]


def test_an_unknown_alignment_is_refused() -> None:
    with pytest.raises(ValueError, match="'c'"):
        text_table(["a"], [[1]], align="c")
