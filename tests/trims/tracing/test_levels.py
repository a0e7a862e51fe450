"""Trace levels: parsing (names, errors that list them) and the leveled-run order."""

from __future__ import annotations

import pytest

from trims.errors import ValidationError
from trims.tracing.levels import NAMES, Level, levels_up_to, parse_level


def test_parse_names_case_insensitive_and_levels_pass_through() -> None:
    assert parse_level("Layer") is Level.LAYER
    assert parse_level(" kernel ") is Level.KERNEL
    assert parse_level(Level.MODEL) is Level.MODEL
    assert [parse_level(n) for n in NAMES] == [lv for lv in Level if lv is not Level.SERVICE]


@pytest.mark.parametrize("bad", ["layers", "service", "", 3, None])
def test_unknown_level_lists_the_allowed_names(bad: object) -> None:
    with pytest.raises(ValidationError) as e:
        parse_level(bad, field="trace_level")
    assert "trace_level" in str(e.value)
    for name in ("none", "model", "layer", "library", "kernel", "full"):
        assert name in str(e.value)


def test_levels_up_to() -> None:
    assert levels_up_to(Level.NONE) == ()
    assert levels_up_to(Level.MODEL) == (Level.MODEL,)
    assert levels_up_to(Level.LIBRARY) == (Level.MODEL, Level.LAYER, Level.LIBRARY)
    assert levels_up_to(Level.FULL) == (Level.MODEL, Level.LAYER, Level.LIBRARY, Level.KERNEL)
    assert Level.FULL.label == "full"
