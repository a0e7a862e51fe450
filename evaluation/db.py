"""Results database: one row per (system, framework, version, kind, signature, batch, variant).

SQLAlchemy Core, SQLite by default (any SQLAlchemy URL works, e.g. ``postgresql://...``). The
schema carries a version in ``meta``; opening a database written by another schema version is
refused with a message saying what to do, never silently mixed.
"""

from __future__ import annotations

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

SCHEMA_VERSION = 1


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
        meta.create_all(self._engine)
        self._check_version()

    def _check_version(self) -> None:
        import sqlalchemy as sa

        with self._engine.begin() as conn:
            row = conn.execute(
                sa.select(self._meta_table.c.value).where(self._meta_table.c.key == "schema")
            ).first()
            if row is None:
                conn.execute(
                    self._meta_table.insert().values(key="schema", value=str(SCHEMA_VERSION))
                )
            elif int(row[0]) != SCHEMA_VERSION:
                raise ValidationError(
                    f"results database {self.url} has schema version {row[0]}, this trims "
                    f"writes version {SCHEMA_VERSION}; use a new --db file or migrate it"
                )

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

    def count(self) -> int:
        import sqlalchemy as sa

        with self._engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(self._results)).one()[0])

    def close(self) -> None:
        self._engine.dispose()
