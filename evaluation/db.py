"""Results database: layer measurements, one row per (system, framework, version, kind,
signature, batch, variant); traces (``trims trace``), one row per trace id; and model
evaluations (``trims evaluate``), one row per run id.

SQLAlchemy Core, SQLite by default, PostgreSQL for shared use (any SQLAlchemy URL works, e.g.
``postgresql+psycopg://user@host/db``). The schema carries a version in ``meta``; opening a
database written by a newer schema version is refused with a message saying what to do, never
silently mixed. Driver and connection errors are translated to the :mod:`trims.errors` tree
here (:data:`_SA_ERRORS`), so no caller sees a SQLAlchemy traceback.

Note [schema migrations]
~~~~~~~~~~~~~~~~~~~~~~~~
Each version adds to the one before and never changes what is there: version 2 added the
``traces`` table, version 3 the ``evaluations`` table. ``create_all`` creates missing tables
(it never alters existing ones), so an older database opened here gains the new tables and then
has its ``meta`` version raised, all in one transaction (PostgreSQL and SQLite both run DDL
inside a transaction, so a failed migration leaves the old version whole). A database from a
newer trims is refused: it may hold what this code would misread. A database opened
``readonly`` (the source of ``trims evaluate import``) is never migrated: its version is
checked, and tables its version does not have read as empty.

Note [one evaluation, one transaction]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An evaluation row and the traces recorded with it are written in one transaction, and an
import writes all its rows in one transaction: an exception or a killed process part way leaves
the database as it was before, never an evaluation without its traces or half an import.
Merging relies on ``run_id`` (a uuid4 made when the evaluation is recorded, UNIQUE): the local
``id`` differs between databases, the run id never does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from trims.errors import AlreadyExists, NotFound, TrimsError, Unavailable, ValidationError
from trims.evaluation.measure import Measurement

if TYPE_CHECKING:
    import sqlalchemy as sa

log = logging.getLogger(__name__)

__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "AccuracyResult",
    "Evaluation",
    "EvaluationFilter",
    "EvaluationRecord",
    "Latency",
    "LayerResult",
    "ResultKey",
    "ResultsDB",
    "TraceInfo",
    "TraceRecord",
    "UnreadableEvaluation",
    "cpu_model",
    "system_id",
]

SCHEMA_VERSION = 3
#: from-version -> what the step does (logged); the tables themselves come from create_all
MIGRATIONS: dict[int, str] = {1: "added the traces table", 2: "added the evaluations table"}

#: what an evaluation may name (the ``trims evaluate run`` choices)
EXECUTORS = ("local", "docker", "kubernetes")
SUTS = ("direct", "gateway", "pipeline")
SCENARIOS = ("single-stream", "multi-stream", "server", "offline")
MODES = ("performance", "accuracy", "both")


@dataclass(frozen=True)
class TraceRecord:
    """One stored trace: its summary (the ``trims trace`` JSON) and its spans."""

    trace_id: str
    model: str
    framework: str
    level: str
    created_at: float
    summary: dict[str, Any]
    spans: list[dict[str, Any]]


@dataclass(frozen=True)
class TraceInfo:
    """A stored trace without its spans: what a list of traces shows."""

    trace_id: str
    model: str
    framework: str
    level: str
    created_at: float
    summary: dict[str, Any]


@dataclass(frozen=True)
class Latency:
    """Latency percentiles of one evaluation, in milliseconds (LoadGen's per-query latencies)."""

    p50: float
    p90: float
    p99: float
    mean: float


@dataclass(frozen=True)
class AccuracyResult:
    """Accuracy of one evaluation: ``value`` and ``reference`` are fractions in [0, 1]."""

    metric: str
    value: float
    reference: float | None
    dataset: str
    samples: int

    def __post_init__(self) -> None:
        for name in ("value", "reference"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValidationError(
                    f"accuracy.{name} is {v}: accuracy is a fraction in [0, 1] (write 0.761, "
                    "not 76.1)"
                )
        if self.samples < 0:
            raise ValidationError(f"accuracy.samples is {self.samples}: must be >= 0")


@dataclass(frozen=True)
class Evaluation:
    """What one evaluation ran and measured: the part the harness fills in.

    ``settings`` are LoadGen's test settings as JSON, ``summary`` LoadGen's summary text kept
    verbatim (VALID/INVALID and why). Performance fields are None in accuracy-only runs;
    ``accuracy`` is None in performance-only runs and for weights that are not real.
    """

    manifest_name: str
    manifest_version: str
    manifest_digest: str
    model_digest: str
    framework: str
    framework_version: str
    executor: str
    sut: str
    scenario: str
    mode: str
    batch: int = 1
    threads: int = 1
    settings: dict[str, Any] = field(default_factory=dict)
    summary: str = ""
    valid: bool | None = None
    qps: float | None = None
    latency: Latency | None = None
    accuracy: AccuracyResult | None = None

    def __post_init__(self) -> None:
        for name, allowed in (
            ("executor", EXECUTORS),
            ("sut", SUTS),
            ("scenario", SCENARIOS),
            ("mode", MODES),
        ):
            if getattr(self, name) not in allowed:
                raise ValidationError(
                    f"evaluation {name} {getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        if self.batch < 1 or self.threads < 1:
            raise ValidationError(
                f"evaluation batch {self.batch} and threads {self.threads} must both be >= 1"
            )


@dataclass(frozen=True)
class EvaluationRecord:
    """A stored evaluation: the :class:`Evaluation` and where, when and by what it ran.

    ``system`` is the system description (CPU, memory, GPU, kernel, OS, Python, framework
    versions), ``system_id`` its short key; ``revision`` the project's git revision (or package
    version) and ``dirty`` whether the checkout had uncommitted changes. ``id`` is local to one
    database; ``run_id`` is the same in every database the record is merged into.
    """

    evaluation: Evaluation
    run_id: str
    created_at: float
    system_id: str
    system: dict[str, Any]
    revision: str
    dirty: bool
    id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """All fields as JSON-ready values, the evaluation's fields at the top level."""
        body: dict[str, Any] = {"id": self.id, "run_id": self.run_id}
        body.update(asdict(self.evaluation))
        body.update(
            created_at=self.created_at,
            system_id=self.system_id,
            system=self.system,
            revision=self.revision,
            dirty=self.dirty,
        )
        return body


class UnreadableEvaluation(ValidationError):
    """A stored evaluation row that makes no :class:`EvaluationRecord`: written by another
    tool or by hand (SQLite keeps whatever a writer puts in a column, text where a number
    belongs too). ``row_id`` is its id."""

    code = "unreadable_evaluation"

    def __init__(self, row_id: int, reason: str, where: str) -> None:
        super().__init__(
            f"evaluation {row_id} in {where} could not be read ({reason}); it was not written "
            "by trims evaluate: delete the row or fix it",
            row_id=row_id,
        )
        self.row_id = row_id


@dataclass(frozen=True)
class EvaluationFilter:
    """Which evaluations to list; None matches everything. ``system`` is a system_id prefix,
    ``since`` a Unix time (seconds)."""

    model: str | None = None
    framework: str | None = None
    scenario: str | None = None
    sut: str | None = None
    system: str | None = None
    since: float | None = None


@dataclass(frozen=True)
class ResultKey:
    """What a measurement is of, and where."""

    system: str
    framework: str
    framework_version: str
    kind: str
    signature: str
    batch: int
    variant: str


@dataclass(frozen=True)
class LayerResult:
    """One stored layer-analysis measurement, with what it is of and when it was taken."""

    key: ResultKey
    measurement: Measurement
    label: str
    created_at: float


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (the platform's name elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def system_id() -> str:
    """CPU model and core count, e.g. ``Intel(R) Xeon(R) ... x2``."""
    return f"{cpu_model()} x{os.cpu_count() or 1}"


#: SQLAlchemy exception (by name, most specific first) -> the trims error and what to do
_SA_ERRORS: tuple[tuple[str, type[TrimsError], str], ...] = (
    ("NoSuchModuleError", ValidationError, "unknown database dialect or driver; use a path to a "
     "SQLite file, sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"),
    ("ArgumentError", ValidationError, "not a database URL; use a path to a SQLite file, "
     "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"),
    ("OperationalError", Unavailable, "cannot open the database; check that the server runs, "
     "the path or URL, and the credentials"),
    ("IntegrityError", AlreadyExists, "a row with this key is stored already"),
    ("DatabaseError", ValidationError, "not a trims results database (or a damaged one); "
     "pass another --db"),
    ("SQLAlchemyError", TrimsError, "database error"),
)  # fmt: skip


@contextlib.contextmanager
def _translated(url: str) -> Iterator[None]:
    """Raise SQLAlchemy and driver errors as the :data:`_SA_ERRORS` entry that matches first."""
    import sqlalchemy.exc as sa_exc

    try:
        yield
    except sa_exc.SQLAlchemyError as e:
        for name, error, hint in _SA_ERRORS:
            if isinstance(e, getattr(sa_exc, name)):
                lines = str(getattr(e, "orig", None) or e).strip().splitlines()
                detail = lines[0] if lines else type(e).__name__
                raise error(f"results database {url}: {hint} ({detail})") from e
        raise
    except ImportError as e:
        raise ValidationError(
            f"results database {url}: its database driver is not installed ({e}); "
            "install trims[evaluation] (psycopg for PostgreSQL)"
        ) from e


def _display(url: str) -> str:
    """``url`` with any password masked, for messages and logs."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _make_parent(path: str) -> None:
    """Create a SQLite file's folder (0700 when it is new: results name models and hosts)."""
    if path in ("", ":memory:"):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:
            raise ValidationError(
                f"cannot create the results database's folder {folder}: {e.strerror}; pass "
                "another path with --db (or $TRIMS_RESULTS_DB)"
            ) from e


#: The results table's columns that hold a :class:`Measurement`, by its field names.
_MEASUREMENT_FIELDS = ("trimmed_mean_ms", "median_ms", "spread_ms", "min_ms", "reps", "elapsed_s")


#: a column's Python type, as an error message names it
_KINDS = {bool: "a boolean", int: "a whole number", float: "a number", str: "text"}


def _holds(kind: type, value: object) -> bool:
    """Whether a column of Python type ``kind`` may hold ``value`` as read: SQLite keeps what a
    writer puts in a column, whatever its declared type."""
    if value is None:
        return True
    if kind is bool:
        return value in (0, 1)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, int | float)
    return isinstance(value, kind)


def _measurement(row: Any) -> Measurement:
    """A results row (a mapping with the measurement columns) as its Measurement."""
    return Measurement(**{name: row[name] for name in _MEASUREMENT_FIELDS})


class ResultsDB:
    """Store and look up results; ``url`` is an SQLAlchemy URL or a SQLite file path.

    ``readonly`` opens an existing database without creating or migrating anything (see
    Note [schema migrations]); a missing SQLite file is then NotFound instead of created.
    """

    def __init__(self, url: str, *, readonly: bool = False) -> None:
        import sqlalchemy as sa

        if "://" not in url:
            url = f"sqlite:///{url}"
        self.url = url
        self.readonly = readonly
        self._display = _display(url)
        with _translated(self._display):
            parsed = sa.engine.make_url(url)
            if readonly and parsed.get_backend_name() == "sqlite":
                path = parsed.database or ""
                if path in ("", ":memory:") or not os.path.isfile(path):
                    raise NotFound(
                        f"no results database at {path or url}; pass an existing SQLite file "
                        "or database URL with --db (or $TRIMS_RESULTS_DB)"
                    )
            if not readonly and parsed.get_backend_name() == "sqlite":
                _make_parent(parsed.database or "")
            self._engine = sa.create_engine(url)
        meta = sa.MetaData()
        self._meta_table = sa.Table(
            "meta",
            meta,
            sa.Column("key", sa.String(64), primary_key=True),
            sa.Column("value", sa.String(256), nullable=False),
        )
        self._results = sa.Table(
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
        self._traces = sa.Table(
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
        self._evaluations = sa.Table(
            "evaluations",
            meta,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("run_id", sa.String(36), nullable=False, unique=True),
            sa.Column("created_at", sa.Float, nullable=False, index=True),
            sa.Column("manifest_name", sa.String(256), nullable=False, index=True),
            sa.Column("manifest_version", sa.String(64), nullable=False),
            sa.Column("manifest_digest", sa.String(64), nullable=False),
            sa.Column("model_digest", sa.String(64), nullable=False),
            sa.Column("framework", sa.String(64), nullable=False),
            sa.Column("framework_version", sa.String(64), nullable=False),
            sa.Column("system_id", sa.String(32), nullable=False),
            sa.Column("system", sa.Text, nullable=False),
            sa.Column("executor", sa.String(16), nullable=False),
            sa.Column("sut", sa.String(16), nullable=False),
            sa.Column("scenario", sa.String(16), nullable=False),
            sa.Column("mode", sa.String(16), nullable=False),
            sa.Column("batch", sa.Integer, nullable=False),
            sa.Column("threads", sa.Integer, nullable=False),
            sa.Column("settings", sa.Text, nullable=False),
            sa.Column("summary", sa.Text, nullable=False),
            sa.Column("valid", sa.Boolean, nullable=True),
            sa.Column("qps", sa.Float, nullable=True),
            sa.Column("latency_p50_ms", sa.Float, nullable=True),
            sa.Column("latency_p90_ms", sa.Float, nullable=True),
            sa.Column("latency_p99_ms", sa.Float, nullable=True),
            sa.Column("latency_mean_ms", sa.Float, nullable=True),
            sa.Column("accuracy_metric", sa.String(64), nullable=True),
            sa.Column("accuracy_value", sa.Float, nullable=True),
            sa.Column("accuracy_reference", sa.Float, nullable=True),
            sa.Column("accuracy_dataset", sa.String(256), nullable=True),
            sa.Column("accuracy_samples", sa.Integer, nullable=True),
            sa.Column("revision", sa.String(64), nullable=False),
            sa.Column("dirty", sa.Boolean, nullable=False),
        )
        with _translated(self._display):
            self.version = self._check_version(meta)

    def _check_version(self, meta: sa.MetaData) -> int:
        """The schema version, after migrating (Note [schema migrations]) unless readonly."""
        import sqlalchemy as sa

        if not self.readonly:
            self._meta_table.create(self._engine, checkfirst=True)
        with self._engine.begin() as conn:
            if self.readonly and not sa.inspect(conn).has_table("meta"):
                raise ValidationError(
                    f"{self._display} is not a trims results database (it has no meta table); "
                    "pass the database trims evaluate/analyze/trace wrote"
                )
            row = conn.execute(
                sa.select(self._meta_table.c.value).where(self._meta_table.c.key == "schema")
            ).first()
            if row is None:
                if self.readonly:
                    raise ValidationError(f"{self._display} has no schema version in meta")
                meta.create_all(conn)
                conn.execute(
                    self._meta_table.insert().values(key="schema", value=str(SCHEMA_VERSION))
                )
                return SCHEMA_VERSION
            version = int(row[0])
            if version > SCHEMA_VERSION or version not in (*MIGRATIONS, SCHEMA_VERSION):
                raise ValidationError(
                    f"results database {self._display} has schema version {row[0]}, this trims "
                    f"writes version {SCHEMA_VERSION}; use a new --db file or a newer trims"
                )
            if self.readonly:
                return version
            # Note [schema migrations]: create_all adds the tables newer versions brought
            meta.create_all(conn)
            while version < SCHEMA_VERSION:
                conn.execute(
                    self._meta_table.update()
                    .where(self._meta_table.c.key == "schema")
                    .values(value=str(version + 1))
                )
                log.info("results database %s migrated from schema %d: %s",
                         self._display, version, MIGRATIONS[version])  # fmt: skip
                version += 1
            return version

    def _where(self, key: ResultKey) -> list[sa.ColumnElement[bool]]:
        c = self._results.c
        return [
            c.system == key.system,
            c.framework == key.framework,
            c.framework_version == key.framework_version,
            c.kind == key.kind,
            c.signature == key.signature,
            c.batch == key.batch,
            c.variant == key.variant,
        ]

    def get(self, key: ResultKey) -> Measurement | None:
        """The stored measurement for ``key``, or None."""
        import sqlalchemy as sa

        c = self._results.c
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    c.trimmed_mean_ms, c.median_ms, c.spread_ms, c.min_ms, c.reps, c.elapsed_s
                ).where(*self._where(key))
            ).first()
        return None if row is None else _measurement(row._mapping)

    def put(self, key: ResultKey, result: Measurement, label: str = "") -> None:
        """Store (or replace) the measurement for ``key``."""
        values: dict[str, Any] = {
            "system": key.system,
            "framework": key.framework,
            "framework_version": key.framework_version,
            "kind": key.kind,
            "signature": key.signature,
            "batch": key.batch,
            "variant": key.variant,
            "trimmed_mean_ms": result.trimmed_mean_ms,
            "median_ms": result.median_ms,
            "spread_ms": result.spread_ms,
            "min_ms": result.min_ms,
            "reps": result.reps,
            "elapsed_s": result.elapsed_s,
            "label": label[:256],
            "created_at": time.time(),
        }
        with self._engine.begin() as conn:
            conn.execute(self._results.delete().where(*self._where(key)))
            conn.execute(self._results.insert().values(**values))

    @staticmethod
    def _trace_values(record: TraceRecord) -> dict[str, Any]:
        return {
            "trace_id": record.trace_id,
            "model": record.model[:256],
            "framework": record.framework,
            "level": record.level,
            "created_at": record.created_at,
            "summary": json.dumps(record.summary),
            "spans": json.dumps(record.spans),
        }

    def put_trace(self, record: TraceRecord) -> None:
        """Store (or replace) a trace by its id."""
        values = self._trace_values(record)
        with self._engine.begin() as conn:
            conn.execute(self._traces.delete().where(self._traces.c.trace_id == record.trace_id))
            conn.execute(self._traces.insert().values(**values))

    def get_trace(self, trace_id: str) -> TraceRecord | None:
        """The stored trace with this id, or None."""
        import sqlalchemy as sa

        t = self._traces.c
        with self._engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    t.trace_id, t.model, t.framework, t.level, t.created_at, t.summary, t.spans
                ).where(t.trace_id == trace_id)
            ).first()
        if row is None:
            return None
        return TraceRecord(
            trace_id=row[0],
            model=row[1],
            framework=row[2],
            level=row[3],
            created_at=row[4],
            summary=json.loads(row[5]),
            spans=json.loads(row[6]),
        )

    def trace_ids(self, model: str | None = None) -> list[str]:
        """Stored trace ids, newest first (of one model if given)."""
        import sqlalchemy as sa

        t = self._traces.c
        query = sa.select(t.trace_id).order_by(t.created_at.desc())
        if model is not None:
            query = query.where(t.model == model)
        with self._engine.connect() as conn:
            return [r[0] for r in conn.execute(query)]

    def trace_infos(self, limit: int = 500) -> list[TraceInfo]:
        """The newest ``limit`` stored traces without their spans, newest first."""
        import sqlalchemy as sa

        if self.version < 2:
            return []
        t = self._traces.c
        query = (
            sa.select(t.trace_id, t.model, t.framework, t.level, t.created_at, t.summary)
            .order_by(t.created_at.desc(), t.trace_id)
            .limit(limit)
        )
        with _translated(self._display), self._engine.connect() as conn:
            return [
                TraceInfo(
                    trace_id=r[0],
                    model=r[1],
                    framework=r[2],
                    level=r[3],
                    created_at=r[4],
                    summary=json.loads(r[5]),
                )
                for r in conn.execute(query)
            ]

    def layer_results(
        self, *, kind: str | None = None, framework: str | None = None, limit: int = 5000
    ) -> list[LayerResult]:
        """Stored layer-analysis measurements (of one kind and framework if given), at most
        ``limit``, ordered by system, framework, kind and label."""
        import sqlalchemy as sa

        c = self._results.c
        query = sa.select(self._results).order_by(c.system, c.framework, c.kind, c.label, c.id)
        if kind is not None:
            query = query.where(c.kind == kind)
        if framework is not None:
            query = query.where(c.framework == framework)
        with _translated(self._display), self._engine.connect() as conn:
            rows = [r._mapping for r in conn.execute(query.limit(limit))]
        return [
            LayerResult(
                key=ResultKey(
                    system=m["system"],
                    framework=m["framework"],
                    framework_version=m["framework_version"],
                    kind=m["kind"],
                    signature=m["signature"],
                    batch=m["batch"],
                    variant=m["variant"],
                ),
                measurement=_measurement(m),
                label=m["label"],
                created_at=m["created_at"],
            )
            for m in rows
        ]

    def _writable(self) -> None:
        if self.readonly:
            raise ValidationError(f"results database {self._display} was opened read-only")

    @staticmethod
    def _evaluation_values(record: EvaluationRecord) -> dict[str, Any]:
        e = record.evaluation
        lat, acc = e.latency, e.accuracy
        return {
            "run_id": record.run_id,
            "created_at": record.created_at,
            "manifest_name": e.manifest_name[:256],
            "manifest_version": e.manifest_version[:64],
            "manifest_digest": e.manifest_digest[:64],
            "model_digest": e.model_digest[:64],
            "framework": e.framework[:64],
            "framework_version": e.framework_version[:64],
            "system_id": record.system_id[:32],
            "system": json.dumps(record.system, sort_keys=True),
            "executor": e.executor,
            "sut": e.sut,
            "scenario": e.scenario,
            "mode": e.mode,
            "batch": e.batch,
            "threads": e.threads,
            "settings": json.dumps(e.settings, sort_keys=True),
            "summary": e.summary,
            "valid": e.valid,
            "qps": e.qps,
            "latency_p50_ms": None if lat is None else lat.p50,
            "latency_p90_ms": None if lat is None else lat.p90,
            "latency_p99_ms": None if lat is None else lat.p99,
            "latency_mean_ms": None if lat is None else lat.mean,
            "accuracy_metric": None if acc is None else acc.metric[:64],
            "accuracy_value": None if acc is None else acc.value,
            "accuracy_reference": None if acc is None else acc.reference,
            "accuracy_dataset": None if acc is None else acc.dataset[:256],
            "accuracy_samples": None if acc is None else acc.samples,
            "revision": record.revision[:64],
            "dirty": record.dirty,
        }

    def _evaluation_record(self, row: Any) -> EvaluationRecord:
        """The record of ``row``; UnreadableEvaluation when the row holds what no record can."""
        m = row._mapping
        try:
            for column in self._evaluations.columns:
                kind = column.type.python_type
                if not _holds(kind, m[column.name]):
                    raise ValidationError(
                        f"{column.name} holds {m[column.name]!r}, not {_KINDS[kind]}"
                    )
            record = self._evaluation_fields(m)
            if not isinstance(record.system, dict) or not isinstance(
                record.evaluation.settings, dict
            ):
                raise ValidationError("system and settings must each hold a JSON object")
            return record
        except (TrimsError, ValueError, TypeError) as e:
            message = e.message if isinstance(e, TrimsError) else str(e)
            raise UnreadableEvaluation(m["id"], message, self._display) from e

    @staticmethod
    def _evaluation_fields(m: Any) -> EvaluationRecord:
        latency = (
            None
            if m["latency_p50_ms"] is None
            else Latency(
                p50=m["latency_p50_ms"],
                p90=m["latency_p90_ms"],
                p99=m["latency_p99_ms"],
                mean=m["latency_mean_ms"],
            )
        )
        accuracy = (
            None
            if m["accuracy_metric"] is None
            else AccuracyResult(
                metric=m["accuracy_metric"],
                value=m["accuracy_value"],
                reference=m["accuracy_reference"],
                dataset=m["accuracy_dataset"],
                samples=m["accuracy_samples"],
            )
        )
        evaluation = Evaluation(
            manifest_name=m["manifest_name"],
            manifest_version=m["manifest_version"],
            manifest_digest=m["manifest_digest"],
            model_digest=m["model_digest"],
            framework=m["framework"],
            framework_version=m["framework_version"],
            executor=m["executor"],
            sut=m["sut"],
            scenario=m["scenario"],
            mode=m["mode"],
            batch=m["batch"],
            threads=m["threads"],
            settings=json.loads(m["settings"]),
            summary=m["summary"],
            valid=None if m["valid"] is None else bool(m["valid"]),
            qps=m["qps"],
            latency=latency,
            accuracy=accuracy,
        )
        return EvaluationRecord(
            evaluation=evaluation,
            run_id=m["run_id"],
            created_at=m["created_at"],
            system_id=m["system_id"],
            system=json.loads(m["system"]),
            revision=m["revision"],
            dirty=bool(m["dirty"]),
            id=m["id"],
        )

    def put_evaluation(self, record: EvaluationRecord, traces: Iterable[TraceRecord] = ()) -> int:
        """Store an evaluation and its traces in one transaction; returns the evaluation's id.

        See Note [one evaluation, one transaction]: if anything raises part way (a trace that
        does not serialize, a lost connection), nothing of it is stored.
        """
        self._writable()
        with _translated(self._display), self._engine.begin() as conn:
            result = conn.execute(
                self._evaluations.insert().values(**self._evaluation_values(record))
            )
            for trace in traces:
                conn.execute(self._traces.delete().where(self._traces.c.trace_id == trace.trace_id))
                conn.execute(self._traces.insert().values(**self._trace_values(trace)))
            key = result.inserted_primary_key
            assert key is not None
            return int(key[0])

    def merge(
        self, records: Iterable[EvaluationRecord], traces: Iterable[TraceRecord]
    ) -> tuple[int, int, int, int]:
        """Add the evaluations whose run id and the traces whose trace id this database lacks,
        in one transaction. Returns (evaluations added, skipped, traces added, skipped)."""
        import sqlalchemy as sa

        self._writable()
        added = skipped = traces_added = traces_skipped = 0
        with _translated(self._display), self._engine.begin() as conn:
            run_ids = set(conn.scalars(sa.select(self._evaluations.c.run_id)))
            for record in records:
                if record.run_id in run_ids:
                    skipped += 1
                    continue
                conn.execute(self._evaluations.insert().values(**self._evaluation_values(record)))
                run_ids.add(record.run_id)
                added += 1
            trace_ids = set(conn.scalars(sa.select(self._traces.c.trace_id)))
            for trace in traces:
                if trace.trace_id in trace_ids:
                    traces_skipped += 1
                    continue
                conn.execute(self._traces.insert().values(**self._trace_values(trace)))
                trace_ids.add(trace.trace_id)
                traces_added += 1
        return added, skipped, traces_added, traces_skipped

    def _evaluation_rows(self, where: EvaluationFilter | None) -> list[Any]:
        import sqlalchemy as sa

        if self.version < 3:
            return []
        c = self._evaluations.c
        query = sa.select(self._evaluations).order_by(c.created_at, c.id)
        if where is not None:
            for column, value in (
                (c.manifest_name, where.model),
                (c.framework, where.framework),
                (c.scenario, where.scenario),
                (c.sut, where.sut),
            ):
                if value is not None:
                    query = query.where(column == value)
            if where.system is not None:
                query = query.where(c.system_id.startswith(where.system, autoescape=True))
            if where.since is not None:
                query = query.where(c.created_at >= where.since)
        with _translated(self._display), self._engine.connect() as conn:
            return list(conn.execute(query))

    def evaluations(self, where: EvaluationFilter | None = None) -> list[EvaluationRecord]:
        """Stored evaluations matching ``where``, oldest first; UnreadableEvaluation when one
        of them is (:meth:`readable_evaluations` leaves such rows out instead)."""
        return [self._evaluation_record(row) for row in self._evaluation_rows(where)]

    def readable_evaluations(
        self, where: EvaluationFilter | None = None
    ) -> tuple[list[EvaluationRecord], list[UnreadableEvaluation]]:
        """Stored evaluations matching ``where``, oldest first, without the rows that do not
        read, which come second: one bad row must not hide the others."""
        records: list[EvaluationRecord] = []
        unreadable: list[UnreadableEvaluation] = []
        for row in self._evaluation_rows(where):
            try:
                records.append(self._evaluation_record(row))
            except UnreadableEvaluation as e:
                unreadable.append(e)
        return records, unreadable

    def get_evaluation(self, ref: int | str) -> EvaluationRecord:
        """The evaluation with this id (int) or run id prefix (str, at least 4 characters).

        A run id is hex, so its prefix may be all digits ("40131957"): such a string is the id
        when an evaluation has it, else the prefix."""
        import sqlalchemy as sa

        c = self._evaluations.c
        if isinstance(ref, str) and ref.isdigit():
            try:
                return self.get_evaluation(int(ref))
            except NotFound:
                if len(ref) < 4:
                    raise
        if isinstance(ref, int):
            query = sa.select(self._evaluations).where(c.id == ref)
        elif len(ref) >= 4:
            query = sa.select(self._evaluations).where(c.run_id.startswith(ref, autoescape=True))
        else:
            raise ValidationError(
                f"evaluation {ref!r}: give its id (a number) or at least 4 characters of its run id"
            )
        rows = []
        if self.version >= 3:
            with _translated(self._display), self._engine.connect() as conn:
                rows = list(conn.execute(query.limit(2)))
        if not rows:
            raise NotFound(
                f"no evaluation {ref!r} in {self._display}; list them with trims evaluate ls"
            )
        if len(rows) > 1:
            raise ValidationError(
                f"run id prefix {ref!r} matches several evaluations in {self._display}; "
                "give more characters"
            )
        return self._evaluation_record(rows[0])

    def traces(self) -> list[TraceRecord]:
        """Every stored trace, oldest first (what an import copies)."""
        import sqlalchemy as sa

        if self.version < 2:
            return []
        t = self._traces.c
        query = sa.select(
            t.trace_id, t.model, t.framework, t.level, t.created_at, t.summary, t.spans
        ).order_by(t.created_at, t.trace_id)
        with _translated(self._display), self._engine.connect() as conn:
            return [
                TraceRecord(
                    trace_id=r[0],
                    model=r[1],
                    framework=r[2],
                    level=r[3],
                    created_at=r[4],
                    summary=json.loads(r[5]),
                    spans=json.loads(r[6]),
                )
                for r in conn.execute(query)
            ]

    def count(self) -> int:
        import sqlalchemy as sa

        with self._engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(self._results)).one()[0])

    def close(self) -> None:
        self._engine.dispose()
