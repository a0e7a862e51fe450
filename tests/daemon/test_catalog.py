"""The SQLite catalog in-process: rows, latest version, pins, access lists, intent rows,
schema migration, persistence."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from trims.daemon.catalog import SCHEMA, SCHEMA_VERSION, AccessList, Catalog, ModelRecord
from trims.errors import AlreadyExists, NotFound, TrimsError, ValidationError


def _record(name: str, version: str, digest: str = "a" * 64, added: float = 1.0) -> ModelRecord:
    return ModelRecord(name, version, digest, "torch", "torch", "/src", 4096, added)


def test_rows_survive_reopening_and_latest_version_wins(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "c.sqlite")
    catalog.add(_record("m", "1", added=1.0))
    catalog.add(_record("m", "2", "b" * 64, added=2.0))
    catalog.set_pins("m", "1", frozenset({"cpu"}))
    catalog.close()
    catalog = Catalog(tmp_path / "c.sqlite")
    try:
        assert catalog.get("m").version == "2"
        assert catalog.get("m", "1").pins == frozenset({"cpu"})
        assert catalog.pinned_in("a" * 64, "cpu") and not catalog.pinned_in("b" * 64, "cpu")
        with pytest.raises(AlreadyExists):
            catalog.add(_record("m", "1"))
        with pytest.raises(NotFound):
            catalog.get("m", "3")
        with pytest.raises(ValidationError):
            catalog.add(_record("../etc", "1"))
        catalog.remove("m", "2")
        assert [r.key for r in catalog.all()] == ["m:1"]
    finally:
        catalog.close()


def test_access_list_counts_uid_and_every_group() -> None:
    assert AccessList().allows(1, [1])
    restricted = AccessList.of([10], [20, 30])
    assert restricted.allows(10, [0]) and restricted.allows(0, [20])
    assert restricted.allows(0, [5, 6, 30])
    assert not restricted.allows(11, [21, 0])
    assert not restricted.allows(11, [])


@pytest.mark.parametrize("bad", [-1, 2**32 - 1, 2**70, True, "0"])
def test_access_list_ids_are_32_bit(bad: object) -> None:
    with pytest.raises(ValidationError, match=r"access\.gids = .* not a valid id"):
        AccessList.of([], [bad])  # type: ignore[list-item]
    assert AccessList.of([2**32 - 2]).uids == {4294967294}


def test_an_intent_row_reserves_the_name_and_is_no_model_until_committed(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "c.sqlite")
    try:
        catalog.begin_add("m", "1", "/src", AccessList.of([7]))
        with pytest.raises(AlreadyExists, match="being added"):
            catalog.begin_add("m", "1", "/src", AccessList())
        assert catalog.all() == [] and catalog.pending_names() == {"m"}
        with pytest.raises(NotFound):
            catalog.get("m")
        catalog.commit_add(_record("m", "1"))
        record = catalog.get("m")
        assert record.digest == "a" * 64 and record.source == "/src"
        assert record.access == AccessList.of([7])
        catalog.begin_add("m", "2", "/src", AccessList())
        catalog.begin_add("n", "1", "/src", AccessList())
        catalog.abort_add("n", "1")
        assert catalog.rollback_pending() == ["m:2"]
        assert [r.key for r in catalog.all()] == ["m:1"] and catalog.pending_names() == set()
    finally:
        catalog.close()


def test_a_catalog_of_the_old_schema_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    db.execute(
        "INSERT INTO models VALUES ('m', '1', ?, 'numpy', 'numpy', '', 4096, 1.0, "
        "'{\"uids\": [5]}', '[]')",
        ("a" * 64,),
    )
    db.commit()
    db.close()
    for _ in range(2):
        catalog = Catalog(path)
        try:
            assert catalog.get("m").access == AccessList.of([5])
            assert catalog.rollback_pending() == []
        finally:
            catalog.close()
    db = sqlite3.connect(path)
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 1
        db.execute("PRAGMA user_version = 99")
        db.commit()
    finally:
        db.close()
    with pytest.raises(TrimsError, match="newer"):
        Catalog(path)


def test_chunk_digests_are_kept_while_a_row_names_their_layout(tmp_path: Path) -> None:
    catalog = Catalog(tmp_path / "c.sqlite")
    try:
        two = (b"\x01" * 32, b"\x02" * 32)
        catalog.save_chunk_digests("c" * 64, 4096, two)  # no row names it: nothing is saved
        assert catalog.chunk_digests("c" * 64, 4096, 2, 32) is None
        catalog.add(_record("m", "1"))
        catalog.add(_record("n", "1"))  # the same layout
        catalog.save_chunk_digests("a" * 64, 4096, two)
        assert catalog.chunk_digests("a" * 64, 4096, 2, 32) == two
        catalog.remove("m", "1")
        assert catalog.chunk_digests("a" * 64, 4096, 2, 32) == two  # n still names it
        catalog.close()
        catalog = Catalog(tmp_path / "c.sqlite")
        assert catalog.chunk_digests("a" * 64, 4096, 2, 32) == two
        catalog.remove("n", "1")
        catalog.add(_record("n", "1"))
        assert catalog.chunk_digests("a" * 64, 4096, 2, 32) is None
    finally:
        catalog.close()


@pytest.mark.parametrize(("chunk_bytes", "count"), [(8192, 2), (4096, 3)])
def test_chunk_digests_of_another_chunk_size_or_count_are_dropped(
    tmp_path: Path, chunk_bytes: int, count: int
) -> None:
    catalog = Catalog(tmp_path / "c.sqlite")
    try:
        catalog.add(_record("m", "1"))
        catalog.save_chunk_digests("a" * 64, 4096, (b"\x01" * 32, b"\x02" * 32))
        assert catalog.chunk_digests("a" * 64, chunk_bytes, count, 32) is None
        assert catalog.chunk_digests("a" * 64, 4096, 2, 32) is None  # the row is gone
    finally:
        catalog.close()
