"""The results database's read methods the UI added: trace_infos, layer_results and
readable_evaluations."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from tests.evaluation.ui.seed import SYSTEM, TRACE_ID, Seeded, seed
from trims.evaluation.db import ResultsDB, TraceRecord, UnreadableEvaluation


def test_trace_infos_are_the_newest_first_without_spans(tmp_path: Path) -> None:
    seeded: Seeded = seed(tmp_path / "r.sqlite")
    db = ResultsDB(str(seeded.path))
    try:
        newer = TraceRecord("f" * 32, "m2", "torch", "layer", 4e9, {"spans": 1}, [])
        db.put_trace(newer)
        infos = db.trace_infos()
        assert [i.trace_id for i in infos] == ["f" * 32, TRACE_ID]
        assert infos[1].summary["coverage_pct"] == 87.5 and not hasattr(infos[1], "spans")
        assert [i.trace_id for i in db.trace_infos(limit=1)] == ["f" * 32]
    finally:
        db.close()


def test_layer_results_filter_by_kind_and_framework(tmp_path: Path) -> None:
    db = ResultsDB(str(seed(tmp_path / "r.sqlite").path), readonly=True)
    try:
        every = db.layer_results()
        assert len(every) == 4 and {r.key.system for r in every} == {SYSTEM["system_id"]}
        (model,) = db.layer_results(kind="model")
        assert model.label == "mnist-cnn" and model.measurement.min_ms == 12.0
        assert [r.label for r in db.layer_results(kind="layer")] == [
            "mnist-cnn/conv1 Conv",
            "mnist-cnn/fc1 Gemm",
            "mnist-cnn/relu1 Relu",
        ]
        assert db.layer_results(framework="torch") == []
        assert len(db.layer_results(limit=2)) == 2
    finally:
        db.close()


def test_an_empty_database_has_no_traces_or_layer_results(tmp_path: Path) -> None:
    db = ResultsDB(str(tmp_path / "empty.sqlite"))
    try:
        assert db.trace_infos() == [] and db.layer_results() == []
    finally:
        db.close()


@pytest.mark.parametrize(
    ("column", "value", "why"),
    [
        ("qps", "fast", "qps holds 'fast', not a number"),
        ("batch", "x", "batch holds 'x', not a whole number"),
        ("settings", "{not json", "Expecting property name"),
        ("system", "[1]", "must each hold a JSON object"),
        ("accuracy_value", 76.1, "accuracy is a fraction"),
    ],
)
def test_a_row_written_past_the_api_is_left_out_and_named(
    tmp_path: Path, column: str, value: object, why: str
) -> None:
    seeded = seed(tmp_path / "r.sqlite")
    with sqlite3.connect(seeded.path) as con:
        con.execute(f"UPDATE evaluations SET {column} = ? WHERE id = ?", (value, seeded.ids[1]))
    db = ResultsDB(str(seeded.path), readonly=True)
    try:
        records, unreadable = db.readable_evaluations()
        assert [r.id for r in records] == [seeded.ids[0], seeded.ids[2]]
        (bad,) = unreadable
        assert bad.row_id == seeded.ids[1] and why in bad.message
        with pytest.raises(UnreadableEvaluation):
            db.evaluations()
        with pytest.raises(UnreadableEvaluation):
            db.get_evaluation(seeded.ids[1])
    finally:
        db.close()
