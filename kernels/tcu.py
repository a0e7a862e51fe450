"""Reduction and scan as 16x16 matrix multiplications (tensor core units).

Follows Dakkak et al., "Accelerating reduction and scan using tensor core units" (ICS'19). A
256-element segment is a row-major 16x16 tile ``A``; with ``P`` (ones in row 0), ``U``
(upper-triangular ones with the diagonal), ``L`` (strictly lower-triangular ones) and ``O`` (all
ones):

==========  ===========================================  =========================================
segment     reduction                                    scan
==========  ===========================================  =========================================
16          ``V = A P^T`` (column 0: 16 row sums)        ``S = A U``
256         ``V = (P A) P^T``, ``V[0,0]`` is the sum     ``S = A U + (L A) O``
16n         ``V += A_k P^T`` over 16-column slabs        ``S_k = A_k U + carry`` (last column of
                                                         ``S_{k-1}`` broadcast as the addend)
256n        ``V += P A_k`` over tiles, then ``V P^T``    per tile as 256, carrying the last sum
full        segmented 256n, then the partials, then an add-partials pass
==========  ===========================================  =========================================

Every multiply is one tensor-core MMA ``D = A B + C``: its operands are fp16 (an fp32
intermediate used as an operand is rounded to fp16 first), products are exact, and ``D`` is
rounded to the accumulator type, fp16 (``acc="fp16"``) or fp32 (``acc="fp32"``). The NumPy path
emulates exactly that with float32 BLAS matmuls; the CuPy path runs the same batched matmuls on
the GPU, and :data:`WMMA_SOURCE` holds warp-level WMMA kernels for the segmented operations.
:func:`error_bound` states the worst-case error each method may have against a float64
reference, which the tests check.

Inputs must be finite and within the fp16 range; sizes that are not a multiple of 16 (or of the
segment) are zero-padded, and outputs are cut back to the input's length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from trims.errors import ValidationError

log = logging.getLogger(__name__)

Acc = Literal["fp16", "fp32"]
Operation = Literal["reduce", "scan"]
TILE = 16
FP16_MAX = 65504.0
U16 = 2.0**-11
U32 = 2.0**-24
#: segment length of the first pass of the full reduction/scan (16 tiles of 256)
FULL_CHUNK = 4096
WMMA_SOURCE_PATH = Path(__file__).with_name("tcu_wmma.cu")

FArray = npt.NDArray[np.floating[Any]]


def constant_matrices() -> dict[str, npt.NDArray[np.float16]]:
    """P, P^T, U, L and O as fp16 16x16 matrices."""
    p = np.zeros((TILE, TILE), np.float16)
    p[0, :] = 1
    return {
        "P": p,
        "PT": np.ascontiguousarray(p.T),
        "U": np.triu(np.ones((TILE, TILE), np.float16)),
        "L": np.tril(np.ones((TILE, TILE), np.float16), -1),
        "O": np.ones((TILE, TILE), np.float16),
    }


def method_for(segment: int) -> str:
    """Which formulation a segment size uses (after padding it to a multiple of 16)."""
    s = _round_up(max(segment, 1), TILE)
    if s == TILE:
        return "16"
    if s == TILE * TILE:
        return "256"
    if s % (TILE * TILE) == 0:
        return "256n"
    return "16n"


def rounding_stages(op: Operation, segment: int, n: int | None = None) -> tuple[int, int]:
    """(operand roundings to fp16, accumulator roundings) on one output's dependency chain.

    ``segment=0`` means the full operation over ``n`` elements.
    """
    if segment == 0:
        size = _round_up(max(n or 0, 1), TILE)
        if size <= FULL_CHUNK:
            return rounding_stages(op, size)
        ops, accs = rounding_stages(op, FULL_CHUNK)
        sub_ops, sub_accs = rounding_stages(op, 0, -(-size // FULL_CHUNK))
        return ops + sub_ops + 1, accs + sub_accs + 1
    s = _round_up(max(segment, 1), TILE)
    method = method_for(s)
    k = s // TILE if method == "16n" else s // (TILE * TILE)
    table = {
        ("reduce", "16"): (0, 1),
        ("reduce", "256"): (1, 2),
        ("reduce", "16n"): (0, k),
        ("reduce", "256n"): (1, k + 1),
        ("scan", "16"): (0, 1),
        ("scan", "256"): (1, 3),
        ("scan", "16n"): (0, k),
        ("scan", "256n"): (k, 3 * k),
    }
    return table[(op, method)]


def error_bound(op: Operation, segment: int, acc: Acc, n: int | None = None) -> float:
    """Worst-case |result - float64 reference| divided by the sum of |x| the result depends on.

    First-order bound: the input rounding to fp16, one fp16 unit per operand rounding, one
    accumulator unit per accumulator rounding, and the fp32 sums inside each MMA.
    """
    ops, accs = rounding_stages(op, segment, n)
    u_acc = U16 if acc == "fp16" else U32
    return (1 + ops) * U16 + accs * u_acc + 32 * U32


# ----------------------------------------------------------------------------- validation


def to_fp16(x: npt.ArrayLike, xp: Any = np) -> Any:
    """The input as a flat fp16 array; NaN, inf and values beyond the fp16 range are refused."""
    a = xp.asarray(x).reshape(-1)
    if a.dtype.kind not in "fiub":
        raise ValidationError(f"input dtype {a.dtype} is not numeric; pass a real-valued array")
    if a.size:
        bad = ~xp.isfinite(a)
        if bool(bad.any()):
            i = int(xp.argmax(bad))
            raise ValidationError(
                f"input holds a non-finite value ({float(a[i])}) at index {i}; the tensor-core "
                "reduction and scan accept finite values only: remove or replace NaN/inf first"
            )
        big = float(xp.abs(a).max())
        if big > FP16_MAX:
            raise ValidationError(
                f"input holds |x| = {big:g}, beyond the fp16 range (65504); scale the input down"
            )
    return a.astype(xp.float16)


def _check_overflow(out: Any, xp: Any, acc: Acc) -> None:
    if out.size and not bool(xp.isfinite(out).all()):
        raise ValidationError(
            f"{acc} accumulation overflowed (a partial sum exceeded the fp16 range 65504); "
            "use acc='fp32' or scale the input down"
        )


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _segments(a: Any, segment: int, xp: Any) -> tuple[Any, int]:
    """(nseg, s16) zero-padded segment matrix and the number of segments."""
    n = int(a.size)
    nseg = max(1, -(-n // segment))
    s16 = _round_up(segment, TILE)
    padded = xp.zeros(nseg * segment, dtype=xp.float16)
    padded[:n] = a
    mat = padded.reshape(nseg, segment)
    if s16 != segment:
        wide = xp.zeros((nseg, s16), dtype=xp.float16)
        wide[:, :segment] = mat
        mat = wide
    return mat, nseg


# ----------------------------------------------------------------------------- the MMA


class _Mma:
    """``D = A B + C`` on stacks of 16x16 tiles, with tensor-core rounding (see module doc)."""

    def __init__(self, acc: Acc, xp: Any) -> None:
        self.xp = xp
        self.acc_dtype = xp.float16 if acc == "fp16" else xp.float32
        self.m = {k: xp.asarray(v) for k, v in constant_matrices().items()}

    def _operand(self, a: Any) -> Any:
        """Round to fp16 as a tensor core's operand; refuse partial sums fp16 cannot hold."""
        with np.errstate(over="ignore"):
            h = a.astype(self.xp.float16)
        if a.dtype != self.xp.float16 and h.size and not bool(self.xp.isfinite(h).all()):
            raise ValidationError(
                "a partial sum used as a tensor-core operand exceeded the fp16 range (65504); "
                "scale the input down, or use segment sizes 16 or 16n, which keep partial "
                "sums in the accumulator"
            )
        return h.astype(self.xp.float32)

    def right(self, a: Any, name: str, c: Any | None = None) -> Any:
        """A_b @ M for every tile A_b of ``a`` (shape (..., 16, 16)); one GEMM for the stack."""
        shape = a.shape
        d = self._operand(a).reshape(-1, TILE) @ self.m[name].astype(self.xp.float32)
        d = d.reshape(shape)
        if c is not None:
            d = d + c.astype(self.xp.float32)
        with np.errstate(over="ignore"):
            return d.astype(self.acc_dtype)

    def left(self, name: str, a: Any, c: Any | None = None) -> Any:
        """M @ A_b for every tile: (A_b^T M^T)^T, again one GEMM for the stack."""
        shape = a.shape
        at = self.xp.ascontiguousarray(self.xp.swapaxes(self._operand(a), -1, -2))
        d = at.reshape(-1, TILE) @ self.m[name].astype(self.xp.float32).T
        d = self.xp.swapaxes(d.reshape(shape), -1, -2)
        if c is not None:
            d = d + c.astype(self.xp.float32)
        with np.errstate(over="ignore"):
            return d.astype(self.acc_dtype)


