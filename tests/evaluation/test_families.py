"""PyTorch family models: torchvision's architectures, exported, analysed and deduplicated."""

from __future__ import annotations

import numpy as np
import pytest

from trims.errors import CorruptModel, NotFound
from trims.evaluation import bricks, families, graph, ir
from trims.evaluation.analyses import expand_models as _models

# parameter counts torchvision publishes for its ImageNet classifiers
TORCHVISION_PARAMS = {
    "torch:resnet18": 11_689_512,
    "torch:resnet34": 21_797_672,
    "torch:resnet50": 25_557_032,
    "torch:resnet101": 44_549_160,
    "torch:resnet152": 60_192_808,
    "torch:vgg11": 132_863_336,
    "torch:vgg13": 133_047_848,
    "torch:vgg16": 138_357_544,
    "torch:vgg19": 143_667_240,
}


@pytest.mark.parametrize("name", families.FAMILIES)
def test_architectures_have_torchvisions_parameter_counts(name: str) -> None:
    module = families.build(name, device="meta")
    assert sum(p.numel() for p in module.parameters()) == TORCHVISION_PARAMS[name]


@pytest.mark.parametrize(("name", "gmacs"), [("torch:resnet18", 1.81), ("torch:resnet50", 4.09)])
def test_ir_multiply_adds_match_torchvisions_totals(name: str, gmacs: float) -> None:
    model = ir.load_ir(name)
    assert model.name == name
    assert abs(model.flops / 1e9 - gmacs) / gmacs < 0.02
    # batch norm is folded into the convolutions and constant Identity nodes into initializers
    assert not {layer.op_type for layer in model.layers} & {"BatchNormalization", "Identity"}
    assert model.layers[-1].output_shapes == ((1, 1000),)


def test_exported_model_computes_what_pytorch_computes() -> None:
    import onnxruntime as ort
    import torch

    module = families.build("torch:resnet18")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    with torch.no_grad():
        expected = module(torch.from_numpy(x)).numpy()
    session = ort.InferenceSession(
        families.export("torch:resnet18").SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(None, {"data": x})
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-4)


def test_deeper_resnets_repeat_the_bricks_of_shallower_ones() -> None:
    r50, r101 = ir.load_ir("torch:resnet50"), ir.load_ir("torch:resnet101")
    for g in (1, 5):
        b50, b101 = bricks.decompose(r50, g), bricks.decompose(r101, g)
        assert len(b101) > len(b50)
    # at G=1 every brick is one residual block (or a stem / head layer): 101 adds none
    sigs50 = {b.signature for b in bricks.decompose(r50, 1)}
    sigs101 = {b.signature for b in bricks.decompose(r101, 1)}
    assert sigs101 == sigs50
    per_model = {"50": bricks.decompose(r50, 1), "101": bricks.decompose(r101, 1)}
    unique = bricks.unique_bricks(per_model)
    assert len(unique) == len(sigs50)


def test_batch_is_a_parameter() -> None:
    model = ir.load_ir("torch:resnet18", batch=4)
    assert model.layers[0].input_shapes[0] == (4, 3, 224, 224)
    assert model.layers[-1].output_shapes == ((4, 1000),)


def test_unknown_family_model_names_the_choices() -> None:
    with pytest.raises(NotFound, match=r"torch:resnet19.*torch:resnet18"):
        graph.load("torch:resnet19")
    with pytest.raises(CorruptModel, match="torch:resnet50"):
        graph.load("resnet51")


def test_model_sets_expand_in_order_without_repeats() -> None:
    assert _models("families")[:2] == ("torch:resnet18", "torch:resnet34")
    assert len(_models("zoo,families")) == 18
    assert _models("squeezenet, torch:vgg11,zoo")[:3] == ("squeezenet", "torch:vgg11", "alexnet")
    assert _models("zoo,squeezenet").count("squeezenet") == 1
