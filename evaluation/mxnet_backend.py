"""MXNet backend, main-environment side: ONNX graphs -> JSON specs -> the MXNet environment.

MXNet 1.9.1 needs numpy < 1.24 and so lives in its own virtualenv (``.ci/run`` creates it at
``/tmp/trims-mxnet-venv``; ``TRIMS_MXNET_VENV`` or ``--mxnet-python`` point elsewhere). Specs
for many benchmarks go to one ``python -m trims.evaluation.mxnet_runner`` process, so MXNet is
imported once per batch, not once per layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.errors import Unavailable, UpstreamError
from trims.evaluation.measure import Measurement, MeasureSettings

if TYPE_CHECKING:
    import onnx

DEFAULT_VENV = "/tmp/trims-mxnet-venv"


def find_python(explicit: str | None = None) -> str:
    """The MXNet environment's interpreter: ``explicit``, ``$TRIMS_MXNET_PYTHON``, the python of
    ``$TRIMS_MXNET_VENV``, or the default venv's."""
    if explicit:
        return explicit
    if os.environ.get("TRIMS_MXNET_PYTHON"):
        return os.environ["TRIMS_MXNET_PYTHON"]
    venv = os.environ.get("TRIMS_MXNET_VENV", DEFAULT_VENV)
    return str(Path(venv) / "bin" / "python")


def framework_version(python: str) -> str:
    """``mxnet.__version__`` in that environment; Unavailable if MXNet does not import there."""
    try:
        done = subprocess.run(
            [python, "-c", "import mxnet; print(mxnet.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except OSError as e:
        raise Unavailable(
            f"no MXNet environment at {python}: {e}; create it as .ci/run does or pass "
            "--mxnet-python"
        ) from e
    if done.returncode != 0:
        raise Unavailable(f"MXNet does not import with {python}: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def spec(model: onnx.ModelProto, name: str, with_values: bool = False) -> dict[str, Any]:
    """The JSON form of a prepared ONNX graph that :mod:`mxnet_runner` executes.

    Float weights travel by shape only (the runner fills them with random values, which cost
    the same to compute with) unless ``with_values``, which correctness checks use.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    params: list[dict[str, Any]] = []
    for tensor in graph.initializer:
        dtype = str(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        entry: dict[str, Any] = {"name": tensor.name, "shape": list(tensor.dims), "dtype": dtype}
        if dtype == "int64" or with_values:
            entry["values"] = numpy_helper.to_array(tensor).reshape(-1).tolist()
        params.append(entry)
    init_names = {t.name for t in graph.initializer}
    inputs = [
        {"name": v.name, "shape": [max(d.dim_value, 1) for d in v.type.tensor_type.shape.dim]}
        for v in graph.input
        if v.name not in init_names
    ]
    nodes = []
    for index, node in enumerate(graph.node):
        attrs: dict[str, Any] = {}
        for attr in node.attribute:
            value = helper.get_attribute_value(attr)
            attrs[attr.name] = value.decode() if isinstance(value, bytes) else value
        nodes.append(
            {
                "name": node.name or f"{node.op_type}_{index}",
                "op": node.op_type,
                "inputs": list(node.input),
                "outputs": list(node.output),
                "attrs": attrs,
            }
        )
    return {
        "name": name,
        "params": params,
        "inputs": inputs,
        "nodes": nodes,
        "outputs": [o.name for o in graph.output],
    }


def run_specs(
    python: str,
    specs: list[dict[str, Any]],
    settings: MeasureSettings,
    threads: int = 1,
    outputs_only: bool = False,
) -> list[Any]:
    """Run ``specs`` in one MXNet process: Measurements, or each spec's outputs."""
    env = {
        **os.environ,
        "MXNET_ENGINE_TYPE": "NaiveEngine",
        "OMP_NUM_THREADS": str(threads),
        "MXNET_CPU_WORKER_NTHREADS": str(threads),
    }
    with tempfile.TemporaryDirectory(prefix="trims-mx-") as tmp:
        src, dst = Path(tmp) / "specs.json", Path(tmp) / "out.json"
        body = {"settings": asdict(settings), "specs": specs, "outputs_only": outputs_only}
        src.write_text(json.dumps(body))
        done = subprocess.run(
            [python, "-m", "trims.evaluation.mxnet_runner", str(src), str(dst)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            raise UpstreamError(
                f"MXNet runner ({python}) failed on {len(specs)} benchmarks: "
                f"{done.stderr.strip()[-800:]}"
            )
        results: list[Any] = json.loads(dst.read_text())
    if outputs_only:
        return results
    return [Measurement(**r) for r in results]
