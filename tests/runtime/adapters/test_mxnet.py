"""MXNet adapter over a real sealed-memfd mapping (runs in the MXNet environment).

A small Gluon network is exported the usual way (symbol JSON + ``.params``); the params go into
the canonical layout, and an executor bound over the mapping must give exactly the outputs of
the same model loaded the usual way (``mx.nd.load`` + ``Symbol.bind``), without copying.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trims.errors import ValidationError
from trims.runtime.mapping import HostMapping

pytestmark = pytest.mark.mxnet
mx = pytest.importorskip("mxnet")
from tests.fixtures.models import export_gluon_cnn  # noqa: E402
from trims.runtime.adapters import mxnet as mx_adapter  # noqa: E402

MakeModel = Callable[..., HostMapping]


def _data_ptr(nd: Any) -> int:
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    return int(ptr.value or 0)


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Any, Path]:
    return export_gluon_cnn(tmp_path)


def test_ndarrays_are_the_mapping(make_model: MakeModel) -> None:
    arrays = {"arg:w": np.arange(12, dtype=np.float32).reshape(3, 4), "aux:n": np.ones(5, np.int64)}
    mapping = make_model(arrays, framework="mxnet")
    nds = mx_adapter.ndarrays(mapping)
    base = mapping.address()
    for entry in mapping.manifest.tensors:
        assert _data_ptr(nds[entry.name]) == base + entry.offset
        np.testing.assert_array_equal(nds[entry.name].asnumpy(), arrays[entry.name])


def test_ndarrays_keep_the_mapping_alive(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.arange(6, dtype=np.float32)}, framework="mxnet")
    nd = mx_adapter.ndarrays(mapping)["w"]
    mapping.close()
    del mapping
    gc.collect()
    assert nd.asnumpy().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_executor_outputs_are_bit_identical_to_normal_loading(
    make_model: MakeModel, exported: tuple[Any, Path]
) -> None:
    symbol, params_file = exported
    loaded = mx.nd.load(str(params_file))
    mapping = make_model({k: v.asnumpy() for k, v in loaded.items()}, framework="mxnet")
    x = mx.nd.random.uniform(-1, 1, (2, 3, 8, 8))

    shared = mx_adapter.bind(symbol, mapping, {"data": x.shape})
    args, aux = mx_adapter.split_params(loaded)
    args["data"] = mx.nd.zeros(x.shape)
    normal = symbol.bind(mx.cpu(), args, grad_req="null", aux_states=aux)
    outputs = []
    for exe in (shared, normal):
        x.copyto(exe.arg_dict["data"])
        outputs.append(exe.forward(is_train=False)[0].asnumpy())
    assert outputs[0].tobytes() == outputs[1].tobytes()

    base, end = mapping.address(), mapping.address() + mapping.manifest.total_bytes
    for name, nd in [*shared.arg_dict.items(), *shared.aux_dict.items()]:
        if name != "data":
            assert base <= _data_ptr(nd) < end, f"{name} was copied out of the mapping"


def test_bind_names_missing_weights(make_model: MakeModel, exported: tuple[Any, Path]) -> None:
    symbol, params_file = exported
    loaded = {k: v.asnumpy() for k, v in mx.nd.load(str(params_file)).items()}
    loaded.pop(next(k for k in loaded if k.startswith("aux:")))
    mapping = make_model(loaded, framework="mxnet")
    with pytest.raises(ValidationError, match="does not have"):
        mx_adapter.bind(symbol, mapping, {"data": (1, 3, 8, 8)})


def test_bfloat16_is_refused(make_model: MakeModel) -> None:
    mapping = make_model({"w": np.zeros(4, np.uint16)}, dtypes={"w": "bfloat16"})
    with pytest.raises(ValidationError, match="bfloat16"):
        mx_adapter.ndarrays(mapping)
