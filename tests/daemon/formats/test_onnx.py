"""ONNX -> canonical layout: initializers bit-exact, the stripped graph runs in ONNX Runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.daemon.formats.layout_check import check_layout, numpy_raw, read_raw
from trims.daemon.formats import convert, detect_format
from trims.errors import CorruptModel, ValidationError
from trims.layout import Manifest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

BACKEND_DATA = Path(onnx.__file__).parent / "backend" / "test" / "data"


def _mlp(rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray]]:
    weights = {
        "w1": rng.standard_normal((8, 16)).astype(np.float32),
        "b1": rng.standard_normal(16).astype(np.float32),
        "w2": rng.standard_normal((16, 4)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 4])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, weights


def _graph(path: Path, manifest: Manifest) -> Any:
    entry = manifest.tensor(manifest.metadata["onnx_graph"])
    data = path.read_bytes()[entry.offset : entry.offset + entry.nbytes]
    return onnx.load_from_string(data)


def _session_from_layout(path: Path, manifest: Manifest) -> Any:
    """What the ORT adapter does: the stored graph + initializers supplied from the buffer."""
    ort = pytest.importorskip("onnxruntime")
    buf = np.fromfile(path, dtype=np.uint8)
    names, values = [], []
    for t in manifest.tensors:
        if t.name == manifest.metadata["onnx_graph"]:
            continue
        array = buf[t.offset : t.offset + t.nbytes].view(t.dtype).reshape(t.shape)
        names.append(t.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(array))
    options = ort.SessionOptions()
    options.add_external_initializers(names, values)
    entry = manifest.tensor(manifest.metadata["onnx_graph"])
    graph = buf[entry.offset : entry.offset + entry.nbytes].tobytes()
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def test_every_dtype_and_storage_is_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    bf16_bits = rng.integers(0, 1 << 16, size=(3, 5), dtype=np.uint16)
    arrays = {
        "f32": rng.standard_normal((4, 5)).astype(np.float32),
        "f16": rng.standard_normal(7).astype(np.float16),
        "f64": rng.standard_normal((2, 2)),
        "i64": rng.integers(-(2**62), 2**62, size=(3,), dtype=np.int64),
        "i32": rng.integers(-100, 100, size=(6,), dtype=np.int32),
        "u8": rng.integers(0, 255, size=(9,), dtype=np.uint8),
        "mask": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    initializers = [numpy_helper.from_array(v, k) for k, v in arrays.items()]
    initializers.append(
        helper.make_tensor("bf16", TensorProto.BFLOAT16, [3, 5], bf16_bits.tobytes(), raw=True)
    )
    typed = rng.standard_normal(6).astype(np.float32)
    initializers.append(helper.make_tensor("typed_f32", TensorProto.FLOAT, [2, 3], typed))
    initializers.append(helper.make_tensor("typed_i64", TensorProto.INT64, [2], [-5, 1 << 40]))
    graph = helper.make_graph([], "g", [], [], initializers)
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), source)

    manifest = convert(source, tmp_path / "out", name="m", version="1")
    check_layout(tmp_path / "out", manifest)
    assert manifest.framework == "onnx"
    assert manifest.metadata["onnx_graph"] == "__onnx_graph__"
    got = read_raw(tmp_path / "out", manifest)
    expected = {k: numpy_raw(v) for k, v in arrays.items()}
    expected["bf16"] = ("bfloat16", (3, 5), bf16_bits.tobytes())
    expected["typed_f32"] = numpy_raw(typed.reshape(2, 3))
    expected["typed_i64"] = numpy_raw(np.array([-5, 1 << 40], dtype=np.int64))
    assert {k: v for k, v in got.items() if k != "__onnx_graph__"} == expected

    stored = _graph(tmp_path / "out", manifest)
    for init in stored.graph.initializer:
        entry = manifest.tensor(init.name)
        assert init.data_location == TensorProto.EXTERNAL
        assert not init.raw_data and not init.float_data and not init.int64_data
        assert {e.key: e.value for e in init.external_data} == {
            "location": "__trims__",
            "offset": str(entry.offset),
            "length": str(entry.nbytes),
        }


@pytest.mark.parametrize("external", [False, True], ids=["embedded", "external"])
def test_outputs_are_bit_identical_in_onnxruntime(tmp_path: Path, external: bool) -> None:
    ort = pytest.importorskip("onnxruntime")
    model, weights = _mlp(np.random.default_rng(5))
    source = tmp_path / "model" / "mlp.onnx"
    source.parent.mkdir()
    onnx.save(
        model,
        source,
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location="mlp.weights",
        size_threshold=0,
    )
    assert (source.parent / "mlp.weights").exists() == external
    manifest = convert(source, tmp_path / "out", name="mlp", version="1")
    check_layout(tmp_path / "out", manifest)
    got = read_raw(tmp_path / "out", manifest)
    assert {k: got[k] for k in weights} == {k: numpy_raw(v) for k, v in weights.items()}

    x = np.random.default_rng(6).standard_normal((3, 8)).astype(np.float32)
    reference = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    session = _session_from_layout(tmp_path / "out", manifest)
    expected = reference.run(None, {"x": x})[0]
    assert np.array_equal(session.run(None, {"x": x})[0], expected)


def test_external_data_of_constants_and_subgraphs_is_embedded(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(8)
    const = rng.standard_normal(4).astype(np.float32)
    branch_init = rng.standard_normal(4).astype(np.float32)

    def branch(name: str, op: str) -> Any:
        return helper.make_graph(
            [helper.make_node(op, ["h", f"{name}_k"], [f"{name}_out"])],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [4])],
            [numpy_helper.from_array(branch_init, f"{name}_k")],
        )

    nodes = [
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(const)),
        helper.make_node("Add", ["x", "c"], ["h"]),
        helper.make_node(
            "If",
            ["flag"],
            ["y"],
            then_branch=branch("then", "Mul"),
            else_branch=branch("else", "Sub"),
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    source = tmp_path / "model" / "m.onnx"
    source.parent.mkdir()
    onnx.save(
        model,
        source,
        save_as_external_data=True,
        location="m.weights",
        size_threshold=0,
        convert_attribute=True,
    )
    stored_outside = onnx.load(str(source), load_external_data=False)
    branch0 = stored_outside.graph.node[2].attribute[0].g
    assert stored_outside.graph.node[0].attribute[0].t.data_location == TensorProto.EXTERNAL
    assert branch0.initializer[0].data_location == TensorProto.EXTERNAL

    manifest = convert(source, tmp_path / "out", name="m", version="1")
    assert manifest.names == ["__onnx_graph__"]
    stored = _graph(tmp_path / "out", manifest)
    assert stored.graph.node[0].attribute[0].t.data_location == TensorProto.DEFAULT
    assert stored.graph.node[2].attribute[0].g.initializer[0].data_location == TensorProto.DEFAULT
    reference = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    session = _session_from_layout(tmp_path / "out", manifest)
    x = rng.standard_normal(4).astype(np.float32)
    for flag in (True, False):
        feed = {"x": x, "flag": np.array(flag)}
        assert np.array_equal(session.run(None, feed)[0], reference.run(None, feed)[0])


def test_real_models_from_the_onnx_wheel(tmp_path: Path) -> None:
    resnet = BACKEND_DATA / "light" / "light_resnet50.onnx"
    conv = BACKEND_DATA / "pytorch-converted" / "test_Conv2d_dilated"
    if not resnet.is_file() or not conv.is_dir():
        pytest.skip("this onnx wheel does not ship the backend test models")
    manifest = convert(resnet, tmp_path / "resnet", name="resnet", version="1")
    check_layout(tmp_path / "resnet", manifest)
    source = onnx.load(str(resnet))
    assert len(manifest.tensors) == len(source.graph.initializer) + 1
    got = read_raw(tmp_path / "resnet", manifest)
    for init in source.graph.initializer:
        dtype = got[init.name][0]
        assert got[init.name] == numpy_raw(numpy_helper.to_array(init), dtype)

    pytest.importorskip("onnxruntime")
    manifest = convert(conv / "model.onnx", tmp_path / "conv", name="conv", version="1")
    session = _session_from_layout(tmp_path / "conv", manifest)
    x = numpy_helper.to_array(onnx.load_tensor(str(conv / "test_data_set_0" / "input_0.pb")))
    y = numpy_helper.to_array(onnx.load_tensor(str(conv / "test_data_set_0" / "output_0.pb")))
    np.testing.assert_allclose(
        session.run(None, {session.get_inputs()[0].name: x})[0], y, atol=1e-5
    )


def _with_external(tmp_path: Path, location: str, offset: int = 0, length: int = 64) -> Path:
    tensor = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[16])
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    source = tmp_path / "model" / "m.onnx"
    source.parent.mkdir(exist_ok=True)
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], [tensor])), source)
    return source


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd", "sub/../../x.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path: Path, location: str) -> None:
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    source = _with_external(tmp_path, location)
    with pytest.raises(ValidationError, match="outside the model's folder"):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("size", "offset", "length", "words"),
    [
        (None, 0, 64, "missing"),
        (32, 0, 64, "truncated"),
        (64, 16, 64, "truncated"),
        (64, 0, 8, "needs"),
    ],
)
def test_bad_external_data_is_corrupt(
    tmp_path: Path, size: int | None, offset: int, length: int, words: str
) -> None:
    source = _with_external(tmp_path, "w.bin", offset, length)
    if size is not None:
        (source.parent / "w.bin").write_bytes(b"\1" * size)
    with pytest.raises(CorruptModel, match=words):
        convert(source, tmp_path / "out", name="m", version="1")
    assert not (tmp_path / "out").exists()


def test_truncated_and_garbage_models_are_corrupt(tmp_path: Path) -> None:
    model, _ = _mlp(np.random.default_rng(1))
    data = model.SerializeToString()
    for i, content in enumerate([data[: len(data) // 2], b"\xff" * 100]):
        source = tmp_path / f"bad{i}.onnx"
        source.write_bytes(content)
        assert detect_format(source) == "onnx"
        with pytest.raises(CorruptModel, match=str(source)):
            convert(source, tmp_path / "out", name="m", version="1")
        assert not (tmp_path / "out").exists()


def test_string_initializers_are_unsupported(tmp_path: Path) -> None:
    tensor = helper.make_tensor("labels", TensorProto.STRING, [2], [b"cat", b"dog"])
    source = tmp_path / "m.onnx"
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [], [tensor])), source)
    with pytest.raises(ValidationError, match="STRING"):
        convert(source, tmp_path / "out", name="m", version="1")


def test_an_onnx_file_over_protobufs_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from trims.daemon.formats.onnx_fmt import MAX_MODEL_FILE
    from trims.errors import PayloadTooLarge

    source = tmp_path / "huge.onnx"
    with open(source, "wb") as f:  # sparse: nothing is written, the size is what counts
        f.truncate(MAX_MODEL_FILE + 1)
    with pytest.raises(PayloadTooLarge, match="external data") as info:
        convert(source, tmp_path / "out", name="m", version="1", fmt="onnx")
    assert info.value.details == {"size": MAX_MODEL_FILE + 1, "limit": MAX_MODEL_FILE}
    assert not (tmp_path / "out").exists()
