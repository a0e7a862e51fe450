"""The tcu study: throughput and error of the tensor-core formulations vs library baselines.

One row per (operation, segment size, total size, method): elements/s, the fraction of the
measured copy bandwidth for the same number of fp16 elements, and the error against float64
relative to :func:`trims.kernels.tcu.error_bound` (at most 1 is within the stated bound).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from trims.kernels import tcu
from trims.kernels.timing import median_seconds

log = logging.getLogger(__name__)

SEGMENTS = (16, 256, 1024, 4096, 16384, 0)


@dataclass(frozen=True)
class TcuRow:
    """One measurement; ``segment`` 0 is the full (unsegmented) operation."""

    operation: str
    segment: int
    total: int
    method: str
    backend: str
    seconds: float
    elements_per_s: float
    copy_fraction: float
    error_ratio: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TcuSettings:
    """What to sweep. Sizes are log2 of the element count (2^12 ... 2^28 in the study)."""

    min_log2: int = 12
    max_log2: int = 20
    segments: tuple[int, ...] = SEGMENTS
    backend: str = "numpy"
    repeat: int = 5
    seed: int = 0


def _methods(
    op: tcu.Operation, segment: int, xp: Any, backend: str
) -> Iterator[tuple[str, str | None, Callable[[Any], Any]]]:
    """(method name, accumulator or None for baselines, fn(x16) -> result)."""
    for acc in ("fp16", "fp32"):
        acc_t: tcu.Acc = "fp16" if acc == "fp16" else "fp32"
        if segment == 0:
            fn = tcu.full_reduce if op == "reduce" else tcu.full_scan

            def full(x: Any, fn: Any = fn, acc_t: tcu.Acc = acc_t) -> Any:
                return fn(x, acc_t, xp=xp)

            yield f"{backend}-matmul-{acc}", acc, full
        else:
            seg_fn = tcu.segmented_reduce if op == "reduce" else tcu.segmented_scan

            def seg(x: Any, fn: Any = seg_fn, acc_t: tcu.Acc = acc_t) -> Any:
                return fn(x, segment, acc_t, xp=xp)

            yield f"{backend}-matmul-{acc}", acc, seg
    if backend == "cupy" and (segment == 16 or (segment and segment % 256 == 0)):
        kernels = tcu.wmma_kernels()
        for acc in ("fp16", "fp32"):
            acc_t = "fp16" if acc == "fp16" else "fp32"
            kernel_fn = kernels.reduce if op == "reduce" else kernels.scan

            def wmma(x: Any, fn: Any = kernel_fn, a: tcu.Acc = acc_t) -> Any:
                return fn(x, segment, a)

            yield f"wmma-{acc}", acc, wmma
    base = "cub" if backend == "cupy" else "numpy"
    base_fn = tcu.baseline_reduce if op == "reduce" else tcu.baseline_scan

    def baseline(x: Any) -> Any:
        return base_fn(x, segment or int(x.size), xp=xp)

    yield f"{base}-{'sum' if op == 'reduce' else 'cumsum'}", None, baseline


def run(settings: TcuSettings) -> list[TcuRow]:
    """Sweep operations x segments x sizes x methods; returns the rows (also logged)."""
    xp: Any = np
    sync: Callable[[], None] | None = None
    if settings.backend == "cupy":
        from trims.kernels.gpu import require_cupy

        xp = require_cupy()
        xp._core.set_routine_accelerators(["cub"])
        stream = xp.cuda.get_current_stream()
        sync = stream.synchronize
    rng = np.random.default_rng(settings.seed)
    rows: list[TcuRow] = []
    for log2 in range(settings.min_log2, settings.max_log2 + 1):
        total = 1 << log2
        host = rng.uniform(-1.0, 1.0, total).astype(np.float16)
        x16 = xp.asarray(host)
        dst = xp.empty_like(x16)
        copy_s = median_seconds(
            functools.partial(xp.copyto, dst, x16), repeat=settings.repeat, sync=sync
        )
        copy_eps = total / copy_s
        for op in ("reduce", "scan"):
            op_t: tcu.Operation = "reduce" if op == "reduce" else "scan"
            for segment in settings.segments:
                if segment > total:
                    continue
                for method, acc, fn in _methods(op_t, segment, xp, settings.backend):
                    secs = median_seconds(
                        functools.partial(fn, x16), repeat=settings.repeat, sync=sync
                    )
                    err: float | None = None
                    if acc is not None:
                        result = fn(x16)
                        got = np.atleast_1d(np.asarray(_to_host(result)))
                        acc_t: tcu.Acc = "fp16" if acc == "fp16" else "fp32"
                        err = tcu.error_ratio(op_t, got, host, segment, acc_t)
                    row = TcuRow(
                        operation=op,
                        segment=segment,
                        total=total,
                        method=method,
                        backend=settings.backend,
                        seconds=secs,
                        elements_per_s=total / secs,
                        copy_fraction=(total / secs) / copy_eps,
                        error_ratio=err,
                    )
                    log.info(
                        "tcu %s segment %d total 2^%d %s: %.3g elements/s (%.1f%% of copy)",
                        op, segment, log2, method, row.elements_per_s, 100 * row.copy_fraction,
                    )  # fmt: skip
                    rows.append(row)
    return rows


def _to_host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a
