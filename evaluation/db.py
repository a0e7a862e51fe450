"""Results database: measurements, one row per (system, framework, version, kind, signature,
batch, variant), and traces (``trims trace``), one row per trace id.

SQLAlchemy Core, SQLite by default (any SQLAlchemy URL works, e.g. ``postgresql://...``). The
schema carries a version in ``meta``; opening a database written by a newer schema version is
refused with a message saying what to do, never silently mixed.

Note [schema migrations]
~~~~~~~~~~~~~~~~~~~~~~~~
Each version adds to the one before and never changes what is there: version 2 added the
``traces`` table. ``create_all`` creates missing tables (it never alters existing ones), so an
older database opened here gains the new tables and then has its ``meta`` version raised, in
one transaction per step in :data:`MIGRATIONS`. A database from a newer trims is refused: it
may hold what this code would misread.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trims.errors import ValidationError
from trims.evaluation.measure import Measurement

if TYPE_CHECKING:
    import sqlalchemy as sa

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
#: from-version -> what the step does (logged); the tables themselves come from create_all
MIGRATIONS: dict[int, str] = {1: "added the traces table"}


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
class ResultKey:
    """What a measurement is of, and where."""

    system: str
    framework: str
    framework_version: str
    kind: str
    signature: str
    batch: int
    variant: str


def system_id() -> str:
    """CPU model and core count, e.g. ``Intel(R) Xeon(R) ... x2``."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} x{os.cpu_count() or 1}"


class ResultsDB:
    """Store and look up measurements; ``url`` is an SQLAlchemy URL or a SQLite file path."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        if "://" not in url:
            url = f"sqlite:///{url}"
        self.url = url
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
        self._meta_table.create(self._engine, checkfirst=True)
        self._check_version(meta)

    def _check_version(self, meta: sa.MetaData) -> None:
        import sqlalchemy as sa

        with self._engine.begin() as conn:
            row = conn.execute(
                sa.select(self._meta_table.c.value).where(self._meta_table.c.key == "schema")
            ).first()
            if row is None:
                meta.create_all(conn)
                conn.execute(
                    self._meta_table.insert().values(key="schema", value=str(SCHEMA_VERSION))
                )
                return
            version = int(row[0])
            if version > SCHEMA_VERSION or version not in (*MIGRATIONS, SCHEMA_VERSION):
                raise ValidationError(
                    f"results database {self.url} has schema version {row[0]}, this trims "
                    f"writes version {SCHEMA_VERSION}; use a new --db file or a newer trims"
                )
            # Note [schema migrations]: create_all adds the tables newer versions brought
            meta.create_all(conn)
            while version < SCHEMA_VERSION:
                conn.execute(
                    self._meta_table.update()
                    .where(self._meta_table.c.key == "schema")
                    .values(value=str(version + 1))
                )
                log.info("results database %s migrated from schema %d: %s",
                         self.url, version, MIGRATIONS[version])  # fmt: skip
                version += 1

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
        if row is None:
            return None
        return Measurement(
            trimmed_mean_ms=row[0],
            median_ms=row[1],
            spread_ms=row[2],
            min_ms=row[3],
            reps=row[4],
            elapsed_s=row[5],
        )

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

    def put_trace(self, record: TraceRecord) -> None:
        """Store (or replace) a trace by its id."""
        values: dict[str, Any] = {
            "trace_id": record.trace_id,
            "model": record.model[:256],
            "framework": record.framework,
            "level": record.level,
            "created_at": record.created_at,
            "summary": json.dumps(record.summary),
            "spans": json.dumps(record.spans),
        }
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

    def count(self) -> int:
        import sqlalchemy as sa

        with self._engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(self._results)).one()[0])

    def close(self) -> None:
        self._engine.dispose()
