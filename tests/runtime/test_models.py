"""open_model: the store when reachable, the file otherwise; same outputs either way."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.store import DaemonProcess
from trims.errors import NotFound, Unavailable
from trims.runtime.client import StoreClient
from trims.runtime.direct import DirectModel
from trims.runtime.models import StoreModel, open_model


@pytest.fixture
def admin(store_daemon: DaemonProcess) -> Iterator[StoreClient]:
    with StoreClient(store_daemon.socket) as c:
        yield c


def _both(
    name: str, source: Path, daemon: DaemonProcess, tmp_path: Path
) -> tuple[StoreModel, DirectModel]:
    stored = open_model(name, source=source, socket_path=daemon.socket)
    direct = open_model(name, source=source, socket_path=tmp_path / "no-daemon.sock")
    assert isinstance(stored, StoreModel) and stored.via == "store"
    assert isinstance(direct, DirectModel) and direct.via == "direct"
    return stored, direct


def test_torch_module_is_identical_from_store_and_file(
    admin: StoreClient, store_daemon: DaemonProcess, tmp_path: Path, caplog: Any
) -> None:
    torch = pytest.importorskip("torch")
    from tests.fixtures.torch_models import SmallCNN, trained_cnn

    reference = trained_cnn()
    source = tmp_path / "cnn.pt"
    torch.save(reference.state_dict(), source)
    admin.add("cnn", source)
    caplog.set_level(logging.INFO, logger="trims.runtime.models")
    stored, direct = _both("cnn", source, store_daemon, tmp_path)
    assert "mapped from the store" in caplog.text
    assert "loading" in caplog.text and "directly" in caplog.text
    x = torch.randn(3, 3, 8, 8)
    with stored, direct, torch.inference_mode():
        expected = reference(x)
        for model in (stored, direct):
            out = model.torch_module(SmallCNN)(x)
            assert torch.equal(out, expected), f"{model.via} output differs"


def test_onnx_session_is_identical_from_store_and_file(
    admin: StoreClient, store_daemon: DaemonProcess, tmp_path: Path
) -> None:
    pytest.importorskip("onnxruntime")
    import onnx

    from tests.fixtures.models import small_cnn

    source = tmp_path / "cnn.onnx"
    onnx.save(small_cnn(), source)
    admin.add("cnn-onnx", source)
    stored, direct = _both("cnn-onnx", source, store_daemon, tmp_path)
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    with stored, direct:
        a = stored.onnx_session().run(None, {"x": x})[0]
        b = direct.onnx_session().run(None, {"x": x})[0]
    assert a.tobytes() == b.tobytes()


def test_a_real_onnx_topology_is_identical_from_store_and_file(
    admin: StoreClient, store_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """ShuffleNet (49 BatchNorms that ORT fuses into convolutions, reading the weights)."""
    pytest.importorskip("onnxruntime")
    import onnx

    from trims.evaluation.zoo import materialize, reference_input

    model = materialize("shufflenet")
    source = tmp_path / "shufflenet.onnx"
    onnx.save(model, source)
    admin.add("shufflenet", source)
    stored, direct = _both("shufflenet", source, store_daemon, tmp_path)
    feeds = reference_input(model)
    with stored, direct:
        a = stored.onnx_session().run(None, feeds)[0]
        b = direct.onnx_session().run(None, feeds)[0]
    assert a.tobytes() == b.tobytes()


def test_numpy_is_identical_from_store_and_file(
    admin: StoreClient, store_daemon: DaemonProcess, tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    weights = {"w": np.random.default_rng(4).standard_normal((16, 8)).astype(np.float32)}
    source = tmp_path / "w.safetensors"
    save_file(weights, str(source))
    admin.add("np", source)
    stored, direct = _both("np", source, store_daemon, tmp_path)
    with stored, direct:
        assert stored.numpy()["w"].tobytes() == direct.numpy()["w"].tobytes()
        assert stored.numpy()["w"].tobytes() == weights["w"].tobytes()


def test_a_model_the_store_lacks_loads_from_its_source(
    store_daemon: DaemonProcess, tmp_path: Path, caplog: Any
) -> None:
    from safetensors.numpy import save_file

    source = tmp_path / "w.safetensors"
    save_file({"w": np.ones(3, np.float32)}, str(source))
    with caplog.at_level(logging.WARNING, logger="trims.runtime.models"):
        model = open_model("absent", source=source, socket_path=store_daemon.socket)
    assert model.via == "direct" and "does not have it" in caplog.text
    model.close()
    with pytest.raises(NotFound):
        open_model("absent", socket_path=store_daemon.socket)


def test_without_store_or_source_the_error_says_so(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="trims daemon"):
        open_model("cnn", socket_path=tmp_path / "none.sock")
    with pytest.raises(NotFound, match="does not exist"):
        open_model("cnn", source=tmp_path / "missing.pt", socket_path=tmp_path / "none.sock")


@pytest.mark.mxnet
def test_mxnet_executor_is_identical_from_store_and_file(
    admin: StoreClient,
    store_daemon: DaemonProcess,
    tmp_path: Path,
) -> None:
    mx = pytest.importorskip("mxnet")
    from tests.fixtures.models import export_gluon_cnn

    symbol, params = export_gluon_cnn(tmp_path)
    admin.add("mxcnn", params)
    stored, direct = _both("mxcnn", params, store_daemon, tmp_path)
    x = mx.nd.random.uniform(-1, 1, (2, 3, 8, 8))
    outputs = []
    with stored, direct:
        for model in (stored, direct):
            exe = model.mxnet_executor(symbol, {"data": x.shape})
            x.copyto(exe.arg_dict["data"])
            outputs.append(exe.forward(is_train=False)[0].asnumpy())
    assert outputs[0].tobytes() == outputs[1].tobytes()


def test_direct_model_with_an_unknown_suffix_says_how_to_name_it(tmp_path: Path) -> None:
    from trims.errors import ValidationError

    source = tmp_path / "weights.h5"
    source.write_bytes(b"\0" * 16)
    with pytest.raises(ValidationError, match=r"weights\.h5: name it \*\.safetensors"):
        DirectModel("w", source)
