"""Chunk digests (daemon/tiers/chunks.py): computed beside a whole hash that matched, then used
to check the same content on every core; a recorded digest that is wrong costs a whole hash,
never a good blob (Note [chunk digests])."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from trims.daemon.tiers import chunks
from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.disk import check_file
from trims.errors import CorruptModel

CHUNK = 4096
#: three whole chunks and a short last one
DATA = bytes(range(256)) * 60


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunks, "CHUNK", CHUNK)


@pytest.fixture
def pool() -> Iterator[ChunkDigests]:
    p = ChunkDigests(workers=2)
    yield p
    p.close()


def _expected(data: bytes) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(data[i : i + CHUNK]).digest() for i in range(0, len(data), CHUNK))


class Source:
    """``DATA`` as pieces, counting how often it was read whole."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reads = data, 0

    def pieces(self) -> Iterator[bytes]:
        self.reads += 1
        for i in range(0, len(self.data), CHUNK):
            yield self.data[i : i + CHUNK]


DIGEST = hashlib.sha256(DATA).hexdigest()


def test_a_whole_hash_that_matches_keeps_the_chunk_digests_and_the_next_check_uses_them(
    pool: ChunkDigests,
) -> None:
    assert chunks.chunk_count(len(DATA)) == 4
    first = Source(DATA)
    assert chunks.check(DIGEST, len(DATA), first.pieces, pool) == chunks.Checked(DIGEST)
    assert pool.get(DIGEST, len(DATA)) == _expected(DATA)
    assert pool.get(DIGEST, len(DATA) + CHUNK) is None  # another size: not these digests
    assert pool.take_unsaved() == {DIGEST: _expected(DATA)}
    assert pool.take_unsaved() == {}
    again = Source(DATA)
    assert chunks.check(DIGEST, len(DATA), again.pieces, pool) == chunks.Checked(DIGEST)
    assert again.reads == 1


def test_a_whole_hash_that_differs_keeps_nothing(pool: ChunkDigests) -> None:
    changed = DATA[:-1] + b"\x00"
    checked = chunks.check(DIGEST, len(DATA), Source(changed).pieces, pool)
    assert checked.actual == hashlib.sha256(changed).hexdigest() and checked.differ is None
    assert pool.get(DIGEST) is None and pool.take_unsaved() == {}


def test_content_that_differs_from_known_chunks_fails_after_a_whole_hash(
    pool: ChunkDigests,
) -> None:
    pool.learn(DIGEST, _expected(DATA))
    changed = DATA[: 2 * CHUNK + 5] + b"\xff" + DATA[2 * CHUNK + 6 :]
    source = Source(changed)
    checked = chunks.check(DIGEST, len(DATA), source.pieces, pool)
    assert checked.actual == hashlib.sha256(changed).hexdigest()
    assert checked.differ == (2 * CHUNK, 3 * CHUNK)
    assert source.reads == 2


def test_wrong_recorded_chunk_digests_cost_a_whole_hash_and_are_replaced(
    pool: ChunkDigests, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = (*_expected(DATA)[:3], b"\x00" * 32)
    pool.learn(DIGEST, wrong)
    source = Source(DATA)
    with caplog.at_level(logging.WARNING, "trims.daemon.tiers.chunks"):
        assert chunks.check(DIGEST, len(DATA), source.pieces, pool) == chunks.Checked(DIGEST)
    assert source.reads == 2
    assert "recorded chunk digests were wrong" in caplog.text
    assert pool.get(DIGEST) == _expected(DATA)
    assert pool.take_unsaved() == {DIGEST: _expected(DATA)}


def test_one_cpu_computes_no_chunk_digests_unless_asked_or_replacing_wrong_ones() -> None:
    single = ChunkDigests(workers=1)
    try:
        assert not single.parallel
        assert chunks.check(DIGEST, len(DATA), Source(DATA).pieces, single).actual == DIGEST
        assert single.get(DIGEST) is None
        chunks.check(DIGEST, len(DATA), Source(DATA).pieces, single, each=True)
        assert single.get(DIGEST) == _expected(DATA)
        single.forget(DIGEST)
        single.learn(DIGEST, (b"\x00" * 32,) * 4)
        checked = chunks.check(DIGEST, len(DATA), Source(DATA).pieces, single)
        assert checked == chunks.Checked(DIGEST)
        assert single.get(DIGEST) == _expected(DATA)
    finally:
        single.close()


def test_slices_of_a_mapping_are_released_so_it_can_close(pool: ChunkDigests) -> None:
    with mmap.mmap(-1, len(DATA)) as m:
        m.write(DATA)
        for _ in range(2):  # a whole hash, then known chunks
            with memoryview(m) as view:
                checked = chunks.check(
                    DIGEST, len(DATA), lambda v=view: chunks.view_pieces(v, len(DATA)), pool
                )
            assert checked == chunks.Checked(DIGEST)
    assert m.closed


def test_check_file_reads_by_pread_and_names_a_short_file(
    tmp_path: Path, pool: ChunkDigests
) -> None:
    path = tmp_path / "blob"
    path.write_bytes(DATA)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 7, os.SEEK_SET)
        assert check_file(fd, len(DATA), DIGEST, pool).actual == DIGEST
        assert os.lseek(fd, 0, os.SEEK_CUR) == 7
    finally:
        os.close(fd)
    with pytest.raises(CorruptModel, match=r"blob is truncated: 5 of \d+ bytes missing"):
        check_file(path, len(DATA) + 5, DIGEST, pool)


@pytest.mark.parametrize("extra", [5, CHUNK + 5])
def test_a_direct_check_reads_the_device_and_names_a_short_file(
    tmp_path: Path, pool: ChunkDigests, extra: int
) -> None:
    path = tmp_path / "blob"
    path.write_bytes(DATA)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    assert check_file(path, len(DATA), DIGEST, pool, direct=True).actual == DIGEST
    with pytest.raises(CorruptModel, match=rf"blob is truncated: {extra} of \d+ bytes missing"):
        check_file(path, len(DATA) + extra, DIGEST, pool, direct=True)
