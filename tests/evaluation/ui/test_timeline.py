"""The SVG span timeline: rows in span-tree order, bars placed on the trace's clock."""

from __future__ import annotations

import re

from tests.evaluation.ui.seed import SPAN_NAMES, seed_trace
from trims.evaluation.ui.timeline import timeline_svg
from trims.tracing.spans import Trace


def test_rows_follow_the_span_tree_and_bars_its_clock() -> None:
    timeline = timeline_svg(seed_trace())
    assert (timeline.rows, timeline.total_spans) == (len(SPAN_NAMES), len(SPAN_NAMES))
    assert tuple(re.findall(r'class="span-name">([^<]+)<', timeline.svg)) == SPAN_NAMES
    bars = re.findall(r'<rect x="([\d.]+)" y="\d+" width="([\d.]+)"', timeline.svg)
    (x0, w0), (x1, w1) = (tuple(map(float, b)) for b in bars[:2])
    assert x0 < x1 and w0 > w1  # the request starts first and lasts longest
    assert (
        "<title>cudnn conv kernel (kernel): 4.000 ms on cuda:0 / stream 7</title>" in timeline.svg
    )


def test_a_long_trace_is_cut_and_names_are_escaped() -> None:
    spans = tuple(s.__class__(**{**s.__dict__, "name": f"<{s.name}>"}) for s in seed_trace().spans)
    timeline = timeline_svg(Trace("t" * 32, spans), max_rows=3)
    assert (timeline.rows, timeline.total_spans) == (3, len(SPAN_NAMES))
    assert "&lt;gateway request&gt;" in timeline.svg and "<gateway" not in timeline.svg
    assert timeline_svg(Trace("t" * 32, ())).rows == 0
