"""Bad input gives a clear error naming the model and the node."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from tests.evaluation import graphs
from trims.errors import CorruptModel, NotFound, ValidationError
from trims.evaluation import ir, zoo


def test_corrupt_onnx_file_names_the_model(tmp_path: Path) -> None:
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07garbage that is not a protobuf \xff\xff\xff")
    with pytest.raises(CorruptModel, match="broken"):
        ir.load_ir(str(path))


def test_missing_file_says_what_is_accepted() -> None:
    with pytest.raises(CorruptModel, match="neither a zoo model"):
        ir.load_ir("/nonexistent/model.onnx")


def test_unknown_zoo_name() -> None:
    with pytest.raises(NotFound, match="choose from"):
        zoo.materialize("resnet51")


def test_unsupported_op_names_model_and_node(tmp_path: Path) -> None:
    path = tmp_path / "oddity.onnx"
    onnx.save(graphs.with_op("Hardmax"), str(path))
    with pytest.raises(ValidationError, match=r"'oddity'.*'odd_node'.*Hardmax"):
        ir.load_ir(str(path))


def test_missing_shapes_name_model_and_node(tmp_path: Path) -> None:
    path = tmp_path / "shapeless.onnx"
    onnx.save(graphs.symbolic(), str(path))
    with pytest.raises(ValidationError, match=r"'shapeless'.*'relu_sym'.*static shape"):
        ir.load_ir(str(path))


def test_invalid_graph_fails_shape_inference_with_model_name(tmp_path: Path) -> None:
    model = graphs.conv_gemm()
    model.graph.initializer[0].dims[:] = [4, 5, 3, 3]  # conv weight no longer matches 3 channels
    path = tmp_path / "mismatch.onnx"
    onnx.save(model, str(path))
    with pytest.raises((ValidationError, CorruptModel), match="mismatch"):
        ir.load_ir(str(path))
