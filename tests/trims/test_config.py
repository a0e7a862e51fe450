"""Sizes, default paths and settings validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from trims import config
from trims.errors import ValidationError


@pytest.mark.parametrize(
    ("text", "value"),
    [("0", 0), ("512", 512), ("8GiB", 8 << 30), ("1.5 GiB", 3 << 29), ("500MB", 500_000_000),
     ("4k", 4000), ("2Ki", 2048), (123, 123)],
)  # fmt: skip
def test_parse_size(text: str | int, value: int) -> None:
    assert config.parse_size(text) == value


@pytest.mark.parametrize("text", ["-1", "lots", "5 parsecs", "1e9"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValidationError, match="invalid size"):
        config.parse_size(text)


def test_format_size() -> None:
    assert config.format_size(8 << 30) == "8.0 GiB"
    assert config.format_size(100) == "100 B"


def test_default_paths_follow_the_environment() -> None:
    assert config.default_socket({"TRIMS_SOCKET": "/x/s.sock"}) == Path("/x/s.sock")
    assert config.default_socket({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path(
        "/run/user/7/trims/store.sock"
    )
    assert config.data_dir({"TRIMS_STORE_DIR": "/d"}) == Path("/d")
    assert config.admin_socket_for(Path("/r/store.sock")) == Path("/r/store.admin.sock")
    assert config.results_db({"TRIMS_RESULTS_DB": "postgresql://h/db"}) == "postgresql://h/db"
    assert config.results_db({"XDG_DATA_HOME": "/data"}) == "/data/trims/results.sqlite"
    assert config.results_db({}).endswith("/.local/share/trims/results.sqlite")


def test_write_atomic_replaces_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from trims.config import write_atomic

    target = tmp_path / "out" / "r.json"
    write_atomic(target, "old\n")  # the folder is created
    write_atomic(target, b"new\n")
    assert target.read_text() == "new\n"

    def refuse(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, "half")
    assert target.read_text() == "new\n"
    assert [p.name for p in target.parent.iterdir()] == ["r.json"]  # no temp file left
