"""IR shapes, parameter bytes and FLOPs against hand-computed values and known totals."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from tests.evaluation import graphs
from trims.evaluation import graph, ir


def _ir(model: onnx.ModelProto, name: str = "hand", batch: int = 1) -> ir.ModelIR:
    return ir.build(graph.prepare(model, name, batch), name, batch)


def test_conv_gemm_shapes_flops_and_bytes() -> None:
    m = _ir(graphs.conv_gemm())
    by_name = {layer.name: layer for layer in m.layers}
    conv = by_name["conv"]
    assert conv.input_shapes == ((1, 3, 8, 8),)
    assert conv.output_shapes == ((1, 4, 8, 8),)
    assert conv.flops == 4 * 8 * 8 * (3 * 3 * 3)
    assert conv.param_bytes == (4 * 3 * 3 * 3 + 4) * 4
    assert conv.mem_bytes == (3 * 8 * 8 + 4 * 3 * 3 * 3 + 4 + 4 * 8 * 8) * 4
    assert by_name["relu"].flops == 4 * 8 * 8
    assert by_name["pool"].output_shapes == ((1, 4, 4, 4),)
    assert by_name["pool"].flops == 4 * 4 * 4 * 4
    assert by_name["flatten"].flops == 0
    fc = by_name["fc"]
    assert fc.output_shapes == ((1, 10),)
    assert fc.flops == 10 * 64
    assert m.preds == [[], [0], [1], [2], [3]]
    assert m.succs == [[1], [2], [3], [4], []]


def test_batch_scales_shapes_and_flops() -> None:
    one = _ir(graphs.conv_gemm())
    four = _ir(graphs.conv_gemm(), batch=4)
    assert four.layers[0].input_shapes == ((4, 3, 8, 8),)
    assert four.layers[-1].output_shapes == ((4, 10),)
    assert four.flops == 4 * one.flops
    assert four.param_bytes == one.param_bytes


def test_resnet50_is_about_4_1_gmacs() -> None:
    m = ir.load_ir("resnet50")
    ops = m.by_op()
    macs = ops["Conv"] + ops["Gemm"]
    assert 4.0e9 < macs < 4.2e9
    assert len([layer for layer in m.layers if layer.op_type == "Conv"]) == 53
    assert m.layers[0].input_shapes == ((1, 3, 224, 224),)
    assert 95 * 2**20 < m.param_bytes < 100 * 2**20


def test_squeezenet_batch_two_from_zoo() -> None:
    m = ir.load_ir("squeezenet", batch=2)
    assert m.layers[0].input_shapes[0][0] == 2
    assert m.layers[-1].output_shapes[0][0] == 2


def test_unique_layers_deduplicates_repeated_blocks() -> None:
    three = _ir(graphs.residual(blocks=3))
    five = _ir(graphs.residual(blocks=5, name="residual5"), "residual5")
    unique = ir.unique_layers([three, five])
    # stem conv, 3x3 conv (conv_a and conv_b have one configuration), relu, add, pooling
    assert len(unique) == 5
    conv = next(v for v in unique.values() if v[0][1].name == "b0_conv_a")
    assert len(conv) == 2 * (3 + 5)
    assert {model for model, _ in conv} == {"hand", "residual5"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_pytorch_export_goes_through_the_ir(tmp_path: Path) -> None:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(6)
            self.fc = torch.nn.Linear(6 * 4 * 4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn(self.conv(x)))
            h = torch.nn.functional.max_pool2d(h, 2)
            return self.fc(torch.flatten(h, 1))

    path = tmp_path / "tiny.onnx"
    torch.onnx.export(Tiny().eval(), (torch.randn(1, 3, 8, 8),), str(path), dynamo=False)
    m = ir.load_ir(str(path))
    assert m.name == "tiny"
    convs = [layer for layer in m.layers if layer.op_type == "Conv"]
    assert len(convs) == 1
    assert convs[0].output_shapes == ((1, 6, 8, 8),)
    assert convs[0].flops == 6 * 8 * 8 * 3 * 3 * 3
    assert m.layers[-1].output_shapes == ((1, 5),)
