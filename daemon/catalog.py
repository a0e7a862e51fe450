"""The catalog: which model versions the store knows, persisted in SQLite (WAL) in the store dir.

A row maps ``name`` + ``version`` to the content digest of its canonical layout, with what a
person needs to know about it (framework, source format, size, when it was added), the optional
access list (uids / gids allowed to acquire it) and the tiers it is pinned in. The blobs live in
the disk tier, keyed by digest; resident copies (memfds, device memory) are not persisted: they
die with the daemon and are loaded again on demand.

Every write is one transaction, so a daemon killed mid-write leaves the previous state.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trims.errors import AlreadyExists, NotFound, TrimsError
from trims.layout import validate_digest, validate_model_name, validate_version

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    digest TEXT NOT NULL,
    framework TEXT NOT NULL,
    format TEXT NOT NULL,
    source TEXT NOT NULL,
    total_bytes INTEGER NOT NULL,
    added_at REAL NOT NULL,
    access TEXT NOT NULL DEFAULT '{}',
    pins TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (name, version)
);
CREATE INDEX IF NOT EXISTS models_digest ON models (digest);
"""


@dataclass(frozen=True)
class AccessList:
    """Who may acquire a model; both empty means everyone who can reach the socket."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @property
    def open(self) -> bool:
        return not self.uids and not self.gids

    def allows(self, uid: int, gid: int) -> bool:
        return self.open or uid in self.uids or gid in self.gids

    def to_dict(self) -> dict[str, list[int]]:
        return {"uids": sorted(self.uids), "gids": sorted(self.gids)}


@dataclass(frozen=True)
class ModelRecord:
    """One catalog row."""

    name: str
    version: str
    digest: str
    framework: str
    format: str
    source: str
    total_bytes: int
    added_at: float
    access: AccessList = field(default_factory=AccessList)
    pins: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return f"{self.name}:{self.version}"


class Catalog:
    """SQLite-backed catalog. Used from the daemon's event loop thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as e:
            raise TrimsError(
                f"cannot open the catalog {path}: {e}; check the store directory is writable"
            ) from e

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @staticmethod
    def _record(row: tuple[object, ...]) -> ModelRecord:
        name, version, digest, framework, fmt, source, total, added, access, pins = row
        acc = json.loads(str(access))
        return ModelRecord(
            name=str(name),
            version=str(version),
            digest=str(digest),
            framework=str(framework),
            format=str(fmt),
            source=str(source),
            total_bytes=int(total),  # type: ignore[call-overload]
            added_at=float(added),  # type: ignore[arg-type]
            access=AccessList(frozenset(acc.get("uids", ())), frozenset(acc.get("gids", ()))),
            pins=frozenset(json.loads(str(pins))),
        )

    _COLUMNS = (
        "name, version, digest, framework, format, source, total_bytes, added_at, access, pins"
    )

    def add(self, record: ModelRecord, *, replace: bool = False) -> None:
        """Insert a row; AlreadyExists if name+version is taken (unless ``replace``)."""
        validate_model_name(record.name)
        validate_version(record.version)
        validate_digest(record.digest)
        with self._transaction() as db:
            if not replace:
                self.check_free(record.name, record.version)
            db.execute(
                f"INSERT OR REPLACE INTO models ({self._COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.name,
                    record.version,
                    record.digest,
                    record.framework,
                    record.format,
                    record.source,
                    record.total_bytes,
                    record.added_at or time.time(),
                    json.dumps(record.access.to_dict()),
                    json.dumps(sorted(record.pins)),
                ),
            )

    def check_free(self, name: str, version: str) -> None:
        """AlreadyExists when name+version is taken."""
        row = self._db.execute(
            "SELECT digest FROM models WHERE name = ? AND version = ?", (name, version)
        ).fetchone()
        if row is not None:
            raise AlreadyExists(
                f"model {name}:{version} is already in the store (digest {row[0][:12]}); "
                "add it under another version or remove it first"
            )

    def get(self, name: str, version: str | None = None) -> ModelRecord:
        """The named version, or the most recently added one; NotFound otherwise."""
        if version is None:
            row = self._db.execute(
                f"SELECT {self._COLUMNS} FROM models WHERE name = ? "
                "ORDER BY added_at DESC, version DESC LIMIT 1",
                (name,),
            ).fetchone()
        else:
            row = self._db.execute(
                f"SELECT {self._COLUMNS} FROM models WHERE name = ? AND version = ?",
                (name, version),
            ).fetchone()
        if row is None:
            what = name if version is None else f"{name}:{version}"
            raise NotFound(f"model {what} is not in the store; add it with 'trims models add'")
        return self._record(row)

    def by_digest(self, digest: str) -> list[ModelRecord]:
        rows = self._db.execute(
            f"SELECT {self._COLUMNS} FROM models WHERE digest = ? ORDER BY name, version",
            (digest,),
        ).fetchall()
        return [self._record(r) for r in rows]

    def all(self) -> list[ModelRecord]:
        rows = self._db.execute(
            f"SELECT {self._COLUMNS} FROM models ORDER BY name, version"
        ).fetchall()
        return [self._record(r) for r in rows]

    def set_pins(self, name: str, version: str, pins: frozenset[str]) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE models SET pins = ? WHERE name = ? AND version = ?",
                (json.dumps(sorted(pins)), name, version),
            )

    def remove(self, name: str, version: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM models WHERE name = ? AND version = ?", (name, version))

    def pinned_in(self, digest: str, tier: str) -> bool:
        """Whether any model version with this digest is pinned in ``tier``."""
        return any(tier in r.pins for r in self.by_digest(digest))
