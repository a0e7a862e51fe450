"""ONNX Runtime adapter over a real sealed-memfd mapping: identical outputs, no weight copy.

The layout is built here the way the daemon's ONNX converter writes it: every initializer a
tensor, and the graph (initializers externalised to ``__trims__`` at their offsets) stored as
the uint8 tensor ``__onnx_graph__``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.runtime.mapping import HostMapping

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from tests.fixtures.models import anonymous_kib, small_cnn, store_layout  # noqa: E402
from trims.runtime.adapters import onnxruntime as ort_adapter  # noqa: E402

MakeModel = Callable[..., HostMapping]


def test_outputs_are_bit_identical_to_a_normal_session(make_model: MakeModel) -> None:
    model = small_cnn()
    mapping = store_layout(model, make_model)
    x = np.random.default_rng(1).standard_normal((4, 3, 16, 16)).astype(np.float32)
    normal = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    shared = ort_adapter.session(mapping)
    assert shared.run(None, {"x": x})[0].tobytes() == normal.run(None, {"x": x})[0].tobytes()


def test_without_prepacking_the_session_copies_no_weights(make_model: MakeModel) -> None:
    # fc.w + head.w: 26 * 1 Mi floats = 104 MiB, each tensor above glibc's mmap threshold so
    # a copy would show as new anonymous memory rather than hide in reused heap.
    model = small_cnn(hidden=1 << 20)
    mapping = store_layout(model, make_model)
    weights_kib = mapping.manifest.total_bytes // 1024
    x = np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)
    before = anonymous_kib()
    shared = ort_adapter.session(mapping, prepack=False)
    grown = anonymous_kib() - before
    assert grown < weights_kib // 4, (
        f"session creation allocated {grown} KiB for {weights_kib} KiB of weights"
    )
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_prepacking", "1")
    normal = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    assert shared.run(None, {"x": x})[0].tobytes() == normal.run(None, {"x": x})[0].tobytes()


def test_initializers_are_ort_values_over_the_mapping(make_model: MakeModel) -> None:
    mapping = store_layout(small_cnn(), make_model)
    values = ort_adapter.ort_values(mapping)
    assert set(values) == {"conv.w", "conv.b", "fc.w", "fc.b", "head.w"}
    base = mapping.address()
    for name, value in values.items():
        assert value.data_ptr() == base + mapping.manifest.tensor(name).offset


def test_a_model_without_a_graph_is_refused(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.zeros(4, np.float32)}, framework="safetensors")
    with pytest.raises(ValidationError, match="no ONNX graph"):
        ort_adapter.session(mapping)
