"""NumPy adapter over a real sealed-memfd mapping: values, dtypes, no copy, identical outputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.runtime.mapping import HostMapping

MakeModel = Callable[..., HostMapping]


def test_views_hold_the_values_of_every_dtype(make_model: MakeModel) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "f64": rng.standard_normal((3, 5)),
        "f32": rng.standard_normal((7,)).astype(np.float32),
        "f16": rng.standard_normal((2, 2, 2)).astype(np.float16),
        "i64": np.arange(-5, 5, dtype=np.int64),
        "u8": np.arange(200, dtype=np.uint8),
        "flag": np.array([True, False, True]),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "bf16": np.array([0x3F80, 0xC000], dtype=np.uint16),
    }
    mapping = make_model(arrays, dtypes={"bf16": "bfloat16"})
    views = mapping.numpy()
    assert list(views) == list(arrays)
    for name, original in arrays.items():
        assert views[name].dtype == original.dtype, name
        assert views[name].shape == original.shape, name
        np.testing.assert_array_equal(views[name], original)


def test_views_point_into_the_mapping(make_model: MakeModel) -> None:
    mapping = make_model({"a": np.ones(1000, np.float32), "b": np.zeros((10, 10), np.int32)})
    base = mapping.address()
    for entry in mapping.manifest.tensors:
        view = mapping.numpy()[entry.name]
        assert view.ctypes.data == base + entry.offset
        assert view.base is not None and not view.flags.owndata


def test_writes_are_private_to_the_mapping(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.arange(4, dtype=np.float32)})
    view = mapping.numpy()["w"]
    view[0] = 42.0
    assert mapping.numpy()["w"][0] == 42.0


def test_an_mlp_gives_bit_identical_outputs(make_model: MakeModel) -> None:
    rng = np.random.default_rng(1)
    weights = {
        "w1": rng.standard_normal((64, 32)).astype(np.float32),
        "b1": rng.standard_normal(32).astype(np.float32),
        "w2": rng.standard_normal((32, 10)).astype(np.float32),
    }
    x = rng.standard_normal((8, 64)).astype(np.float32)

    def mlp(p: dict[str, np.ndarray]) -> np.ndarray:
        return np.maximum(x @ p["w1"] + p["b1"], 0) @ p["w2"]

    stored = mlp(make_model(weights).numpy())
    assert stored.tobytes() == mlp(weights).tobytes()


def test_a_closed_mapping_refuses_new_views(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.arange(4, dtype=np.float32)})
    mapping.close()
    assert mapping.closed
    with pytest.raises(ValidationError, match="acquire it again"):
        mapping.numpy()


def test_views_outlive_close(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.arange(4, dtype=np.float32)})
    view = mapping.numpy()["w"]
    mapping.close()
    np.testing.assert_array_equal(view, np.arange(4, dtype=np.float32))
