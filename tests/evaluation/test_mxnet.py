"""The MXNet backend from the main environment: specs run in the MXNet virtualenv.

Skips when no MXNet environment is found (``$TRIMS_MXNET_VENV`` or /tmp/trims-mxnet-venv).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.evaluation import graphs
from trims.errors import Unavailable
from trims.evaluation import graph, ir, mxnet_backend, ort_backend
from trims.evaluation.db import ResultsDB
from trims.evaluation.generator import Bencher, layer_benchmarks
from trims.evaluation.measure import MeasureSettings

FAST = MeasureSettings(warmup=1, min_reps=3, max_reps=5, max_time_s=0.2)


@pytest.fixture(scope="module")
def mx_python() -> str:
    python = mxnet_backend.find_python()
    try:
        mxnet_backend.framework_version(python)
    except Unavailable as e:
        pytest.skip(f"no MXNet environment: {e.message}")
    return python


@pytest.mark.parametrize(
    "make", [graphs.conv_gemm, graphs.residual, graphs.asymmetric_pools], ids=lambda f: f.__name__
)
def test_outputs_match_onnx_runtime(mx_python: str, make: object) -> None:
    assert callable(make)
    model: onnx.ModelProto = graph.prepare(make(), "hand")
    feeds = ort_backend.random_inputs(model, seed=5)
    spec = mxnet_backend.spec(model, "hand", with_values=True)
    for tensor in spec["inputs"]:
        tensor["data"] = feeds[tensor["name"]].reshape(-1).tolist()
    (out,) = mxnet_backend.run_specs(mx_python, [spec], FAST, outputs_only=True)
    want = ort_backend.run_outputs(model, feeds, "hand")[0]
    got = np.asarray(out[model.graph.output[0].name], dtype=np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bencher_measures_layers_in_one_process(mx_python: str, tmp_path: Path) -> None:
    model = ir.build(graph.prepare(graphs.residual(2), "res"), "res")
    benches = layer_benchmarks([model])
    db = ResultsDB(str(tmp_path / "mx.sqlite"))
    try:
        bencher = Bencher(db, "mxnet", "threads=1", 1, FAST, mxnet_python=mx_python)
        first = bencher.run_many(benches)
        assert all(r.fresh and r.measurement.reps >= 3 for r in first)
        assert not any(r.fresh for r in bencher.run_many(benches))
        assert db.count() == len(benches)
    finally:
        db.close()
