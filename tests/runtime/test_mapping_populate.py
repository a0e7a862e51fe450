"""Populating a model mapping before the first request (Note [populate before the first
request] in trims.runtime.mapping): page tables filled, copy-on-write isolation kept."""

from __future__ import annotations

import fcntl
import mmap
import os
import resource
from collections.abc import Iterator

import numpy as np
import pytest

from trims.layout import Manifest
from trims.runtime.mapping import HostMapping

SIZE = 64 << 20
PAGES = SIZE // mmap.PAGESIZE


def _manifest() -> Manifest:
    return Manifest.from_dict(
        {
            "name": "populate-test",
            "version": "1",
            "digest": "0" * 64,
            "framework": "numpy",
            "total_bytes": SIZE,
            "tensors": [
                {"name": "w", "dtype": "uint8", "shape": [SIZE], "offset": 0, "nbytes": SIZE}
            ],
        }
    )


@pytest.fixture
def sealed_memfd() -> Iterator[int]:
    """A sealed 64 MiB memfd of 7s, as the CPU tier makes them."""
    fd = os.memfd_create("trims:populate-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    with mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
        np.frombuffer(m, dtype=np.uint8)[:] = 7
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
    yield fd
    os.close(fd)


def _mapping(fd: int, populate: bool = True) -> HostMapping:
    return HostMapping.from_fd(os.dup(fd), SIZE, _manifest(), populate=populate)


def _faults_of_full_read(mapping: HostMapping) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert int(mapping.numpy()["w"].max()) == 7
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _anonymous_kib(address: int) -> int:
    """Anonymous (copied-on-write) KiB of the mapping that starts at ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == "Anonymous:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_populated_mapping_is_read_without_a_fault_per_page(sealed_memfd: int) -> None:
    plain = _mapping(sealed_memfd, populate=False)
    populated = _mapping(sealed_memfd)
    try:
        assert populated.wait_populated(60)
        assert populated.populated in ("populate_read", "touched")
        assert plain.populated is None
        # Unpopulated: at least one fault per 64 KiB (fault-around); populated: next to none.
        assert _faults_of_full_read(plain) >= PAGES // 16
        assert _faults_of_full_read(populated) < PAGES // 64
        # Populating reads: it maps the shared pages and copies none of them.
        assert _anonymous_kib(populated.address()) == 0
    finally:
        plain.close()
        populated.close()


def test_a_write_stays_in_the_writers_populated_view(sealed_memfd: int) -> None:
    first, second = _mapping(sealed_memfd), _mapping(sealed_memfd)
    try:
        assert first.wait_populated(60) and second.wait_populated(60)
        first.numpy()["w"][:4096] = 1
        assert int(first.numpy()["w"][0]) == 1
        assert int(second.numpy()["w"][:4096].max()) == 7
        assert _anonymous_kib(first.address()) >= 4
        assert _anonymous_kib(second.address()) == 0
        # Another process's fresh mapping sees the sealed content too.
        pid = os.fork()
        if pid == 0:
            third = _mapping(sealed_memfd)
            third.wait_populated(60)
            os._exit(0 if int(third.numpy()["w"][:4096].min()) == 7 else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    finally:
        first.close()
        second.close()


def test_close_waits_for_the_populate_thread(sealed_memfd: int) -> None:
    mapping = _mapping(sealed_memfd)
    mapping.close()
    assert mapping.closed and mapping.wait_populated(0)
    assert mapping.populated is not None


def test_populate_now_fills_a_mapping_the_hint_left_unpopulated(sealed_memfd: int) -> None:
    # A standby (Note [standby instances]) populates whatever the daemon's hint said.
    mapping = _mapping(sealed_memfd, populate=False)
    try:
        assert mapping.populated is None
        assert mapping.populate_now() in ("populate_read", "touched")
        assert _faults_of_full_read(mapping) < PAGES // 64
        assert _anonymous_kib(mapping.address()) == 0
        # Asked again (or after a background populate), it does not populate twice.
        assert mapping.populate_now() == mapping.populated
    finally:
        mapping.close()
