"""The catalog: which model versions the store knows, persisted in SQLite (WAL) in the store dir.

A row maps ``name`` + ``version`` to the content digest of its canonical layout, with what a
person needs to know about it (framework, source format, size, when it was added), the optional
access list (uids / gids allowed to acquire it), the tiers it is pinned in and its state in the
commit protocol (Note [commit protocol] in :mod:`trims.daemon.store`): ``pending`` while an add
is placing its blob, ``committed`` once the model is fully present. Only committed rows are
models; every read here sees only them. The blobs live in the disk tier, keyed by digest;
resident copies (memfds, device memory) are not persisted: they die with the daemon and are
loaded again on demand. Beside the models, ``chunk_digests`` keeps the chunk digests of each
layout verified whole (Note [chunk digests] in :mod:`trims.daemon.tiers.chunks`).

Every write is one transaction, so a daemon killed mid-write leaves the previous state. The
schema is versioned with ``PRAGMA user_version`` and migrated forward on open (``_MIGRATIONS``).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from trims.daemon.private import private_file
from trims.errors import AlreadyExists, NotFound, TrimsError, ValidationError
from trims.layout import validate_digest, validate_model_name, validate_version

log = logging.getLogger(__name__)

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

#: Forward migrations; ``_MIGRATIONS[i]`` takes a catalog from user_version i to i + 1. A store
#: created before the commit protocol (user_version 0) holds only fully added models, so its
#: rows become ``committed``.
_MIGRATIONS: tuple[str, ...] = (
    "ALTER TABLE models ADD COLUMN state TEXT NOT NULL DEFAULT 'committed'",
    # Note [chunk digests] in trims.daemon.tiers.chunks: facts about a layout's content, kept
    # while a model row names the layout.
    "CREATE TABLE chunk_digests (digest TEXT PRIMARY KEY, chunk_bytes INTEGER NOT NULL, "
    "digests BLOB NOT NULL)",
)
SCHEMA_VERSION = len(_MIGRATIONS)

#: Chunk digests of layouts no model row names any more.
_DROP_UNNAMED_CHUNKS = "DELETE FROM chunk_digests WHERE digest NOT IN (SELECT digest FROM models)"

PENDING = "pending"
COMMITTED = "committed"

#: (uid_t)-1 means "no id" to the kernel (chown, setreuid), so it is never a valid entry.
_ID_LIMIT = 2**32 - 1


def validate_id(field_name: str, value: object) -> int:
    """A uid or gid as the kernel stores it (32 bits, not -1); ValidationError naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _ID_LIMIT:
        raise ValidationError(
            f"{field_name} = {value!r} is not a valid id: use an integer from 0 to "
            f"{_ID_LIMIT - 1} (a user or group name is resolved by the CLI)"
        )
    return value


def not_found(name: str, version: str | None) -> NotFound:
    """The one answer for a model that is absent or that the caller may not see."""
    what = name if version is None else f"{name}:{version}"
    return NotFound(f"model {what} is not in the store; add it with 'trims models add'")


