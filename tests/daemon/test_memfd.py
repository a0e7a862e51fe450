"""Sealed memfd copies (daemon/tiers/memfd.py): verified whole on the first load, chunk by
chunk on every core afterwards (Note [chunk digests])."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.daemon.layouts import committed_blob
from trims.daemon.tiers import memfd
from trims.daemon.tiers.cpu import CpuTier
from trims.errors import CorruptModel
from trims.layout import Manifest

#: 40 KiB of weights: three chunks of 12 KiB and a short last one (layouts are whole pages)
W = np.arange(10240, dtype=np.float32)
CHUNK = 12288


@pytest.fixture
def blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Manifest]:
    monkeypatch.setattr(memfd, "CHUNK", CHUNK)
    return committed_blob(tmp_path / "disk", W)


@pytest.fixture
def tier() -> Iterator[CpuTier]:
    t = CpuTier("memfd")
    yield t
    t.close()


def _content(tier: CpuTier, digest: str) -> bytes:
    export = tier.export(digest)
    assert export.fd is not None
    assert fcntl.fcntl(export.fd, fcntl.F_GET_SEALS) & memfd.SEALS == memfd.SEALS
    return os.pread(export.fd, export.handle["size"], 0)


def _write(path: Path, offset: int, data: bytes) -> None:
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
    path.chmod(0o444)


def test_a_re_load_is_checked_chunk_by_chunk_against_the_first_verified_copy(
    blob: tuple[Path, Manifest], tier: CpuTier
) -> None:
    path, manifest = blob
    size = manifest.total_bytes
    assert size % CHUNK and size // CHUNK >= 3  # several chunks and a short last one
    assert tier.load(manifest.digest, path, size, "m").hashed == size
    expected = path.read_bytes()
    assert _content(tier, manifest.digest) == expected
    known = tier._chunks.get(manifest.digest)
    assert known is not None and len(known) == size // CHUNK + 1
    tier.free(manifest.digest)
    assert tier.load(manifest.digest, path, size, "m").hashed == size  # chunks, on the pool
    assert _content(tier, manifest.digest) == expected
    tier.free(manifest.digest)
    _write(path, size - 3, b"\x7f\x7f\x7f")  # the short last chunk changes
    with pytest.raises(CorruptModel, match=f"bytes {size // CHUNK * CHUNK} to {size} differ"):
        tier.load(manifest.digest, path, size, "m")
    with pytest.raises(KeyError):
        tier.export(manifest.digest)


def test_a_first_load_that_fails_its_digest_keeps_no_chunk_digests(
    blob: tuple[Path, Manifest], tier: CpuTier
) -> None:
    path, manifest = blob
    original = path.read_bytes()
    _write(path, 8192, b"\x00" * 4)
    with pytest.raises(CorruptModel, match="fails its digest check"):
        tier.load(manifest.digest, path, manifest.total_bytes, "m")
    assert tier._chunks.get(manifest.digest) is None
    _write(path, 0, original)  # repaired: verified whole, as a first load
    assert tier.load(manifest.digest, path, manifest.total_bytes, "m").hashed > 0
    assert tier._chunks.get(manifest.digest) is not None


def test_a_truncated_file_fails_with_or_without_chunk_digests(
    blob: tuple[Path, Manifest], tier: CpuTier
) -> None:
    path, manifest = blob
    size = manifest.total_bytes
    tier.load(manifest.digest, path, size, "m")
    tier.free(manifest.digest)
    path.chmod(0o644)
    os.truncate(path, size - 5000)
    with pytest.raises(CorruptModel, match="truncated"):
        tier.load(manifest.digest, path, size, "m")
