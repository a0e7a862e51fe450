"""The zoo: nine models, weights materialized, outputs reproduced."""

from __future__ import annotations

import numpy as np

from trims.evaluation import zoo


def test_zoo_lists_the_nine_models() -> None:
    assert zoo.zoo_names() == [
        "alexnet",
        "densenet121",
        "inception_v1",
        "inception_v2",
        "resnet50",
        "shufflenet",
        "squeezenet",
        "vgg19",
        "zfnet512",
    ]


def test_squeezenet_materializes_real_size_weights() -> None:
    model = zoo.materialize("squeezenet")
    assert not [n for n in model.graph.node if n.op_type == "ConstantOfShape"]
    assert [i.name for i in model.graph.input] == ["data_0"]
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    assert weights["conv1_w_0"] == (64, 3, 3, 3)
    nbytes = sum(len(t.raw_data) for t in model.graph.initializer)
    assert 4_500_000 < nbytes < 5_200_000
    assert zoo.check("squeezenet", model).ok


def test_densenet121_reproduces_its_stored_output() -> None:
    # DenseNet-121 ends without a softmax, so its stored output (0.46095502) actually depends
    # on the weights; the other eight end in a softmax of equal logits (0.001 everywhere).
    expected = zoo.expected_output("densenet121")
    assert np.unique(expected).size == 1 and abs(float(expected.flat[0]) - 0.46095502) < 1e-6
    result = zoo.check("densenet121")
    assert result.ok, result


def test_wrong_fill_value_is_detected() -> None:
    model = zoo.materialize("densenet121")
    for init in model.graph.initializer:
        if init.name.endswith("bn_bias_0") or init.name.endswith("_b_0"):
            arr = np.frombuffer(init.raw_data, dtype=np.float32) * 2
            init.raw_data = arr.astype(np.float32).tobytes()
    assert not zoo.check("densenet121", model).ok
