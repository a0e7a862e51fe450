"""The SQLite catalog in-process: rows, latest version, pins, access lists, persistence."""

from __future__ import annotations

from pathlib import Path

import pytest

from trims.daemon.catalog import AccessList, Catalog, ModelRecord
from trims.errors import AlreadyExists, NotFound, ValidationError


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


def test_access_list() -> None:
    assert AccessList().allows(1, 1)
    restricted = AccessList(frozenset({10}), frozenset({20}))
    assert restricted.allows(10, 0) and restricted.allows(0, 20)
    assert not restricted.allows(11, 21)
