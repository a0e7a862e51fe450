"""Layer analyses (``trims analyze``): the stored measurements, time by op type per model, and
each model's measured latency against the sum of its layers' best times (the sequential lower
bound of the layers stored under the model's name).

Layer results are stored once per unique layer configuration, labelled with the model where it
was first seen (``model/layer OpType``), so a layer shared by two models counts toward the
first one only: the per-model sums here are of the layers labelled with that model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from aiohttp import web

from trims.evaluation.db import LayerResult
from trims.evaluation.ui import charts
from trims.evaluation.ui.data import DatabaseMissing
from trims.evaluation.ui.render import render
from trims.evaluation.ui.state import require_read, state_of

__all__ = ["layers"]

#: at most this many op types get their own colour; the rest are summed as "other"
_TOP_OPS = 8
#: at most this many rows of the table
_ROWS = 500


def _model_and_op(r: LayerResult) -> tuple[str, str]:
    head, _, op = r.label.rpartition(" ")
    model = (head or r.label).split("/", 1)[0]
    return model, op if head else r.key.kind


def _charts(results: list[LayerResult]) -> dict[str, str]:
    out: dict[str, str] = {}
    layers = [r for r in results if r.key.kind == "layer"]
    if layers:
        by_model: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        totals: dict[str, float] = defaultdict(float)
        for r in layers:
            model, op = _model_and_op(r)
            by_model[model][op] += r.measurement.min_ms
            totals[op] += r.measurement.min_ms
        ops = sorted(totals, key=lambda o: -totals[o])
        top, rest = ops[:_TOP_OPS], ops[_TOP_OPS:]
        models = sorted(by_model)
        series = [(op, [by_model[m].get(op, 0.0) for m in models]) for op in top]
        if rest:
            series.append(("other", [sum(by_model[m].get(o, 0.0) for o in rest) for m in models]))
        out["ops"] = charts.stacked_bars(
            "ops", "Best layer time by op type", models, series, "sum of best layer times (ms)"
        )
    bound = _bounds(results)
    if bound:
        names = [f"{b['model']} ({b['framework']})" for b in bound]
        out["bounds"] = charts.grouped_bars(
            "bounds",
            "Measured latency vs layers' lower bound",
            names,
            [
                ("measured", [b["measured_ms"] for b in bound]),
                ("sum of best layer times", [b["layers_ms"] for b in bound]),
            ],
            "milliseconds",
        )
    return out


def _bounds(results: list[LayerResult]) -> list[dict[str, Any]]:
    """Per (model, framework, system): measured latency and the sum of its layers' best."""
    layer_sums: dict[tuple[str, str, str], float] = defaultdict(float)
    for r in results:
        if r.key.kind == "layer":
            layer_sums[(_model_and_op(r)[0], r.key.framework, r.key.system)] += r.measurement.min_ms
    out = []
    for r in results:
        where = (r.label, r.key.framework, r.key.system)
        if r.key.kind == "model" and where in layer_sums:
            out.append(
                {
                    "model": r.label,
                    "measured_ms": r.measurement.trimmed_mean_ms,
                    "layers_ms": layer_sums[where],
                    "framework": r.key.framework,
                    "system": r.key.system,
                }
            )
    return out


async def layers(request: web.Request) -> web.Response:
    await require_read(request)
    kind = request.query.get("kind", "")
    framework = request.query.get("framework", "")
    db_error = ""
    every: list[LayerResult] = []
    try:
        every = await state_of(request).results.call(lambda db: db.layer_results())
    except DatabaseMissing as e:
        db_error = e.message
    shown = [
        r
        for r in every
        if (not kind or r.key.kind == kind) and (not framework or r.key.framework == framework)
    ]
    return render(
        request,
        "layers.html",
        rows=shown[:_ROWS],
        total=len(shown),
        limit=_ROWS,
        kinds=sorted({r.key.kind for r in every}),
        frameworks=sorted({r.key.framework for r in every}),
        chosen={"kind": kind, "framework": framework},
        charts=_charts(shown),
        bounds=_bounds(shown),
        db_error=db_error,
    )
