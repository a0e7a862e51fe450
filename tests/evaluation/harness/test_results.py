"""The evaluation results database on SQLite and on a real PostgreSQL server: record, list and
show, filters, migration from schema 1 and 2, interrupted writes, import/merge, and the
``trims evaluate ls|show|import`` commands in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from trims.errors import AlreadyExists, NotFound, ValidationError
from trims.evaluation.db import SCHEMA_VERSION, ResultKey, ResultsDB, TraceRecord
from trims.evaluation.harness.results import (
    AccuracyResult,
    Evaluation,
    EvaluationFilter,
    EvaluationRecord,
    Latency,
    compare,
    describe_system,
    get_evaluation,
    import_database,
    list_evaluations,
    manifest_digest,
    record_evaluation,
)
from trims.evaluation.measure import Measurement

Urls = Callable[[str], str]

#: LoadGen's summary as it prints it: kept byte for byte, trailing spaces and blank lines too.
SUMMARY = (
    "================================================\n"
    "MLPerf Results Summary\n"
    "================================================\n"
    "SUT name : trims-direct\n"
    "Scenario : SingleStream\n"
    "Mode     : PerformanceOnly\n"
    "90th percentile latency (ns) : 1534210\n"
    "Result is : INVALID\n"
    "  Min duration satisfied : NO   \n"
    "Recommendations:\n"
    " * Increase expected QPS so the loadgen pre-generates a larger (coalesced) query.\n"
    "\n"
)


def _evaluation(**changes: Any) -> Evaluation:
    fields: dict[str, Any] = {
        "manifest_name": "resnet18",
        "manifest_version": "1.0",
        "manifest_digest": manifest_digest({"name": "resnet18", "version": "1.0"}),
        "model_digest": "b" * 64,
        "framework": "torch",
        "framework_version": "2.13.0",
        "executor": "local",
        "sut": "direct",
        "scenario": "single-stream",
        "mode": "both",
        "batch": 1,
        "threads": 2,
        "settings": {"min_duration_ms": 1000, "min_query_count": 64, "seed": 7},
        "summary": SUMMARY,
        "valid": False,
        "qps": 651.25,
        "latency": Latency(p50=1.25, p90=1.534, p99=2.75, mean=1.3),
        "accuracy": AccuracyResult("top-1", 0.75, 0.7612, "digits:test", 360),
    }
    fields.update(changes)
    return Evaluation(**fields)


def _trace(trace_id: str, spans: list[Any] | None = None) -> TraceRecord:
    return TraceRecord(
        trace_id=trace_id,
        model="torch:resnet18",
        framework="torch",
        level="model",
        created_at=1.0,
        summary={"trace_id": trace_id},
        spans=[{"name": "model"}] if spans is None else spans,
    )


@pytest.fixture
def db_url(results_db_urls: Urls) -> str:
    return results_db_urls("main")


@pytest.fixture
def open_db(db_url: str) -> Iterator[ResultsDB]:
    db = ResultsDB(db_url)
    try:
        yield db
    finally:
        db.close()


def test_record_list_show_round_trip(open_db: ResultsDB, db_url: str) -> None:
    evaluation = _evaluation()
    stored = record_evaluation(open_db, evaluation, revision=("abc123", True))
    assert stored.id is not None and stored.evaluation == evaluation
    assert len(stored.run_id) == 36 and stored.revision == "abc123" and stored.dirty
    system = stored.system
    assert system["system_id"] == stored.system_id and len(stored.system_id) == 12
    for key in ("cpu", "cores", "memory_bytes", "gpus", "kernel", "os", "python", "frameworks"):
        assert key in system, key
    assert system["frameworks"]["trims"]

    listed = list_evaluations(db_url)
    assert listed == [stored]
    assert listed[0].evaluation.summary == SUMMARY
    assert get_evaluation(db_url, stored.id) == stored
    assert get_evaluation(db_url, stored.run_id[:8]) == stored
    with pytest.raises(NotFound, match="trims evaluate ls"):
        get_evaluation(db_url, stored.id + 1000)
    with pytest.raises(ValidationError, match="at least 4"):
        get_evaluation(db_url, "ab")

    perf_only = record_evaluation(
        open_db, _evaluation(mode="performance", accuracy=None), revision=("abc123", False)
    )
    accuracy_only = record_evaluation(
        db_url, _evaluation(mode="accuracy", qps=None, latency=None, valid=None)
    )
    assert [r.run_id for r in list_evaluations(db_url)] == [
        stored.run_id,
        perf_only.run_id,
        accuracy_only.run_id,
    ]
    again = get_evaluation(open_db, accuracy_only.id or 0)
    assert again.evaluation.latency is None and again.evaluation.valid is None
    assert get_evaluation(db_url, perf_only.run_id).evaluation.accuracy is None


def test_bad_values_are_refused_before_anything_is_written(open_db: ResultsDB) -> None:
    with pytest.raises(ValidationError, match="scenario 'singlestream'"):
        _evaluation(scenario="singlestream")
    with pytest.raises(ValidationError, match="fraction in"):
        AccuracyResult("top-1", 76.1, None, "digits:test", 360)
    record = record_evaluation(open_db, _evaluation())
    with pytest.raises(AlreadyExists, match="stored already"):
        open_db.put_evaluation(record)
    assert len(open_db.evaluations()) == 1


def test_filters(open_db: ResultsDB) -> None:
    system = describe_system()
    other_system = {**system, "system_id": "feedc0ffee00", "cpu": "another cpu"}
    runs = [
        (_evaluation(), system, 1_000.0),
        (_evaluation(framework="onnxruntime", scenario="offline", batch=8), system, 2_000.0),
        (_evaluation(manifest_name="minilm", sut="gateway"), other_system, 3_000.0),
    ]
    stored = []
    for i, (evaluation, sys_, created) in enumerate(runs):
        record = EvaluationRecord(
            evaluation=evaluation,
            run_id=f"{i:08d}-0000-4000-8000-000000000000",
            created_at=created,
            system_id=sys_["system_id"],
            system=sys_,
            revision="r",
            dirty=False,
        )
        open_db.put_evaluation(record)
        stored.append(record.run_id)

    def ids(**where: Any) -> list[str]:
        return [r.run_id for r in open_db.evaluations(EvaluationFilter(**where))]

    assert ids() == stored
    assert ids(model="resnet18") == stored[:2]
    assert ids(framework="onnxruntime") == [stored[1]]
    assert ids(scenario="single-stream") == [stored[0], stored[2]]
    assert ids(sut="gateway") == [stored[2]]
    assert ids(system="feedc0") == [stored[2]]
    assert ids(system=system["system_id"]) == stored[:2]
    assert ids(since=1_500.0) == stored[1:]
    assert ids(model="resnet18", since=1_500.0, framework="torch") == []
    assert ids(system="%") == []  # a LIKE wildcard in the prefix matches only itself


# The table definitions trims wrote before evaluations: schema 1 (meta, results), schema 2
# (+ traces), copied from the previous evaluation/db.py.
def _old_database(url: str, version: int) -> None:
    import sqlalchemy as sa

    meta = sa.MetaData()
    meta_table = sa.Table(
        "meta",
        meta,
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
    )
    results = sa.Table(
        "results",
        meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("system", sa.String(256), nullable=False),
        sa.Column("framework", sa.String(64), nullable=False),
        sa.Column("framework_version", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("batch", sa.Integer, nullable=False),
        sa.Column("variant", sa.String(128), nullable=False),
        sa.Column("trimmed_mean_ms", sa.Float, nullable=False),
        sa.Column("median_ms", sa.Float, nullable=False),
        sa.Column("spread_ms", sa.Float, nullable=False),
        sa.Column("min_ms", sa.Float, nullable=False),
        sa.Column("reps", sa.Integer, nullable=False),
        sa.Column("elapsed_s", sa.Float, nullable=False),
        sa.Column("label", sa.String(256), nullable=False, default=""),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.UniqueConstraint(
            "system",
            "framework",
            "framework_version",
            "kind",
            "signature",
            "batch",
            "variant",
            name="uq_result_key",
        ),
    )
    if version >= 2:
        traces = sa.Table(
            "traces",
            meta,
            sa.Column("trace_id", sa.String(32), primary_key=True),
            sa.Column("model", sa.String(256), nullable=False),
            sa.Column("framework", sa.String(64), nullable=False),
            sa.Column("level", sa.String(16), nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.Column("summary", sa.Text, nullable=False),
            sa.Column("spans", sa.Text, nullable=False),
        )
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        meta.create_all(conn)
        conn.execute(meta_table.insert().values(key="schema", value=str(version)))
        conn.execute(
            results.insert().values(
                system="cpu x2",
                framework="onnxruntime",
                framework_version="1.0",
                kind="layer",
                signature="abc",
                batch=1,
                variant="opt=all",
                trimmed_mean_ms=1.5,
                median_ms=1.4,
                spread_ms=0.1,
                min_ms=1.2,
                reps=10,
                elapsed_s=0.3,
                label="old",
                created_at=0.0,
            )
        )
        if version >= 2:
            conn.execute(
                traces.insert().values(
                    trace_id="ab" * 16,
                    model="torch:resnet18",
                    framework="torch",
                    level="model",
                    created_at=1.0,
                    summary='{"trace_id": "abab"}',
                    spans='[{"name": "model"}]',
                )
            )
    engine.dispose()


OLD_KEY = ResultKey("cpu x2", "onnxruntime", "1.0", "layer", "abc", 1, "opt=all")


def _schema_version(url: str) -> str:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return str(
                conn.execute(sa.text("SELECT value FROM meta WHERE key = 'schema'")).scalar()
            )
    finally:
        engine.dispose()


@pytest.mark.parametrize("version", [1, 2])
def test_old_database_is_migrated_and_keeps_its_data(db_url: str, version: int) -> None:
    _old_database(db_url, version)
    readonly = ResultsDB(db_url, readonly=True)
    try:
        assert readonly.version == version
        assert readonly.evaluations() == []
        assert [t.trace_id for t in readonly.traces()] == (["ab" * 16] if version == 2 else [])
    finally:
        readonly.close()
    assert _schema_version(db_url) == str(version), "a read-only open must not migrate"

    db = ResultsDB(db_url)
    try:
        assert db.version == SCHEMA_VERSION == 3
        assert db.get(OLD_KEY) == Measurement(1.5, 1.4, 0.1, 1.2, 10, 0.3)
        if version == 2:
            trace = db.get_trace("ab" * 16)
            assert trace is not None and trace.spans == [{"name": "model"}]
        stored = record_evaluation(db, _evaluation(), traces=[_trace("cd" * 16)])
        assert db.evaluations() == [stored]
    finally:
        db.close()
    assert _schema_version(db_url) == "3"
    reopened = ResultsDB(db_url)
    try:
        assert reopened.version == 3 and len(reopened.evaluations()) == 1
    finally:
        reopened.close()


def test_interrupted_write_leaves_nothing(open_db: ResultsDB) -> None:
    def interrupted() -> Iterator[TraceRecord]:
        yield _trace("11" * 16)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        record_evaluation(open_db, _evaluation(), traces=interrupted())
    with pytest.raises(TypeError, match="not JSON serializable"):
        record_evaluation(open_db, _evaluation(), traces=[_trace("22" * 16, [object()])])
    assert open_db.evaluations() == []
    assert open_db.get_trace("11" * 16) is None and open_db.get_trace("22" * 16) is None
    assert open_db.traces() == []
    stored = record_evaluation(open_db, _evaluation(), traces=[_trace("33" * 16)])
    assert open_db.evaluations() == [stored]
    assert [t.trace_id for t in open_db.traces()] == ["33" * 16]


def test_import_merges_and_skips_run_ids_present(results_db_urls: Urls) -> None:
    a, b = results_db_urls("a"), results_db_urls("b")
    a1 = record_evaluation(a, _evaluation(), traces=[_trace("aa" * 16)])
    a2 = record_evaluation(a, _evaluation(scenario="offline", batch=4))
    b1 = record_evaluation(b, _evaluation(framework="onnxruntime"), traces=[_trace("bb" * 16)])

    first = import_database(a, b)
    assert (first.added, first.skipped, first.traces_added, first.traces_skipped) == (2, 0, 1, 0)
    assert first.source_schema == 3
    merged = list_evaluations(b)
    assert {r.run_id for r in merged} == {a1.run_id, a2.run_id, b1.run_id}
    imported = next(r for r in merged if r.run_id == a1.run_id)
    assert imported.evaluation == a1.evaluation and imported.system == a1.system
    assert imported.created_at == a1.created_at

    second = import_database(a, b)
    assert (second.added, second.skipped, second.traces_added, second.traces_skipped) == (
        0,
        2,
        0,
        1,
    )
    assert len(list_evaluations(b)) == 3
    back = import_database(b, a)
    assert (back.added, back.skipped, back.traces_added) == (1, 2, 1)
    assert len(list_evaluations(a)) == 3


def test_import_from_an_older_database_and_refusals(results_db_urls: Urls, tmp_path: Any) -> None:
    old, target = results_db_urls("old"), results_db_urls("target")
    _old_database(old, 2)
    report = import_database(old, target)
    assert (report.source_schema, report.added, report.traces_added) == (2, 0, 1)
    assert _schema_version(old) == "2", "the source of an import is never migrated"

    newer = results_db_urls("newer")
    ResultsDB(newer).close()
    import sqlalchemy as sa

    engine = sa.create_engine(newer)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE meta SET value = '99' WHERE key = 'schema'"))
    engine.dispose()
    with pytest.raises(ValidationError, match=r"schema version 99.*newer trims"):
        import_database(newer, target)
    with pytest.raises(NotFound, match="no results database at"):
        import_database(str(tmp_path / "missing.sqlite"), target)
    assert not (tmp_path / "missing.sqlite").exists()


def _trims(*args: str, db: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRIMS_RESULTS_DB"}
    if db is not None:
        env["TRIMS_RESULTS_DB"] = db
    return subprocess.run(
        [sys.executable, "-m", "trims.cli", "evaluate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_cli_ls_show_import(results_db_urls: Urls) -> None:
    a, b = results_db_urls("a"), results_db_urls("b")
    first = record_evaluation(a, _evaluation())
    record_evaluation(a, _evaluation(manifest_name="minilm", framework="onnxruntime"))

    done = _trims("ls", "--json", db=a)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    entries = body["evaluations"]
    assert [e["model"] for e in entries] == ["resnet18", "minilm"]
    assert entries[0]["latency_ms"] == {"p50": 1.25, "p90": 1.534, "p99": 2.75, "mean": 1.3}
    assert entries[0]["accuracy"] == {
        "metric": "top-1",
        "value": 0.75,
        "reference": 0.7612,
        "dataset": "digits:test",
        "samples": 360,
    }
    filtered = json.loads(_trims("ls", "--json", "--framework", "onnxruntime", db=a).stdout)
    assert [e["model"] for e in filtered["evaluations"]] == ["minilm"]
    table = _trims("ls", "--db", a, "--since", "1d")
    assert table.returncode == 0, table.stderr
    assert "resnet18:1.0" in table.stdout and "minilm:1.0" in table.stdout

    shown = _trims("show", first.run_id[:8], "--json", "--db", a)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == first.to_dict()
    text = _trims("show", str(first.id), "--db", a)
    assert text.returncode == 0, text.stderr
    assert SUMMARY in text.stdout

    imported = _trims("import", a, "--json", "--db", b)
    assert imported.returncode == 0, imported.stderr
    assert json.loads(imported.stdout)["added"] == 2
    again = _trims("import", a, "--db", b)
    assert again.returncode == 0, again.stderr
    assert "imported 0 evaluations (2 already present)" in again.stdout


@pytest.mark.parametrize(
    ("db", "message"),
    [
        ("nosuchdialect://x/y", "unknown database dialect"),
        ("postgresql+psycopg://nobody@/x?host=/nonexistent-dir&port=1", "cannot open"),
    ],
)
def test_cli_bad_url_is_one_error_line(db: str, message: str) -> None:
    done = _trims("ls", "--db", db)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert message in done.stderr and "trims evaluate: error:" in done.stderr


def test_cli_missing_database_and_bad_since(tmp_path: Any) -> None:
    missing = tmp_path / "none.sqlite"
    done = _trims("ls", "--db", str(missing))
    assert done.returncode == 1 and "no results database at" in done.stderr
    assert "Traceback" not in done.stderr and not missing.exists()
    bad = _trims("ls", "--since", "yesterday", db=str(missing))
    assert bad.returncode == 1 and "--since 'yesterday'" in bad.stderr


def test_compare_tables_and_plots(results_db_urls: Urls, tmp_path: Any) -> None:
    db = results_db_urls("c")
    here = describe_system()
    there = {**here, "system_id": "0123456789ab"}
    record_evaluation(db, _evaluation(latency=Latency(9.0, 9.0, 9.0, 9.0)))
    record_evaluation(db, _evaluation())  # newer: replaces the 9.0 cell
    record_evaluation(db, _evaluation(scenario="offline", batch=8, qps=900.0))
    record_evaluation(db, _evaluation(framework="onnxruntime", latency=Latency(0.5, 1, 1, 1)))
    record_evaluation(db, _evaluation(latency=Latency(2.0, 2, 2, 2)), system=there)
    record_evaluation(db, _evaluation(mode="accuracy", latency=None, qps=None))

    tables = {c.title: c for c in compare(list_evaluations(db), "p50")}
    models = tables["models x scenarios"]
    assert models.columns == ["offline", "single-stream"]
    assert models.rows == [
        "resnet18:1.0 b8 torch direct",
        "resnet18:1.0 onnxruntime direct",
        "resnet18:1.0 torch direct",
    ]
    assert models.values == [[1.25, None], [None, 0.5], [None, 2.0]]
    frameworks = tables["frameworks side by side"]
    assert frameworks.columns == ["onnxruntime", "torch"]
    assert frameworks.values[frameworks.rows.index("resnet18:1.0 single-stream direct")] == [
        0.5,
        2.0,
    ]
    systems = tables["systems side by side"]
    assert systems.columns == sorted(["0123456789ab", here["system_id"]])
    row = systems.values[systems.rows.index("resnet18:1.0 torch single-stream direct")]
    assert dict(zip(systems.columns, row, strict=True)) == {
        "0123456789ab": 2.0,
        here["system_id"]: 1.25,
    }
    with pytest.raises(ValidationError, match="metric 'p42'"):
        compare([], "p42")

    plots = tmp_path / "plots"
    done = _trims("compare", "--metric", "qps", "--json", "--plots", str(plots), db=db)
    assert done.returncode == 0, done.stderr
    by_title = {c["title"]: c for c in json.loads(done.stdout)["comparisons"]}
    assert by_title["models x scenarios"]["unit"] == "queries/s"
    assert [900.0, None] in by_title["models x scenarios"]["values"]
    written = sorted(p.name for p in plots.iterdir())
    assert written == [
        "compare-frameworks-side-by-side.png",
        "compare-models-x-scenarios.png",
        "compare-systems-side-by-side.png",
    ]
    assert all((plots / name).read_bytes()[:4] == b"\x89PNG" for name in written)
    text = _trims("compare", "--scenario", "single-stream", db=db)
    assert text.returncode == 0, text.stderr
    assert "frameworks side by side: p50 (ms)" in text.stdout and "offline" not in text.stdout


def test_a_run_id_prefix_of_digits_only_finds_its_evaluation(open_db: ResultsDB) -> None:
    """A run id is hex, so its prefix can be all digits ("40131957", as one CI run drew): it is
    an id only when an evaluation has that id, else the run id prefix."""
    record = EvaluationRecord(
        evaluation=_evaluation(),
        run_id="40131957-aaaa-4bbb-8ccc-123456789abc",
        created_at=1.0,
        system_id="s",
        system={"system_id": "s"},
        revision="r",
        dirty=False,
    )
    row_id = open_db.put_evaluation(record)
    assert open_db.get_evaluation("40131957").run_id == record.run_id
    assert open_db.get_evaluation(str(row_id)).run_id == record.run_id
    assert open_db.get_evaluation(row_id).run_id == record.run_id
