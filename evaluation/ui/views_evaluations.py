"""Evaluations: the filtered list, one evaluation's detail, and a comparison of several."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from trims.errors import ValidationError
from trims.evaluation.db import (
    EvaluationFilter,
    EvaluationRecord,
    ResultsDB,
    UnreadableEvaluation,
)
from trims.evaluation.ui import charts
from trims.evaluation.ui.data import DatabaseMissing
from trims.evaluation.ui.render import render
from trims.evaluation.ui.state import require_read, state_of

__all__ = ["compare", "evaluation", "evaluations", "label_of"]

#: the most evaluations one comparison shows
MAX_COMPARED = 24
#: filter field -> the query parameter that sets it
_FILTERS = ("model", "framework", "scenario", "system")


def label_of(record: EvaluationRecord) -> str:
    e = record.evaluation
    return f"#{record.id} {e.manifest_name} {e.scenario}"


def _since(value: str) -> float | None:
    if not value:
        return None
    try:
        day = dt.date.fromisoformat(value)
    except ValueError:
        raise ValidationError(f"since: give a date as YYYY-MM-DD, got {value!r}") from None
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC).timestamp()


def _choices(records: Sequence[EvaluationRecord]) -> dict[str, list[str]]:
    return {
        "model": sorted({r.evaluation.manifest_name for r in records}),
        "framework": sorted({r.evaluation.framework for r in records}),
        "scenario": sorted({r.evaluation.scenario for r in records}),
        "system": sorted({r.system_id for r in records}),
    }


async def evaluations(request: web.Request) -> web.Response:
    await require_read(request)
    q = request.query
    chosen = {k: q.get(k, "") for k in (*_FILTERS, "since")}
    where = EvaluationFilter(
        model=chosen["model"] or None,
        framework=chosen["framework"] or None,
        scenario=chosen["scenario"] or None,
        system=chosen["system"] or None,
        since=_since(chosen["since"]),
    )

    Read = tuple[list[EvaluationRecord], list[EvaluationRecord], list[UnreadableEvaluation]]

    def read(db: ResultsDB) -> Read:
        rows, _ = db.readable_evaluations(where)
        every, unreadable = db.readable_evaluations()
        return rows, every, unreadable

    results = state_of(request).results
    db_error = ""
    rows: list[EvaluationRecord] = []
    every: list[EvaluationRecord] = []
    unreadable: list[UnreadableEvaluation] = []
    try:
        rows, every, unreadable = await results.call(read)
    except DatabaseMissing as e:
        db_error = e.message
    return render(
        request,
        "evaluations.html",
        rows=list(reversed(rows)),
        total=len(every),
        choices=_choices(every),
        chosen=chosen,
        db_error=db_error,
        unreadable=results.flag(unreadable),
    )


def _ref(raw: str) -> int | str:
    """An id (a short number) or a run id (prefix): run ids are uuids, so a reference of 8 or
    more characters is one even when its first characters are digits."""
    return int(raw) if raw.isdigit() and len(raw) < 8 else raw


async def _load(
    request: web.Request, refs: Sequence[str]
) -> tuple[list[EvaluationRecord], list[UnreadableEvaluation]]:
    """The evaluations ``refs`` name, and apart those whose rows do not read."""

    def read(db: ResultsDB) -> tuple[list[EvaluationRecord], list[UnreadableEvaluation]]:
        records, unreadable = [], []
        for ref in refs:
            try:
                records.append(db.get_evaluation(_ref(ref)))
            except UnreadableEvaluation as e:
                unreadable.append(e)
        return records, unreadable

    results = state_of(request).results
    records, unreadable = await results.call(read)
    return records, results.flag(unreadable)


async def evaluation(request: web.Request) -> web.Response:
    await require_read(request)
    records, unreadable = await _load(request, [request.match_info["ref"]])
    if unreadable:
        raise unreadable[0]
    (record,) = records
    e = record.evaluation
    chart = ""
    if e.latency is not None:
        lat = e.latency
        chart = charts.grouped_bars(
            "latency",
            f"Per-query latency of {e.manifest_name} ({e.scenario})",
            ["p50", "p90", "p99", "mean"],
            [("latency", [lat.p50, lat.p90, lat.p99, lat.mean])],
            "milliseconds",
        )
    return render(
        request,
        "evaluation.html",
        r=record,
        e=e,
        chart=chart,
        settings=sorted(e.settings.items()),
        system=sorted(record.system.items()),
    )


def _cell(record: EvaluationRecord) -> str:
    e = record.evaluation
    parts = []
    if e.qps is not None:
        parts.append(f"{e.qps:,.1f} QPS")
    if e.latency is not None:
        parts.append(f"p90 {e.latency.p90:.2f} ms")
    if e.accuracy is not None:
        parts.append(f"{100 * e.accuracy.value:.2f}% {e.accuracy.metric}")
    return ", ".join(parts) or "no measurements"


def _comparison_charts(records: Sequence[EvaluationRecord]) -> dict[str, str]:
    out: dict[str, str] = {}
    with_qps = [r for r in records if r.evaluation.qps is not None]
    if with_qps:
        out["qps"] = charts.grouped_bars(
            "qps",
            "Throughput",
            [label_of(r) for r in with_qps],
            [("QPS", [float(r.evaluation.qps or 0.0) for r in with_qps])],
            "queries per second",
        )
    with_latency = [r for r in records if r.evaluation.latency is not None]
    if with_latency:
        lats = [r.evaluation.latency for r in with_latency]
        out["latency"] = charts.grouped_bars(
            "tail",
            "Tail latency",
            [label_of(r) for r in with_latency],
            [("p90", [x.p90 for x in lats if x]), ("p99", [x.p99 for x in lats if x])],
            "milliseconds",
        )
    points = [  # labelled by id only: long labels of nearby points would overlap
        (f"#{r.id}", r.evaluation.latency.p90, 100 * r.evaluation.accuracy.value)
        for r in records
        if r.evaluation.latency is not None and r.evaluation.accuracy is not None
    ]
    if points:
        out["accuracy"] = charts.scatter(
            "accuracy", "Accuracy vs p90 latency", points, "p90 latency (ms)", "accuracy (%)"
        )
    return out


async def compare(request: web.Request) -> web.Response:
    await require_read(request)
    refs = list(dict.fromkeys(request.query.getall("e", [])))
    if not refs:
        raise ValidationError(
            "pick the evaluations to compare: tick them in the evaluations list and press "
            "Compare (or give ?e=ID&e=ID)"
        )
    if len(refs) > MAX_COMPARED:
        raise ValidationError(f"compare at most {MAX_COMPARED} evaluations at once")
    records, unreadable = await _load(request, refs)
    models = sorted({r.evaluation.manifest_name for r in records})
    scenarios = sorted({r.evaluation.scenario for r in records})
    grid: dict[tuple[str, str], EvaluationRecord] = {}
    for r in sorted(records, key=lambda r: r.created_at):
        grid[(r.evaluation.manifest_name, r.evaluation.scenario)] = r
    table: list[dict[str, Any]] = [
        {
            "model": m,
            "cells": [
                (grid[(m, s)], _cell(grid[(m, s)])) if (m, s) in grid else None for s in scenarios
            ],
        }
        for m in models
    ]
    return render(
        request,
        "compare.html",
        records=records,
        labels={r.id: label_of(r) for r in records},
        charts=_comparison_charts(records),
        scenarios=scenarios,
        table=table,
        unreadable=unreadable,
    )
