"""CPU tier copies that are the verified disk file in the page cache (Note [page-cache copies]):
read-only to clients, hashed before they are served, evicted when the file changes."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.holders import Holder
from tests.daemon.layouts import committed_blob
from tests.daemon.rawclient import RawClient
from tests.daemon.test_huge_page_mode import _sysfs
from tests.fixtures.store import DaemonProcess
from trims.daemon.tiers.cpu import CpuTier
from trims.daemon.tiers.disk import Stamp
from trims.daemon.tiers.pagecache import needs_populate
from trims.errors import CorruptModel, ValidationError
from trims.layout import Manifest

W = np.arange(4096, dtype=np.float32)
MODELS = {"tiny": {"w": W}}


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, Manifest]:
    """A committed disk-tier blob holding W, and its manifest."""
    return committed_blob(tmp_path / "disk", W)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """W as a safetensors file, for models added while the daemon runs."""
    path = tmp_path / "m.safetensors"
    save_file({"w": W}, str(path))
    return path


@pytest.fixture
def file_tier() -> Iterator[CpuTier]:
    tier = CpuTier("file")
    yield tier
    tier.close()


def test_auto_uses_the_file_only_for_a_root_daemon_without_shmem_huge_pages(tmp_path: Path) -> None:
    off = _sysfs(tmp_path / "off", "never", {"2048kB": "inherit"})
    on = _sysfs(tmp_path / "on", "advise", {"2048kB": "inherit"})
    assert CpuTier("auto", off, daemon_is_root=True).backing == "file"
    assert CpuTier("auto", on, daemon_is_root=True).backing == "memfd"
    # a non-root daemon's blobs could be made writable by its own uid's clients
    assert CpuTier("auto", off, daemon_is_root=False).backing == "memfd"
    assert CpuTier("memfd", off, daemon_is_root=True).backing == "memfd"
    assert CpuTier("file", on, daemon_is_root=False).backing == "file"
    with pytest.raises(ValueError, match="use one of"):
        CpuTier("tmpfs")


def test_the_copy_is_the_verified_file_and_clients_cannot_write_it(
    blob: tuple[Path, Manifest], file_tier: CpuTier
) -> None:
    path, manifest = blob
    file_tier.load(manifest.digest, path, manifest.total_bytes, "m")
    export = file_tier.export(manifest.digest)
    pinned = file_tier._files[manifest.digest]
    assert pinned.faults >= 1  # the daemon's own mapping faulted the file in
    assert export.handle == {
        "kind": "file",
        "size": manifest.total_bytes,
        "populate": needs_populate(manifest.total_bytes, pinned.faults),
    }
    assert export.fd is not None and os.fstat(export.fd).st_ino == path.stat().st_ino
    with pytest.raises(OSError) as written:
        os.pwrite(export.fd, b"x", 0)
    assert written.value.errno == errno.EBADF
    with pytest.raises(PermissionError):
        mmap.mmap(export.fd, manifest.total_bytes, mmap.MAP_SHARED, mmap.PROT_WRITE)
    private = mmap.mmap(export.fd, manifest.total_bytes, mmap.MAP_PRIVATE,
                        mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    try:
        private[:4] = b"\xff" * 4
        assert path.read_bytes()[:4] == W[:1].tobytes()
    finally:
        private.close()
    assert file_tier.holds_file(manifest.digest) and file_tier.current(manifest.digest)
    if os.geteuid() == 0:  # root may lock any amount; others depend on RLIMIT_MEMLOCK
        assert file_tier._files[manifest.digest].locked
    file_tier.free(manifest.digest)
    assert not file_tier.holds_file(manifest.digest)
    with pytest.raises(OSError):
        os.fstat(export.fd)


def test_clients_populate_unless_the_file_maps_in_few_faults() -> None:
    mib = 1 << 20
    assert not needs_populate(512 * mib, 777)  # large folios: 700-800 faults per 512 MiB
    assert needs_populate(512 * mib, 6256)  # small folios
    assert needs_populate(512 * mib, 131072)  # 4 KiB pages, no fault-around
    assert not needs_populate(4096, 1)


def test_a_file_that_changes_after_it_was_hashed_is_no_longer_current(
    blob: tuple[Path, Manifest], file_tier: CpuTier
) -> None:
    path, manifest = blob
    file_tier.load(manifest.digest, path, manifest.total_bytes, "m")
    os.chmod(path, 0o400)  # the same mode: ctime still moves, and userspace cannot set it back
    assert not file_tier.current(manifest.digest)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("content", "fails its digest check"),
        ("truncate", "truncated"),
        ("mode", "writable by group or others"),
        ("missing", "is missing"),
    ],
)
def test_a_damaged_file_is_never_mapped(
    blob: tuple[Path, Manifest], file_tier: CpuTier, damage: str, message: str
) -> None:
    path, manifest = blob
    path.chmod(0o664 if damage == "mode" else 0o644)
    if damage == "content":
        with open(path, "r+b") as f:
            f.write(b"\x01\x02\x03\x04")
    elif damage == "truncate":
        os.truncate(path, manifest.total_bytes - 1)
    elif damage == "missing":
        path.unlink()
    if damage != "mode" and path.exists():
        path.chmod(0o400)
    with pytest.raises(CorruptModel, match=message):
        file_tier.load(manifest.digest, path, manifest.total_bytes, "m")
    assert not file_tier.holds_file(manifest.digest)


def _blob_of(daemon: DaemonProcess, admin: RawClient, name: str) -> Path:
    digest = admin.result("info", name=name)["model"]["digest"]
    return daemon.store_dir / "disk" / "blobs" / digest


def test_a_changed_blob_is_evicted_and_hashed_again_before_the_next_hand_out(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models=MODELS, cpu_backing="file")
    with RawClient(daemon.admin_socket) as admin, Holder(daemon.socket, "tiny") as first:
        assert first.started["values"] == W.tolist()
        path = _blob_of(daemon, admin, "tiny")
        path.chmod(0o400)  # no byte changed: reloaded and served again
        with Holder(daemon.socket, "tiny") as second:
            assert second.started["values"] == W.tolist()
        stats = admin.result("stats")["tiers"]["cpu"]
        assert (stats["loads"], stats["evictions"]) == (2, 1)
        path.chmod(0o644)  # someone with the daemon's uid writes the blob
        with open(path, "r+b") as f:
            f.write(b"\x00" * 16)
        with pytest.raises(CorruptModel, match="digest check"):
            admin.call("acquire", name="tiny")
        assert not path.exists()
        assert admin.result("stats")["tiers"]["cpu"]["evictions"] == 2
        assert first.ask("read")["values"][4:] == W[4:].tolist()  # the holder keeps its map


def test_evicting_the_disk_copy_also_evicts_the_cpu_copy_that_is_that_file(
    start_daemon: Callable[..., DaemonProcess], source: Path
) -> None:
    daemon = start_daemon(cpu_backing="file")
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="m", source=str(source))
        admin.result("load", name="m", tier="cpu")
        with Holder(daemon.socket, "m"), pytest.raises(ValidationError, match="lease"):
            admin.result("evict", name="m", tier="disk")
        assert admin.result("info", name="m")["model"]["tiers"] == ["cpu", "disk"]
        assert admin.result("evict", name="m", tier="disk")["evicted"] == ["cpu", "disk"]
        assert admin.result("info", name="m")["model"]["tiers"] == []
        with Holder(daemon.socket, "m") as again:  # fetched from its source, hashed, served
            assert again.started["values"] == W.tolist()


def test_a_file_still_under_its_verified_stamp_is_mapped_without_hashing_again(
    blob: tuple[Path, Manifest], file_tier: CpuTier
) -> None:
    path, manifest = blob
    size = manifest.total_bytes
    first = file_tier.load(manifest.digest, path, size, "m")
    assert first == (Stamp.of(path.stat()), size)  # nothing vouched for it yet: hashed
    file_tier.free(manifest.digest)
    again = file_tier.load(manifest.digest, path, size, "m", verified=first.stamp)
    assert again == (first.stamp, 0)
    assert path.read_bytes() == W.tobytes() and file_tier.current(manifest.digest)
    file_tier.free(manifest.digest)
    os.chmod(path, 0o400)  # the stamp moves: hashed again
    moved = file_tier.load(manifest.digest, path, size, "m", verified=first.stamp)
    assert moved.hashed == size and moved.stamp == Stamp.of(path.stat()) != first.stamp


def test_a_sealed_copy_hashes_every_byte_whatever_the_stamp(blob: tuple[Path, Manifest]) -> None:
    """A memfd is served long after the file may change, so a stamp never stands in for the
    hash (Note [trusted re-loads]): bytes changed behind a stamp are still caught."""
    path, manifest = blob
    tier = CpuTier("memfd")
    try:
        path.chmod(0o644)
        with open(path, "r+b") as f:
            f.write(b"\x01\x02\x03\x04")
        path.chmod(0o400)
        claimed = Stamp.of(path.stat())  # as if the changed file had been verified
        with pytest.raises(CorruptModel, match="fails its digest check"):
            tier.load(manifest.digest, path, manifest.total_bytes, "m", verified=claimed)
        file_tier = CpuTier("file")
        try:  # the page-cache backing trusts the stamp: it is the file, checked per hand-out
            trusted = file_tier.load(manifest.digest, path, manifest.total_bytes, "m",
                                     verified=claimed)  # fmt: skip
            assert trusted == (claimed, 0)
        finally:
            file_tier.close()
    finally:
        tier.close()


def _hashed(admin: RawClient) -> dict[str, int]:
    tiers = admin.result("stats")["tiers"]
    return {t: tiers[t]["hashed_bytes"] for t in ("cpu", "disk")}


def test_re_loads_of_an_unchanged_blob_are_not_hashed_again(
    start_daemon: Callable[..., DaemonProcess], source: Path
) -> None:
    daemon = start_daemon(cpu_backing="file")
    with RawClient(daemon.admin_socket) as admin:
        size = admin.result("add", name="m", source=str(source))["model"]["total_bytes"]
        assert _hashed(admin) == {"cpu": 0, "disk": size}  # the commit hashed it
        for _ in range(2):  # loaded, evicted, loaded again: the commit's hash still holds
            with Holder(daemon.socket, "m") as holder:
                assert holder.started["values"] == W.tolist()
            admin.result("evict", name="m", tier="cpu")
        assert _hashed(admin) == {"cpu": 0, "disk": size}
        _blob_of(daemon, admin, "m").chmod(0o400)  # the stamp moves
        with Holder(daemon.socket, "m") as holder:
            assert holder.started["values"] == W.tolist()
        assert _hashed(admin) == {"cpu": size, "disk": size}
        assert admin.result("stats")["tiers"]["cpu"]["loads"] == 3


def test_adding_the_same_layout_again_does_not_vouch_for_the_blob_already_on_disk(
    start_daemon: Callable[..., DaemonProcess], source: Path
) -> None:
    """The second add hashes its own temp file and finds the layout on disk; the blob there
    changed since its own check, so it is hashed before it is served."""
    daemon = start_daemon(cpu_backing="file")
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="a", source=str(source))
        blob = _blob_of(daemon, admin, "a")
        blob.chmod(0o644)  # someone with the daemon's uid writes the blob
        with open(blob, "r+b") as f:
            f.write(b"\x00" * 16)
        blob.chmod(0o400)
        admin.result("add", name="b", source=str(source))
        assert _blob_of(daemon, admin, "b") == blob
        with pytest.raises(CorruptModel, match="digest check"):
            admin.call("acquire", name="b")
        assert not blob.exists()
