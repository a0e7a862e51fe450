"""Tensor-core reduction/scan formulations against float64 references and stated bounds."""

from __future__ import annotations

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.kernels import tcu

SEGMENTS = [1, 5, 16, 17, 48, 240, 256, 300, 512, 768, 4096]
SIZES = [1, 15, 16, 17, 255, 256, 1000, 4099]


def _inputs(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    return {
        "normal": rng.standard_normal(n),
        "uniform": rng.uniform(0, 1, n),
        "tiny": rng.standard_normal(n) * 1e-6,
        "cancelling": np.where(np.arange(n) % 2 == 0, 100.0, -100.0),
        "zeros": np.zeros(n),
    }


def test_constant_matrices_match_the_formulation() -> None:
    m = tcu.constant_matrices()
    a = np.arange(256, dtype=np.float64).reshape(16, 16)
    assert np.array_equal(a @ m["PT"].astype(float), np.pad(a.sum(1)[:, None], ((0, 0), (0, 15))))
    assert (m["P"].astype(float) @ a @ m["PT"].astype(float))[0, 0] == a.sum()
    scan = a @ m["U"].astype(float) + (m["L"].astype(float) @ a) @ m["O"].astype(float)
    assert np.array_equal(scan.reshape(-1), np.cumsum(a))


@pytest.mark.parametrize(
    ("segment", "method"),
    [(1, "16"), (16, "16"), (17, "16n"), (240, "16n"), (256, "256"), (300, "16n"),
     (512, "256n"), (768, "256n"), (16384, "256n")],
)  # fmt: skip
def test_method_for_segment(segment: int, method: str) -> None:
    assert tcu.method_for(segment) == method


@pytest.mark.parametrize("acc", ["fp16", "fp32"])
@pytest.mark.parametrize("segment", SEGMENTS)
def test_segmented_within_bounds(segment: int, acc: tcu.Acc) -> None:
    for n in SIZES:
        for name, x in _inputs(n).items():
            red = tcu.segmented_reduce(x, segment, acc)
            assert red.shape == (-(-n // segment),)
            assert tcu.error_ratio("reduce", red, x, segment, acc) <= 1.0, (name, n)
            scan = tcu.segmented_scan(x, segment, acc)
            assert scan.shape == (n,)
            assert tcu.error_ratio("scan", scan, x, segment, acc) <= 1.0, (name, n)


@pytest.mark.parametrize("acc", ["fp16", "fp32"])
def test_full_within_bounds(acc: tcu.Acc) -> None:
    for n in [1, 17, 4096, 4097, 70001]:
        x = np.random.default_rng(n).uniform(-0.5, 0.5, n)
        assert tcu.error_ratio("scan", tcu.full_scan(x, acc), x, 0, acc) <= 1.0
        assert tcu.error_ratio("reduce", [tcu.full_reduce(x, acc)], x, 0, acc) <= 1.0


def test_fp32_accumulation_is_exact_on_integers() -> None:
    x = np.random.default_rng(1).integers(-8, 9, 70000).astype(np.float64)
    assert tcu.full_reduce(x, "fp32") == x.sum()
    assert np.array_equal(tcu.full_scan(x, "fp32"), np.cumsum(x))
    assert np.array_equal(tcu.segmented_scan(x, 768, "fp32"), tcu.reference("scan", x, 768))


def test_empty_input_gives_empty_output() -> None:
    for acc in ("fp16", "fp32"):
        assert tcu.segmented_reduce([], 16, acc).shape == (0,)
        assert tcu.segmented_scan([], 256, acc).shape == (0,)
        assert tcu.full_scan([], acc).shape == (0,)
        assert tcu.full_reduce([], acc) == 0.0


def test_segment_longer_than_input_is_one_partial_segment() -> None:
    x = np.arange(10.0)
    assert np.array_equal(tcu.segmented_reduce(x, 4096), [45.0])
    assert np.array_equal(tcu.segmented_scan(x, 4096), np.cumsum(x))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_rejected(bad: float) -> None:
    x = np.ones(40)
    x[33] = bad
    for fn in (lambda: tcu.segmented_reduce(x, 16), lambda: tcu.segmented_scan(x, 256),
               lambda: tcu.full_scan(x), lambda: tcu.full_reduce(x)):  # fmt: skip
        with pytest.raises(ValidationError, match=r"non-finite value .* at index 33"):
            fn()


def test_out_of_fp16_range_and_overflow_are_rejected() -> None:
    with pytest.raises(ValidationError, match="beyond the fp16 range"):
        tcu.segmented_reduce([1e5], 16)
    big = np.full(512, 60000.0)
    with pytest.raises(ValidationError, match="fp16 accumulation overflowed"):
        tcu.segmented_reduce(big, 32, "fp16")
    assert tcu.segmented_reduce(big, 32, "fp32")[0] == 32 * 60000.0
    with pytest.raises(ValidationError, match="tensor-core operand exceeded the fp16 range"):
        tcu.segmented_reduce(big, 256, "fp32")


def test_bad_segment_is_rejected() -> None:
    with pytest.raises(ValidationError, match="positive integer"):
        tcu.segmented_reduce([1.0], 0)


def test_baselines_match_reference() -> None:
    x = np.random.default_rng(2).integers(-4, 5, 1000).astype(np.float16)
    assert np.array_equal(tcu.baseline_reduce(x, 48), tcu.reference("reduce", x, 48))
    assert np.array_equal(tcu.baseline_scan(x, 48), tcu.reference("scan", x, 48))


def test_error_bound_grows_with_the_chain() -> None:
    assert tcu.error_bound("reduce", 16, "fp32") < tcu.error_bound("reduce", 16, "fp16")
    assert tcu.error_bound("scan", 256, "fp16") < tcu.error_bound("scan", 4096, "fp16")
