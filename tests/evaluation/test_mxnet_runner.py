"""The MXNet runner on hand-written specs (runs in the MXNet environment, `-m mxnet`)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.mxnet


def _spec(
    nodes: list[dict[str, object]],
    params: list[dict[str, object]],
    x: np.ndarray,
    outputs: list[str],
) -> dict[str, object]:
    return {
        "name": "hand",
        "params": params,
        "inputs": [{"name": "x", "shape": list(x.shape), "data": x.reshape(-1).tolist()}],
        "nodes": nodes,
        "outputs": outputs,
    }


def test_conv_relu_and_gemm_match_numpy() -> None:
    pytest.importorskip("mxnet")
    from trims.evaluation import mxnet_runner

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 3, 4, 4)).astype(np.float32)
    w = rng.standard_normal((5, 3, 1, 1)).astype(np.float32)
    fw = rng.standard_normal((2, 80)).astype(np.float32)
    spec = _spec(
        [
            {
                "name": "c",
                "op": "Conv",
                "inputs": ["x", "w"],
                "outputs": ["c"],
                "attrs": {"kernel_shape": [1, 1]},
            },
            {"name": "r", "op": "Relu", "inputs": ["c"], "outputs": ["r"], "attrs": {}},
            {"name": "f", "op": "Flatten", "inputs": ["r"], "outputs": ["f"], "attrs": {}},
            {
                "name": "g",
                "op": "Gemm",
                "inputs": ["f", "fw"],
                "outputs": ["y"],
                "attrs": {"transB": 1},
            },
        ],
        [
            {
                "name": "w",
                "shape": [5, 3, 1, 1],
                "dtype": "float32",
                "values": w.reshape(-1).tolist(),
            },
            {"name": "fw", "shape": [2, 80], "dtype": "float32", "values": fw.reshape(-1).tolist()},
        ],
        x,
        ["y"],
    )
    values = mxnet_runner.build(spec)()
    conv = np.maximum(np.einsum("nchw,oc->nohw", x, w[:, :, 0, 0]), 0)
    want = conv.reshape(1, -1) @ fw.T
    np.testing.assert_allclose(values["y"].asnumpy(), want, rtol=1e-4, atol=1e-5)


def test_asymmetric_average_pool_excludes_padding() -> None:
    pytest.importorskip("mxnet")
    from trims.evaluation import mxnet_runner

    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    spec = _spec(
        [
            {
                "name": "p",
                "op": "AveragePool",
                "inputs": ["x"],
                "outputs": ["y"],
                "attrs": {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1], "strides": [2, 2]},
            }
        ],
        [],
        x,
        ["y"],
    )
    got = mxnet_runner.build(spec)()["y"].asnumpy()
    # windows at rows/cols {0,1} and {2,3}, plus a padded row/col that must not count
    want = np.array([[[[2.5, 4.5], [10.5, 12.5]]]], dtype=np.float32)
    np.testing.assert_allclose(got[..., :2, :2], want)


def test_measure_runs_a_spec() -> None:
    pytest.importorskip("mxnet")
    from trims.evaluation import mxnet_runner
    from trims.evaluation.measure import MeasureSettings, measure

    x = np.ones((1, 2, 3, 3), dtype=np.float32)
    spec = _spec(
        [{"name": "r", "op": "Relu", "inputs": ["x"], "outputs": ["y"], "attrs": {}}], [], x, ["y"]
    )
    result = measure(mxnet_runner.build(spec), MeasureSettings(warmup=1, min_reps=3, max_reps=3))
    assert result.reps == 3
