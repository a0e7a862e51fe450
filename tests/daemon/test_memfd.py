"""Sealed memfd copies (daemon/tiers/memfd.py): verified whole on the first load, chunk by
chunk on every core afterwards, also after a daemon restart (Note [chunk digests])."""

from __future__ import annotations

import fcntl
import hashlib
import os
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.layouts import committed_blob
from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.daemon.tiers import chunks, memfd
from trims.daemon.tiers.cpu import CpuTier
from trims.errors import CorruptModel
from trims.layout import Manifest

#: 40 KiB of weights: three chunks of 12 KiB and a short last one (layouts are whole pages)
W = np.arange(10240, dtype=np.float32)
CHUNK = 12288


@pytest.fixture
def blob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Manifest]:
    monkeypatch.setattr(chunks, "CHUNK", CHUNK)
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
    path.chmod(0o400)


def test_a_re_load_is_checked_chunk_by_chunk_against_the_first_verified_copy(
    blob: tuple[Path, Manifest], tier: CpuTier
) -> None:
    path, manifest = blob
    size = manifest.total_bytes
    assert size % CHUNK and size // CHUNK >= 3  # several chunks and a short last one
    assert tier.load(manifest.digest, path, size, "m").hashed == size
    expected = path.read_bytes()
    assert _content(tier, manifest.digest) == expected
    known = tier.pool.get(manifest.digest)
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
    assert tier.pool.get(manifest.digest) is None
    _write(path, 0, original)  # repaired: verified whole, as a first load
    assert tier.load(manifest.digest, path, manifest.total_bytes, "m").hashed > 0
    assert tier.pool.get(manifest.digest) is not None


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


def _saved_chunks(daemon: DaemonProcess) -> dict[str, bytes]:
    db = sqlite3.connect(daemon.store_dir / "catalog.sqlite")
    try:
        return dict(db.execute("SELECT digest, digests FROM chunk_digests").fetchall())
    finally:
        db.close()


def test_chunk_digests_survive_a_restart_and_a_wrong_row_costs_a_hash_not_the_model(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    weights = np.arange(5 << 18, dtype=np.float32)  # 5 MiB: two chunks of the real size
    source = tmp_path / "m.safetensors"
    save_file({"w": weights}, str(source))
    daemon = start_daemon(cpu_backing="memfd")
    with RawClient(daemon.admin_socket) as admin:
        digest = admin.result("add", name="m", source=str(source))["model"]["digest"]
        admin.result("load", name="m", tier="cpu")  # a first memfd load computes them anyway
    blob = (daemon.store_dir / "disk" / "blobs" / digest).read_bytes()
    expected = b"".join(
        hashlib.sha256(blob[i : i + chunks.CHUNK]).digest()
        for i in range(0, len(blob), chunks.CHUNK)
    )
    assert len(expected) == 64 and _saved_chunks(daemon) == {digest: expected}
    daemon.stop()
    db = sqlite3.connect(daemon.store_dir / "catalog.sqlite")
    with db:
        db.execute("UPDATE chunk_digests SET digests = ?", (expected[:32] + b"\x00" * 32,))
    db.close()
    daemon.start()
    with RawClient(daemon.socket) as client:
        result, mapping = client.acquire_map("m")
        offset = result["manifest"]["tensors"][0]["offset"]
        assert np.array_equal(np.frombuffer(mapping, np.float32, weights.size, offset), weights)
        mapping.close()
    log = daemon.log.read_text()
    assert f"layout {digest[:12]}: bytes {chunks.CHUNK} to {len(blob)} differ" in log
    assert "recorded chunk digests were wrong; replaced" in log
    assert _saved_chunks(daemon) == {digest: expected}