@dataclass(frozen=True)
class AccessList:
    """Who may acquire a model; both empty means everyone who can reach the socket."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for key, ids in (("uids", self.uids), ("gids", self.gids)):
            for value in sorted(ids):
                validate_id(f"access.{key}", value)

    @classmethod
    def of(cls, uids: Iterable[int] = (), gids: Iterable[int] = ()) -> AccessList:
        return cls(frozenset(uids), frozenset(gids))

    @property
    def open(self) -> bool:
        return not self.uids and not self.gids

    def allows(self, uid: int, gids: Collection[int]) -> bool:
        """Whether a peer with ``uid`` and groups ``gids`` (primary and supplementary) may see
        and acquire the model."""
        return self.open or uid in self.uids or not self.gids.isdisjoint(gids)

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
        # Names, sources and access lists are the daemon's alone (Note [private store] in
        # trims.daemon.private); SQLite gives the -wal and -shm files the database's mode.
        private_file(path, 0o600)
        for journal in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            if journal.exists():
                private_file(journal, 0o600)
        try:
            self._db = sqlite3.connect(path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            self._migrate()
        except TrimsError:
            self._db.close()
            raise
        except sqlite3.Error as e:
            raise TrimsError(
                f"cannot open the catalog {path}: {e}; check the store directory is writable"
            ) from e

    def _migrate(self) -> None:
        with self._transaction() as db:
            version = int(db.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise TrimsError(
                    f"the catalog {self.path} has schema version {version}, newer than this "
                    f"trims understands ({SCHEMA_VERSION}); run the newer trims daemon"
                )
            for step in _MIGRATIONS[version:]:
                db.execute(step)
            if version != SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                log.info(
                    "catalog %s migrated from schema %d to %d", self.path, version, SCHEMA_VERSION
                )

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
            access=AccessList.of(acc.get("uids", ()), acc.get("gids", ())),
            pins=frozenset(json.loads(str(pins))),
        )

    _COLUMNS = (
        "name, version, digest, framework, format, source, total_bytes, added_at, access, pins"
    )

    def _insert(self, db: sqlite3.Connection, record: ModelRecord, state: str) -> None:
        db.execute(
            f"INSERT OR REPLACE INTO models ({self._COLUMNS}, state) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                state,
            ),
        )

    def add(self, record: ModelRecord, *, replace: bool = False) -> None:
        """Insert a committed row at once; AlreadyExists if name+version is taken (unless
        ``replace``). For a row whose blob is already in the disk tier."""
        validate_model_name(record.name)
        validate_version(record.version)
        validate_digest(record.digest)
        with self._transaction() as db:
            if not replace:
                self.check_free(record.name, record.version)
            self._insert(db, record, COMMITTED)

    def begin_add(self, name: str, version: str, source: str, access: AccessList) -> None:
        """Write the intent row of an add (state ``pending``, no digest yet); it reserves
        name+version. AlreadyExists when taken, by a model or by an add in progress."""
        validate_model_name(name)
        validate_version(version)
        with self._transaction() as db:
            self.check_free(name, version)
            pending = ModelRecord(name, version, "", "", "", source, 0, time.time(), access)
            self._insert(db, pending, PENDING)

    def commit_add(self, record: ModelRecord) -> None:
        """Turn the intent row of ``record`` into the committed model, in one transaction."""
        validate_digest(record.digest)
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE models SET digest = ?, framework = ?, format = ?, total_bytes = ?, "
                "state = ? WHERE name = ? AND version = ? AND state = ?",
                (
                    record.digest,
                    record.framework,
                    record.format,
                    record.total_bytes,
                    COMMITTED,
                    record.name,
                    record.version,
                    PENDING,
                ),
            )
            if cursor.rowcount != 1:
                raise TrimsError(
                    f"the add of model {record.key} lost its intent row in the catalog; "
                    "add the model again"
                )

    def abort_add(self, name: str, version: str) -> None:
        """Drop the intent row of an add that failed (a no-op when there is none)."""
        with self._transaction() as db:
            db.execute(
                "DELETE FROM models WHERE name = ? AND version = ? AND state = ?",
                (name, version, PENDING),
            )

    def rollback_pending(self) -> list[str]:
        """Start-up recovery: delete every intent row (adds a crash interrupted); their keys."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT name, version FROM models WHERE state != ? ORDER BY name, version",
                (COMMITTED,),
            ).fetchall()
            db.execute("DELETE FROM models WHERE state != ?", (COMMITTED,))
            db.execute(_DROP_UNNAMED_CHUNKS)
        return [f"{name}:{version}" for name, version in rows]

    def pending_names(self) -> set[str]:
        """Names with an add in progress."""
        rows = self._db.execute(
            "SELECT DISTINCT name FROM models WHERE state = ?", (PENDING,)
        ).fetchall()
        return {str(r[0]) for r in rows}

    def check_free(self, name: str, version: str) -> None:
        """AlreadyExists when name+version is taken (by a model or by an add in progress)."""
        row = self._db.execute(
            "SELECT digest, state FROM models WHERE name = ? AND version = ?", (name, version)
        ).fetchone()
        if row is None:
            return
        if row[1] != COMMITTED:
            raise AlreadyExists(
                f"model {name}:{version} is being added right now; wait for that add to end "
                "or add under another version"
            )
        raise AlreadyExists(
            f"model {name}:{version} is already in the store (digest {row[0][:12]}); "
            "add it under another version or remove it first"
        )

    def get(self, name: str, version: str | None = None) -> ModelRecord:
        """The named version, or the most recently added one; NotFound otherwise."""
        if version is None:
            row = self._db.execute(
                f"SELECT {self._COLUMNS} FROM models WHERE name = ? AND state = ? "
                "ORDER BY added_at DESC, version DESC LIMIT 1",
                (name, COMMITTED),
            ).fetchone()
        else:
            row = self._db.execute(
                f"SELECT {self._COLUMNS} FROM models WHERE name = ? AND version = ? AND state = ?",
                (name, version, COMMITTED),
            ).fetchone()
        if row is None:
            raise not_found(name, version)
        return self._record(row)

    def by_digest(self, digest: str) -> list[ModelRecord]:
        rows = self._db.execute(
            f"SELECT {self._COLUMNS} FROM models WHERE digest = ? AND state = ? "
            "ORDER BY name, version",
            (digest, COMMITTED),
        ).fetchall()
        return [self._record(r) for r in rows]

    def all(self) -> list[ModelRecord]:
        rows = self._db.execute(
            f"SELECT {self._COLUMNS} FROM models WHERE state = ? ORDER BY name, version",
            (COMMITTED,),
        ).fetchall()
        return [self._record(r) for r in rows]

    def set_pins(self, name: str, version: str, pins: frozenset[str]) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE models SET pins = ? WHERE name = ? AND version = ? AND state = ?",
                (json.dumps(sorted(pins)), name, version, COMMITTED),
            )

    def remove(self, name: str, version: str) -> None:
        """Delete the committed row in one transaction (its blob goes after, Note [commit
        protocol]), with the chunk digests of its layout when no other row names it."""
        with self._transaction() as db:
            db.execute(
                "DELETE FROM models WHERE name = ? AND version = ? AND state = ?",
                (name, version, COMMITTED),
            )
            db.execute(_DROP_UNNAMED_CHUNKS)

    def chunk_digests(
        self, digest: str, chunk_bytes: int, count: int, width: int
    ) -> tuple[bytes, ...] | None:
        """The saved chunk digests of layout ``digest``: ``count`` digests of ``width`` bytes,
        one per ``chunk_bytes``; None when none were saved, or with another chunk size or count
        (a row that does not fit is deleted)."""
        row = self._db.execute(
            "SELECT chunk_bytes, digests FROM chunk_digests WHERE digest = ?", (digest,)
        ).fetchone()
        if row is None:
            return None
        saved_bytes, blob = int(row[0]), bytes(row[1])
        if saved_bytes != chunk_bytes or len(blob) != count * width:
            log.info("catalog: chunk digests of %s do not fit this layout; dropped", digest[:12])
            with self._transaction() as db:
                db.execute("DELETE FROM chunk_digests WHERE digest = ?", (digest,))
            return None
        return tuple(blob[i : i + width] for i in range(0, len(blob), width))

    def save_chunk_digests(self, digest: str, chunk_bytes: int, digests: Iterable[bytes]) -> None:
        """Save the chunk digests of a layout a model row names (else nothing is saved)."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO chunk_digests (digest, chunk_bytes, digests) "
                "SELECT ?, ?, ? WHERE EXISTS (SELECT 1 FROM models WHERE digest = ?)",
                (digest, chunk_bytes, b"".join(digests), digest),
            )

    def pinned_in(self, digest: str, tier: str) -> bool:
        """Whether any model version with this digest is pinned in ``tier``."""
        return any(tier in r.pins for r in self.by_digest(digest))
