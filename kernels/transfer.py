"""Data-transfer characterization (after Comm|Scope): bandwidth vs size per modality.

On any Linux machine:

- ``copy``: pageable memcpy between two pre-faulted buffers, with the CPU caches warm (the
  source was just touched) or flushed (a buffer larger than the last-level cache was streamed
  through first);
- ``copy-first-touch``: the same copy into freshly mapped pages, so every page faults on first
  touch (the CPU analogue of demand paging);
- between processes (:mod:`trims.kernels.transfer_ipc`): sealed memfd mapping, pipe, Unix
  socket, file read, and the producer-side cost of building the sealed memfd.

On NVIDIA GPUs with CuPy (:mod:`trims.kernels.transfer_gpu`): host-to-device and device-to-host
from pageable, pinned and write-combined memory, managed memory with prefetch vs demand paging,
zero-copy access from a kernel, and device-to-device.

Sizes run over powers of two, 2^8 ... 2^24 bytes by default (``full`` goes to 2^30).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trims.kernels import transfer_ipc as ipc
from trims.kernels.timing import median_seconds

log = logging.getLogger(__name__)

FLUSH_BYTES = 64 << 20
DEFAULT_MAX_LOG2 = 24
FULL_MAX_LOG2 = 30


@dataclass(frozen=True)
class TransferSettings:
    min_log2: int = 8
    max_log2: int = DEFAULT_MAX_LOG2
    repeat: int = 5
    budget_s: float = 1.0
    host: bool = True
    ipc: bool = True
    gpu: bool = False


@dataclass(frozen=True)
class TransferRow:
    """One (modality, size, cache state) measurement: median seconds and bytes/s."""

    modality: str
    size: int
    cache: str
    seconds: float
    bandwidth: float
    domain: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CacheFlusher:
    """Streams a buffer larger than the last-level cache through the CPU."""

    def __init__(self, nbytes: int = FLUSH_BYTES) -> None:
        self._buf = np.ones(nbytes // 8, np.uint64)

    def __call__(self) -> None:
        self._buf += np.uint64(1)


def _row(modality: str, size: int, cache: str, secs: float, domain: str) -> TransferRow:
    row = TransferRow(modality, size, cache, secs, size / secs if secs > 0 else 0.0, domain)
    log.info("transfer %s %d B (%s cache): %.3g GB/s", modality, size, cache,
             row.bandwidth / 1e9)  # fmt: skip
    return row


def _timed(prep: Callable[[], None], op: Callable[[], Any], settings: TransferSettings) -> float:
    """Median seconds of ``op`` with ``prep`` run (untimed) before each repetition."""
    import statistics
    import time

    times: list[float] = []
    spent = 0.0
    while len(times) < settings.repeat and (len(times) < 2 or spent < settings.budget_s):
        prep()
        t0 = time.perf_counter()
        op()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times)


def host_rows(settings: TransferSettings, sizes: list[int]) -> list[TransferRow]:
    flush = CacheFlusher()
    rows: list[TransferRow] = []
    for size in sizes:
        src = np.ones(size, np.uint8)
        dst = np.zeros(size, np.uint8)

        def warm(s: Any = src) -> None:
            s.sum(dtype=np.uint64)

        def copy(d: Any = dst, s: Any = src) -> None:
            np.copyto(d, s)

        for cache, prep in (("warm", warm), ("flushed", flush)):
            rows.append(_row("copy", size, cache, _timed(prep, copy, settings), "host"))
            rows.append(
                _row("copy-first-touch", size, cache, _first_touch(src, prep, settings), "host")
            )
    return rows


def _first_touch(src: Any, prep: Callable[[], None], settings: TransferSettings) -> float:
    """Copy into a fresh anonymous mapping each time (page faults on first touch)."""
    maps: list[mmap.mmap] = []

    def fresh() -> None:
        prep()
        maps.append(mmap.mmap(-1, src.size))

    def copy() -> None:
        np.copyto(np.frombuffer(maps[-1], np.uint8), src)

    try:
        return _timed(fresh, copy, settings)
    finally:
        for m in maps:
            m.close()


def ipc_rows(settings: TransferSettings, sizes: list[int]) -> list[TransferRow]:
    rows: list[TransferRow] = []
    with ipc.Consumer.start() as consumer:
        for size in sizes:
            payload = np.random.default_rng(size).integers(0, 255, size, np.uint8)
            view = memoryview(payload.data)
            expected = ipc.checksum(view)

            def build(v: memoryview = view) -> None:
                import os

                os.close(ipc.build_memfd(v))

            secs = median_seconds(build, repeat=settings.repeat, budget_s=settings.budget_s)
            rows.append(_row("memfd-create-write-seal", size, "warm", secs, "ipc"))
            for name, op in (
                ("memfd-map", ipc.OP_MEMFD),
                ("memfd-map-populate", ipc.OP_MEMFD_POPULATE),
                ("pipe", ipc.OP_PIPE),
                ("unix-socket", ipc.OP_SOCKET),
                ("file-read", ipc.OP_FILE),
            ):
                consumer.transfer(op, view, expected)
                times = [
                    consumer.transfer(op, view, expected) for _ in range(max(1, settings.repeat))
                ]
                rows.append(_row(name, size, "warm", float(np.median(times)), "ipc"))
    return rows


def run(settings: TransferSettings) -> list[TransferRow]:
    sizes = [1 << k for k in range(settings.min_log2, settings.max_log2 + 1)]
    rows: list[TransferRow] = []
    if settings.host:
        rows += host_rows(settings, sizes)
    if settings.ipc:
        rows += ipc_rows(settings, sizes)
    if settings.gpu:
        from trims.kernels import transfer_gpu

        rows += [_row(*r) for r in transfer_gpu.run(sizes, settings.repeat)]
    return rows
