"""Results database round trip, versioning, and skip-if-measured through the bencher."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.evaluation import graphs
from trims.errors import ValidationError
from trims.evaluation import graph, ir
from trims.evaluation.db import ResultKey, ResultsDB
from trims.evaluation.generator import Bencher, layer_benchmarks
from trims.evaluation.measure import Measurement, MeasureSettings

KEY = ResultKey("cpu x2", "onnxruntime", "1.0", "layer", "abc", 1, "opt=all,threads=1")
FAST = MeasureSettings(warmup=1, min_reps=3, max_reps=5, max_time_s=0.2)


def test_round_trip_and_replace(tmp_path: Path) -> None:
    db = ResultsDB(str(tmp_path / "r.sqlite"))
    try:
        assert db.get(KEY) is None
        first = Measurement(1.5, 1.4, 0.1, 1.2, 10, 0.3)
        db.put(KEY, first, "label")
        assert db.get(KEY) == first
        assert db.get(ResultKey(**{**KEY.__dict__, "batch": 2})) is None
        second = Measurement(2.0, 2.0, 0.0, 2.0, 3, 0.1)
        db.put(KEY, second)
        assert db.get(KEY) == second
        assert db.count() == 1
    finally:
        db.close()
    reopened = ResultsDB(f"sqlite:///{tmp_path / 'r.sqlite'}")
    try:
        assert reopened.get(KEY) == second
    finally:
        reopened.close()


def test_other_schema_version_is_refused(tmp_path: Path) -> None:
    import sqlalchemy as sa

    path = tmp_path / "old.sqlite"
    ResultsDB(str(path)).close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE meta SET value = '99' WHERE key = 'schema'"))
    engine.dispose()
    with pytest.raises(ValidationError, match="schema version 99"):
        ResultsDB(str(path))


def test_bencher_skips_what_is_measured_unless_forced(tmp_path: Path) -> None:
    model = ir.build(graph.prepare(graphs.conv_gemm(), "cg"), "cg")
    benches = layer_benchmarks([model])
    assert len(benches) == len(model.layers)
    db = ResultsDB(str(tmp_path / "b.sqlite"))
    try:
        bencher = Bencher(db, "onnxruntime", "opt=all,threads=1", 1, FAST)
        first = [bencher.run(b) for b in benches]
        assert all(r.fresh for r in first)
        assert db.count() == len(benches)
        again = [bencher.run(b) for b in benches]
        assert not any(r.fresh for r in again)
        assert [r.measurement for r in again] == [r.measurement for r in first]
        forced = Bencher(db, "onnxruntime", "opt=all,threads=1", 1, FAST, force=True)
        assert forced.run(benches[0]).fresh
        other = Bencher(db, "onnxruntime", "opt=disable,threads=1", 1, FAST)
        assert other.run(benches[0]).fresh
        assert db.count() == len(benches) + 1
    finally:
        db.close()


def _schema_1_database(path: Path) -> None:
    """A database as trims wrote it before traces (schema 1), holding one measurement."""
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(
            sa.text("CREATE TABLE meta (key VARCHAR(64) PRIMARY KEY, value VARCHAR(256) NOT NULL)")
        )
        conn.execute(sa.text("INSERT INTO meta VALUES ('schema', '1')"))
        conn.execute(
            sa.text(
                "CREATE TABLE results (id INTEGER PRIMARY KEY AUTOINCREMENT, system VARCHAR(256) "
                "NOT NULL, framework VARCHAR(64) NOT NULL, "
                "framework_version VARCHAR(64) NOT NULL, "
                "kind VARCHAR(16) NOT NULL, signature VARCHAR(128) NOT NULL, "
                "batch INTEGER NOT NULL, "
                "variant VARCHAR(128) NOT NULL, trimmed_mean_ms FLOAT NOT NULL, "
                "median_ms FLOAT NOT "
                "NULL, spread_ms FLOAT NOT NULL, min_ms FLOAT NOT NULL, reps INTEGER NOT NULL, "
                "elapsed_s FLOAT NOT NULL, label VARCHAR(256) NOT NULL, created_at FLOAT NOT NULL, "
                "CONSTRAINT uq_result_key UNIQUE (system, framework, framework_version, kind, "
                "signature, batch, variant))"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO results (system, framework, framework_version, kind, signature, "
                "batch, "
                "variant, trimmed_mean_ms, median_ms, spread_ms, min_ms, reps, elapsed_s, label, "
                "created_at) VALUES ('cpu x2', 'onnxruntime', '1.0', 'layer', 'abc', 1, "
                "'opt=all,threads=1', 1.5, 1.4, 0.1, 1.2, 10, 0.3, 'old', 0)"
            )
        )
    engine.dispose()


def test_schema_1_database_is_migrated_and_keeps_its_results(tmp_path: Path) -> None:
    import sqlalchemy as sa

    from trims.evaluation.db import SCHEMA_VERSION, TraceRecord

    path = tmp_path / "v1.sqlite"
    _schema_1_database(path)
    db = ResultsDB(str(path))
    try:
        assert db.get(KEY) == Measurement(1.5, 1.4, 0.1, 1.2, 10, 0.3)
        record = TraceRecord(
            "ab" * 16,
            "torch:resnet18",
            "torch",
            "layer",
            1.0,
            {"trace_id": "ab" * 16, "layers": []},
            [{"name": "x"}],
        )
        db.put_trace(record)
        assert db.get_trace("ab" * 16) == record
        assert db.get_trace("cd" * 16) is None
        assert db.trace_ids() == ["ab" * 16]
    finally:
        db.close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        version = conn.execute(sa.text("SELECT value FROM meta WHERE key = 'schema'")).scalar()
    engine.dispose()
    assert version == str(SCHEMA_VERSION) == "3"
    ResultsDB(str(path)).close()  # a migrated database opens again as it is


def test_schema_2_database_gains_evaluations_and_keeps_its_traces(tmp_path: Path) -> None:
    """Schema 2 (traces, no evaluations) -> 3; a read-only open neither migrates nor fails."""
    import sqlalchemy as sa

    from trims.evaluation.db import SCHEMA_VERSION, TraceRecord

    path = tmp_path / "v2.sqlite"
    _schema_1_database(path)
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE traces (trace_id VARCHAR(32) PRIMARY KEY, model VARCHAR(256) NOT "
                "NULL, framework VARCHAR(64) NOT NULL, level VARCHAR(16) NOT NULL, created_at "
                "FLOAT NOT NULL, summary TEXT NOT NULL, spans TEXT NOT NULL)"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO traces VALUES ('" + "ab" * 16 + "', 'torch:resnet18', 'torch', "
                "'layer', 1.0, '{\"layers\": []}', '[{\"name\": \"x\"}]')"
            )
        )
        conn.execute(sa.text("UPDATE meta SET value = '2' WHERE key = 'schema'"))
    engine.dispose()
    readonly = ResultsDB(str(path), readonly=True)
    try:
        assert readonly.version == 2 and readonly.evaluations() == []
    finally:
        readonly.close()
    db = ResultsDB(str(path))
    try:
        assert db.version == SCHEMA_VERSION == 3
        assert db.get(KEY) == Measurement(1.5, 1.4, 0.1, 1.2, 10, 0.3)
        assert db.get_trace("ab" * 16) == TraceRecord(
            "ab" * 16, "torch:resnet18", "torch", "layer", 1.0, {"layers": []}, [{"name": "x"}]
        )
        assert db.evaluations() == []
    finally:
        db.close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        assert sa.inspect(conn).has_table("evaluations")
        version = conn.execute(sa.text("SELECT value FROM meta WHERE key = 'schema'")).scalar()
    engine.dispose()
    assert version == "3"