# ----------------------------------------------------------------------------- formulations


def _pad_segments(mat: Any, xp: Any) -> tuple[Any, int]:
    """``mat`` (nseg, s) in fp16 with zero rows appended up to a multiple of 16; (rows, count)."""
    groups = _round_up(mat.shape[0], TILE)
    rows = xp.zeros((groups, mat.shape[1]), xp.float16)
    rows[: mat.shape[0]] = mat
    return rows, groups


def _reduce_segments(mat: Any, mma: _Mma) -> Any:
    """Sums of the rows of ``mat`` (nseg, s16) by the formulation for s16."""
    xp = mma.xp
    nseg, s = mat.shape
    method = method_for(s)
    if method == "16":
        tiles, groups = _pad_segments(mat, xp)
        v = mma.right(tiles.reshape(-1, TILE, TILE), "PT")
        return v[:, :, 0].reshape(-1)[:nseg]
    if method == "256":
        v = mma.right(mma.left("P", mat.reshape(-1, TILE, TILE)), "PT")
        return v[:, 0, 0]
    if method == "256n":
        tiles = mat.reshape(nseg, s // (TILE * TILE), TILE, TILE)
        v = None
        for k in range(tiles.shape[1]):
            v = mma.left("P", tiles[:, k], v)
        assert v is not None
        return mma.right(v, "PT")[:, 0, 0]
    # 16n: 16 segments per tile row block, accumulate over 16-column slabs
    rows, groups = _pad_segments(mat, xp)
    slabs = rows.reshape(groups // TILE, TILE, s // TILE, TILE)
    v = None
    for k in range(slabs.shape[2]):
        v = mma.right(slabs[:, :, k], "PT", v)
    assert v is not None
    return v[:, :, 0].reshape(-1)[:nseg]


def _scan_segments(mat: Any, mma: _Mma) -> Any:
    """Inclusive prefix sums along the rows of ``mat`` (nseg, s16)."""
    xp = mma.xp
    nseg, s = mat.shape
    method = method_for(s)
    if method == "16":
        tiles, groups = _pad_segments(mat, xp)
        return mma.right(tiles.reshape(-1, TILE, TILE), "U").reshape(groups, TILE)[:nseg]
    if method == "256":
        tiles = mat.reshape(-1, TILE, TILE)
        return _scan256(tiles, mma, None).reshape(nseg, s)
    if method == "256n":
        tiles = mat.reshape(nseg, s // (TILE * TILE), TILE, TILE)
        out = xp.empty(tiles.shape, mma.acc_dtype)
        carry = None
        for k in range(tiles.shape[1]):
            addend = (
                None if carry is None else xp.broadcast_to(carry[:, None, None], (nseg, TILE, TILE))
            )
            out[:, k] = _scan256(tiles[:, k], mma, addend)
            carry = out[:, k, TILE - 1, TILE - 1]
        return out.reshape(nseg, s)
    rows, groups = _pad_segments(mat, xp)
    slabs = rows.reshape(groups // TILE, TILE, s // TILE, TILE)
    out = xp.empty(slabs.shape, mma.acc_dtype)
    carry = None
    for k in range(slabs.shape[2]):
        addend = None if carry is None else xp.broadcast_to(carry[:, :, None], (*carry.shape, TILE))
        out[:, :, k] = mma.right(slabs[:, :, k], "U", addend)
        carry = out[:, :, k, TILE - 1]
    return out.reshape(groups, s)[:nseg]


def _scan256(tiles: Any, mma: _Mma, addend: Any | None) -> Any:
    """``S = A U + (L A) O (+ addend)`` for a stack of 256-element tiles."""
    s = mma.right(tiles, "U", addend)
    return mma.right(mma.left("L", tiles), "O", s)


# ----------------------------------------------------------------------------- public API


def segmented_reduce(x: npt.ArrayLike, segment: int, acc: Acc = "fp32", *, xp: Any = np) -> Any:
    """Sum of every ``segment`` consecutive elements (the last segment may be partial).

    Returns an array of ``ceil(n / segment)`` sums in the accumulator type (empty for n = 0).
    """
    _check_segment(segment)
    a = to_fp16(x, xp)
    if a.size == 0:
        return xp.zeros(0, xp.float16 if acc == "fp16" else xp.float32)
    mat, _ = _segments(a, segment, xp)
    out = _reduce_segments(mat, _Mma(acc, xp))
    _check_overflow(out, xp, acc)
    return out


def segmented_scan(x: npt.ArrayLike, segment: int, acc: Acc = "fp32", *, xp: Any = np) -> Any:
    """Inclusive prefix sums restarting every ``segment`` elements; same length as ``x``."""
    _check_segment(segment)
    a = to_fp16(x, xp)
    n = int(a.size)
    if n == 0:
        return xp.zeros(0, xp.float16 if acc == "fp16" else xp.float32)
    mat, _ = _segments(a, segment, xp)
    out = _scan_segments(mat, _Mma(acc, xp))[:, :segment].reshape(-1)[:n]
    _check_overflow(out, xp, acc)
    return out


def full_reduce(x: npt.ArrayLike, acc: Acc = "fp32", *, xp: Any = np) -> float:
    """Sum of all elements: segmented 256n, then a reduction of the partials (recursively)."""
    a = to_fp16(x, xp)
    if a.size == 0:
        return 0.0
    return float(_full_reduce(a, _Mma(acc, xp), acc))


def _full_reduce(a: Any, mma: _Mma, acc: Acc) -> Any:
    xp = mma.xp
    if a.size <= FULL_CHUNK:
        mat, _ = _segments(a, _round_up(int(a.size), TILE), xp)
        out = _reduce_segments(mat, mma)
        _check_overflow(out, xp, acc)
        return out[0]
    partials = _reduce_segments(_segments(a, FULL_CHUNK, xp)[0], mma)
    _check_overflow(partials, xp, acc)
    return _full_reduce(partials, mma, acc)


def full_scan(x: npt.ArrayLike, acc: Acc = "fp32", *, xp: Any = np) -> Any:
    """Inclusive prefix sums over the whole input.

    Segmented 256n scan, then a scan of the segment totals (recursively), then an add-partials
    pass adding each segment's exclusive prefix.
    """
    a = to_fp16(x, xp)
    n = int(a.size)
    if n == 0:
        return xp.zeros(0, xp.float16 if acc == "fp16" else xp.float32)
    out = _full_scan(a, _Mma(acc, xp), acc)[:n]
    _check_overflow(out, xp, acc)
    return out


def _full_scan(a: Any, mma: _Mma, acc: Acc) -> Any:
    xp = mma.xp
    n = int(a.size)
    if n <= FULL_CHUNK:
        mat, _ = _segments(a, _round_up(n, TILE), xp)
        return _scan_segments(mat, mma).reshape(-1)[:n]
    mat, nseg = _segments(a, FULL_CHUNK, xp)
    scanned = _scan_segments(mat, mma)
    _check_overflow(scanned, xp, acc)
    totals = _full_scan(scanned[:, -1], mma, acc)
    exclusive = xp.zeros(nseg, xp.float32)
    exclusive[1:] = totals[:-1].astype(xp.float32)
    with np.errstate(over="ignore"):
        out = (scanned.astype(xp.float32) + exclusive[:, None]).astype(mma.acc_dtype)
    return out.reshape(-1)[:n]


def _check_segment(segment: int) -> None:
    if int(segment) != segment or segment < 1:
        raise ValidationError(f"segment size {segment!r} must be a positive integer")


# ----------------------------------------------------------------------------- baselines


def baseline_reduce(x: Any, segment: int, *, xp: Any = np) -> Any:
    """Segmented sum by the library (NumPy; CuPy with CUB when enabled), fp16 in, fp32 out."""
    a = xp.asarray(x, dtype=xp.float16)
    mat, _ = _segments(a, segment, xp)
    return mat.sum(axis=1, dtype=xp.float32)


def baseline_scan(x: Any, segment: int, *, xp: Any = np) -> Any:
    """Segmented cumsum by the library, fp16 in, fp32 out."""
    a = xp.asarray(x, dtype=xp.float16)
    mat, _ = _segments(a, segment, xp)
    return mat.cumsum(axis=1, dtype=xp.float32)[:, :segment].reshape(-1)[: a.size]


# ----------------------------------------------------------------------------- WMMA kernels


@dataclass(frozen=True)
class WmmaKernels:
    """The compiled WMMA module (CuPy RawModule) and the kernel names it exports."""

    module: Any

    def reduce(self, x16: Any, segment: int, acc: Acc) -> Any:
        """Segmented reduction on the GPU, one warp per tile (segment 16) or segment (256n)."""
        cp = _cupy()
        n = int(x16.size)
        dtype = cp.float16 if acc == "fp16" else cp.float32
        if segment == TILE:
            tiles = -(-n // (TILE * TILE))
            buf = cp.zeros(tiles * TILE * TILE, cp.float16)
            buf[:n] = x16
            out = cp.empty(tiles * TILE, dtype)
            self._launch(f"reduce16_{acc}", tiles, (buf, out, np.int64(tiles)))
            return out[: -(-n // TILE)]
        if segment % (TILE * TILE):
            raise ValidationError("the WMMA kernels take segment 16 or a multiple of 256")
        nseg = -(-n // segment)
        buf = cp.zeros(nseg * segment, cp.float16)
        buf[:n] = x16
        out = cp.empty(nseg, dtype)
        k = segment // (TILE * TILE)
        self._launch(f"reduce256n_{acc}", nseg, (buf, out, np.int64(nseg), np.int32(k)))
        return out

    def scan(self, x16: Any, segment: int, acc: Acc) -> Any:
        """Segmented inclusive scan on the GPU for segment 16 or a multiple of 256."""
        cp = _cupy()
        n = int(x16.size)
        dtype = cp.float16 if acc == "fp16" else cp.float32
        if segment == TILE:
            tiles = -(-n // (TILE * TILE))
            buf = cp.zeros(tiles * TILE * TILE, cp.float16)
            buf[:n] = x16
            out = cp.empty(tiles * TILE * TILE, dtype)
            self._launch(f"scan16_{acc}", tiles, (buf, out, np.int64(tiles)))
            return out[:n]
        if segment % (TILE * TILE):
            raise ValidationError("the WMMA kernels take segment 16 or a multiple of 256")
        nseg = -(-n // segment)
        buf = cp.zeros(nseg * segment, cp.float16)
        buf[:n] = x16
        out = cp.empty(nseg * segment, dtype)
        k = segment // (TILE * TILE)
        self._launch(f"scan256n_{acc}", nseg, (buf, out, np.int64(nseg), np.int32(k)))
        return out[:n]

    def _launch(self, name: str, warps: int, args: tuple[Any, ...]) -> None:
        per_block = 4
        blocks = -(-warps // per_block)
        self.module.get_function(name)((blocks,), (32 * per_block,), args)


def _cupy() -> Any:
    from trims.kernels.gpu import require_cupy

    return require_cupy()


@cache
def wmma_kernels() -> WmmaKernels:
    """Compile :data:`WMMA_SOURCE_PATH` with NVRTC (needs sm_70 or newer)."""
    cp = _cupy()
    source = WMMA_SOURCE_PATH.read_text()
    try:
        module = cp.RawModule(code=source, options=("-std=c++17",))
        module.compile()
    except Exception as e:  # cupy.cuda.compiler.CompileException and driver errors
        raise ValidationError(f"WMMA kernels failed to compile for this GPU: {e}") from e
    return WmmaKernels(module)


def reference(op: Operation, x: npt.ArrayLike, segment: int) -> npt.NDArray[np.float64]:
    """float64 reference of a segmented (segment > 0) or full (segment = 0) operation."""
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    n = a.size
    seg = n if segment == 0 else segment
    if n == 0:
        return np.zeros(0 if segment else 1)
    nseg = -(-n // seg)
    pad = np.zeros(nseg * seg)
    pad[:n] = a
    mat = pad.reshape(nseg, seg)
    if op == "reduce":
        return np.asarray(mat.sum(axis=1), dtype=np.float64)
    return mat.cumsum(axis=1).reshape(-1)[:n]


def abs_reference(op: Operation, x: npt.ArrayLike, segment: int) -> npt.NDArray[np.float64]:
    """The sums of |x| each output depends on (the scale of :func:`error_bound`)."""
    return reference(op, np.abs(np.asarray(x, dtype=np.float64)), segment)


def error_ratio(op: Operation, result: Any, x: npt.ArrayLike, segment: int, acc: Acc) -> float:
    """max over outputs of |result - float64 reference| / allowed error; at most 1 is in bounds.

    allowed = :func:`error_bound` * (sum of |x| the output depends on) + one fp16 subnormal
    spacing (2^-24) per element and rounding stage, which covers values too small for fp16's
    relative precision.
    """
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    ref = reference(op, a, segment)
    got = np.asarray(result, dtype=np.float64).reshape(-1)
    if got.size == 0:
        return 0.0
    ops, accs = rounding_stages(op, segment, a.size)
    counts = reference(op, np.ones_like(a), segment)
    allowed = (
        error_bound(op, segment, acc, a.size) * abs_reference(op, a, segment)
        + (counts + ops + accs) * 2.0**-24
    )
    return float(np.max(np.abs(got - ref) / allowed))
