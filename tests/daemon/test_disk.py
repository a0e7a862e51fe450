"""The disk tier: content-addressed, atomic, verified, within a budget."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.blockdev import LoopExt4
from trims.daemon.formats.writer import LayoutWriter
from trims.daemon.tiers.chunks import CHUNK
from trims.daemon.tiers.disk import DiskTier
from trims.errors import CorruptModel, NotFound, ResourceExhausted
from trims.layout import Manifest, TensorSpec


def _layout(path: Path, seed: int, n: int = 1000) -> Manifest:
    data = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    with LayoutWriter(path, source=Path("test")) as writer:
        writer.add(TensorSpec("w", "float32", (n,)), [data.tobytes()])
        manifest: Manifest = writer.finish(name="m", version="1", framework="test", metadata={})
    return manifest


def _tmp_files(disk: DiskTier) -> list[Path]:
    return list((disk.root / "tmp").iterdir())


def test_commit_stores_a_verified_read_only_blob(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    disk.commit(temp, manifest)
    assert not temp.exists() and not _tmp_files(disk)
    assert disk.contains(manifest.digest)
    assert disk.digests() == [manifest.digest]
    assert disk.used_bytes() == manifest.total_bytes == disk.path(manifest.digest).stat().st_size
    assert disk.manifest(manifest.digest) == manifest
    assert stat.S_IMODE(disk.path(manifest.digest).stat().st_mode) == 0o400
    disk.verify(manifest.digest)


def test_commit_is_idempotent(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    for _ in range(2):
        temp = disk.new_temp()
        manifest = _layout(temp, 1)
        disk.commit(temp, manifest)
        assert not temp.exists()
    assert disk.used_bytes() == manifest.total_bytes
    assert disk.digests() == [manifest.digest]


def test_digest_mismatch_on_commit_removes_the_temp(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    with open(temp, "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(CorruptModel, match="sha256"):
        disk.commit(temp, manifest)
    assert not temp.exists()
    assert disk.digests() == [] and disk.used_bytes() == 0
    assert list((disk.root / "blobs").iterdir()) == []


def test_size_mismatch_on_commit(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    with open(temp, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptModel, match="bytes"):
        disk.commit(temp, manifest)
    assert not temp.exists()


@pytest.mark.parametrize(("damage", "message"), [("flip", "damaged"), ("cut", "100 bytes")])
def test_verify_deletes_a_damaged_blob(tmp_path: Path, damage: str, message: str) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    disk.commit(temp, manifest)
    blob = disk.path(manifest.digest)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        if damage == "flip":
            f.seek(8)
            f.write(b"\x01")
        else:
            f.truncate(100)
    with pytest.raises(CorruptModel, match=f"{message}.*deleted from the disk tier"):
        disk.verify(manifest.digest)
    assert not disk.contains(manifest.digest) and disk.used_bytes() == 0
    assert list((disk.root / "blobs").iterdir()) == []
    with pytest.raises(NotFound):
        disk.verify(manifest.digest)


def test_the_stamp_changes_when_the_blob_is_written_or_its_mode_changes(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    disk.commit(temp, manifest)
    verified = disk.verify(manifest.digest)
    assert disk.stamp(manifest.digest) == verified
    blob = disk.path(manifest.digest)
    fd = os.open(blob, os.O_RDONLY)
    try:
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    chmodded = disk.stamp(manifest.digest)
    assert chmodded is not None and chmodded != verified
    assert disk.verify(manifest.digest) == chmodded
    disk.remove(manifest.digest)
    assert disk.stamp(manifest.digest) is None


def test_budget_is_enforced(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=6000)
    first = disk.new_temp()
    disk.commit(first, _layout(first, 1))
    second = disk.new_temp()
    manifest = _layout(second, 2)
    with pytest.raises(ResourceExhausted, match="does not fit the disk tier"):
        disk.commit(second, manifest)
    assert not second.exists()
    assert not disk.contains(manifest.digest)
    assert disk.used_bytes() == 4096 and disk.free_bytes() == 6000 - 4096


def test_remove(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    disk.commit(temp, manifest)
    disk.remove(manifest.digest)
    assert not disk.contains(manifest.digest) and disk.used_bytes() == 0
    assert list((disk.root / "blobs").iterdir()) == []
    with pytest.raises(NotFound):
        disk.remove(manifest.digest)
    with pytest.raises(NotFound):
        disk.manifest(manifest.digest)


def test_restart_keeps_blobs_and_cleans_leftovers(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path / "disk", budget=1 << 20)
    temp = disk.new_temp()
    manifest = _layout(temp, 1)
    disk.commit(temp, manifest)
    disk.new_temp().write_bytes(b"half a download")
    orphan = disk.root / "blobs" / ("a" * 64)
    orphan.write_bytes(b"blob whose manifest was never written")
    (disk.root / "blobs" / ("b" * 64 + ".json")).write_text("{}")

    again = DiskTier(tmp_path / "disk", budget=1 << 20)
    assert again.cleanup_temps() == 3
    assert _tmp_files(again) == []
    assert again.digests() == [manifest.digest]
    assert sorted(p.name for p in (again.root / "blobs").iterdir()) == [
        manifest.digest,
        manifest.digest + ".json",
    ]
    again.verify(manifest.digest)
    assert again.cleanup_temps() == 0


def _committed(disk: DiskTier, n: int) -> Manifest:
    temp = disk.new_temp()
    manifest = _layout(temp, 2, n)
    disk.commit(temp, manifest)
    return manifest


#: float32 count of a blob over two chunks, the last one short
TWO_CHUNKS = (CHUNK + 5000) // 4


@pytest.mark.parametrize("damage", [None, "flip"])
def test_a_direct_verify_reads_every_chunk_and_sees_unwritten_changes(
    tmp_path: Path, damage: str | None
) -> None:
    disk = DiskTier(tmp_path / "disk", budget=64 << 20)
    manifest = _committed(disk, TWO_CHUNKS)
    assert manifest.total_bytes > CHUNK
    blob = disk.path(manifest.digest)
    if damage is None:
        assert disk.verify(manifest.digest, direct=True) == disk.stamp(manifest.digest)
        return
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:  # left dirty in the page cache: written back before the read
        f.seek(CHUNK + 10)
        f.write(b"\x01")
    with pytest.raises(CorruptModel, match=r"damaged.*deleted from the disk tier"):
        disk.verify(manifest.digest, direct=True)
    assert not disk.contains(manifest.digest)


def test_a_direct_verify_reads_the_cache_where_the_filesystem_has_no_direct_io(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tmpfs takes O_DIRECT since Linux 6.6; some FUSE and network filesystems refuse it
    disk = DiskTier(tmp_path / "disk", budget=64 << 20)
    manifest = _committed(disk, TWO_CHUNKS)
    real_open = os.open

    def no_direct_io(path: str | Path, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct_io)
    with caplog.at_level(logging.INFO, logger="trims.daemon.tiers.disk"):
        assert disk.verify(manifest.digest, direct=True) == disk.stamp(manifest.digest)
    assert "has no direct I/O" in caplog.text


def test_a_direct_verify_finds_rot_the_page_cache_hides(loop_ext4: LoopExt4) -> None:
    disk = DiskTier(loop_ext4.mount / "disk", budget=32 << 20)
    manifest = _committed(disk, TWO_CHUNKS)
    blob = disk.path(manifest.digest)
    disk.verify(manifest.digest)  # the whole blob is in the page cache now
    loop_ext4.rot(blob, CHUNK + 100)
    disk.verify(manifest.digest)  # a read through the cache still sees the good bytes
    with pytest.raises(CorruptModel, match=r"damaged.*deleted from the disk tier"):
        disk.verify(manifest.digest, direct=True)
    assert not disk.contains(manifest.digest) and not blob.exists()
