"""PyTorch adapter over a real sealed-memfd mapping: zero-copy tensors and module loading."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.runtime.mapping import HostMapping

torch = pytest.importorskip("torch")
from tests.fixtures.torch_models import SmallCNN, trained_cnn  # noqa: E402
from trims.runtime.adapters import torch as torch_adapter  # noqa: E402

MakeModel = Callable[..., HostMapping]


def _state_arrays(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    arrays, dtypes = {}, {}
    for name, t in module.state_dict().items():
        if t.dtype == torch.bfloat16:
            arrays[name] = t.view(torch.uint16).numpy()
            dtypes[name] = "bfloat16"
        else:
            arrays[name] = t.numpy()
    return arrays, dtypes


def test_tensors_view_the_mapping_with_real_dtypes(make_model: MakeModel) -> None:
    src = {
        "w": torch.randn(4, 5),
        "half": torch.randn(3).to(torch.bfloat16),
        "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "empty": torch.zeros(0, 2),
    }
    arrays = {
        k: (v.view(torch.uint16) if v.dtype == torch.bfloat16 else v).numpy()
        for k, v in src.items()
    }
    mapping = make_model(arrays, dtypes={"half": "bfloat16"})
    tensors = torch_adapter.tensors(mapping)
    base = mapping.address()
    for entry in mapping.manifest.tensors:
        t = tensors[entry.name]
        assert t.dtype == src[entry.name].dtype
        assert torch.equal(t, src[entry.name])
        if entry.nbytes:
            assert t.data_ptr() == base + entry.offset


def test_load_module_assigns_the_mapped_weights(make_model: MakeModel) -> None:
    reference = trained_cnn()
    arrays, dtypes = _state_arrays(reference)
    mapping = make_model(arrays, dtypes=dtypes, framework="torch")
    module = torch_adapter.load_module(SmallCNN, mapping)
    base, end = mapping.address(), mapping.address() + mapping.manifest.total_bytes
    for name, p in [*module.named_parameters(), *module.named_buffers()]:
        assert not p.is_meta, name
        assert base <= p.data_ptr() < end, f"{name} was copied out of the mapping"
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        assert torch.equal(module(x), reference(x)), "outputs differ from the normally loaded model"


def test_load_module_names_missing_weights(make_model: MakeModel) -> None:
    arrays, _ = _state_arrays(trained_cnn())
    del arrays["fc.bias"]
    mapping = make_model(arrays, framework="torch")
    with pytest.raises(ValidationError, match=r"fc\.bias"):
        torch_adapter.load_module(SmallCNN, mapping)


def test_in_place_writes_stay_in_the_mapping(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.zeros(8, np.float32)})
    t = torch_adapter.tensors(mapping)["w"]
    t.add_(1.0)
    assert mapping.numpy()["w"].tolist() == [1.0] * 8
