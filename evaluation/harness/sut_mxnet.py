"""The MXNet system under test: the model in a long-lived child process in the MXNet environment.

MXNet 1.9.1 needs numpy < 1.24 and so lives in its own virtualenv; the main environment cannot
import it. :class:`MxnetSUT` starts the same child the MXNet traces use
(``python -m trims.evaluation.tracing.mxnet_child``, Note [MXNet child protocol] there), loads
the model's graph into it once and answers every ``predict`` chunk with one ``infer`` round trip
over the child's pipe: the input as base64 bytes, the outputs back the same way. The pipe's
round trip is part of every latency LoadGen measures, as an out-of-process framework's would be.

The graph is the model's ONNX file prepared for a fixed batch (:func:`trims.evaluation.graph.
prepare`) and sent as a :mod:`trims.evaluation.mxnet_backend` spec, weights by shape: the child
fills them with seeded random values, which cost the same to compute with. Accuracy is therefore
never computed on MXNet (its manifests declare ``weights: random``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import UpstreamError, ValidationError
from trims.evaluation.harness.sut import Output, _chunks, _split, _stack

if TYPE_CHECKING:
    import onnx

__all__ = ["MxnetSUT", "mxnet_function_spec", "mxnet_spec"]

log = logging.getLogger(__name__)


class MxnetSUT:
    """One ONNX graph in an MXNet child; ``predict`` sends one ``infer`` request per chunk of
    the graph's fixed batch. The child answers one request at a time, so concurrent
    ``predict`` calls (LoadGen's workers) take turns on its pipe."""

    def __init__(
        self, name: str, spec: dict[str, Any], *, threads: int = 1, python: str | None = None
    ) -> None:
        from trims.evaluation.tracing.mxnet_workload import (
            _ChildProcess,
            _no_environment,
            find_python,
        )

        if len(spec["inputs"]) != 1:
            raise ValidationError(
                f"model {name!r} has {len(spec['inputs'])} inputs; the MXNet system under test "
                "feeds one"
            )
        self.name = name
        self.python = find_python(python)
        self.inputs = (str(spec["inputs"][0]["name"]),)
        self.outputs = tuple(str(o) for o in spec["outputs"])
        self.max_batch = int(spec["inputs"][0]["shape"][0])
        self._lock = threading.Lock()
        self._child = _ChildProcess(self.python, threads)
        try:
            reply = self._child.request({"op": "load", "spec": spec})
        except UpstreamError as e:
            self._child.close()
            if "exited" in e.message:
                raise _no_environment(self.python, e.message) from e
            raise ValidationError(f"model {name!r} does not run in MXNet: {e.message}") from e
        except BaseException:
            self._child.close()
            raise
        self.framework_version = str(reply["mxnet"])
        log.info(
            "MXNet system under test %s: MXNet %s in child %d (%s), batch %d, %d threads",
            name,
            self.framework_version,
            reply["pid"],
            self.python,
            self.max_batch,
            threads,
        )

    @classmethod
    def from_onnx(
        cls,
        name: str,
        model: onnx.ModelProto,
        *,
        batch: int = 1,
        threads: int = 1,
        python: str | None = None,
    ) -> MxnetSUT:
        """``model`` (an ONNX graph; the zoo's constant fills are materialized) prepared for
        ``batch`` samples per request and loaded into a new MXNet child."""
        return cls(name, mxnet_spec(name, model, batch), threads=threads, python=python)

    def predict(self, batch: list[Any]) -> list[Any]:
        from trims.evaluation.tracing.mxnet_child import decode_array, encode_array

        results: list[Output] = []
        for chunk in _chunks(batch, self.max_batch):
            feeds = _stack(chunk, self.inputs)
            with self._lock:
                reply = self._child.request(
                    {"op": "infer", "input": encode_array(feeds[self.inputs[0]])}
                )
            arrays = [np.array(decode_array(doc)) for doc in reply["outputs"]]
            results.extend(_split(dict(zip(self.outputs, arrays, strict=True)), len(chunk)))
        return results

    def close(self) -> None:
        """Stop the child (it exits when its input closes)."""
        self._child.close()


def mxnet_spec(name: str, model: onnx.ModelProto, batch: int = 1) -> dict[str, Any]:
    """``model`` (an ONNX graph; the zoo's constant fills are materialized) prepared for
    ``batch`` samples per request, in the JSON form the MXNet environment builds."""
    from trims.evaluation import graph, mxnet_backend, zoo

    prepared = graph.prepare(zoo.materialize_constants(model, name), name, batch)
    return mxnet_backend.spec(prepared, name)


#: The environment name the gateway declares for MXNet (``--environment mxnet=PYTHON``).
MXNET_ENVIRONMENT = "mxnet"


def mxnet_function_spec(
    name: str,
    spec: dict[str, Any],
    *,
    executor: str | None = None,
    threads: int = 1,
    max_instances: int = 1,
    concurrency: int = 1,
) -> dict[str, Any]:
    """A function ``name`` serving an MXNet graph (``spec``: :func:`mxnet_spec`) over the Open
    Inference Protocol, run in the gateway's ``mxnet`` environment by
    ``evaluation/harness/functions/mxnet_model.py``, with MXNet's engine and threads set as the
    direct system under test's child sets them."""
    if len(spec["inputs"]) != 1:
        raise ValidationError(
            f"model {name!r} has {len(spec['inputs'])} inputs; the MXNet function feeds one"
        )
    (entry,) = spec["inputs"]
    folder = Path(__file__).parent / "functions"
    out: dict[str, Any] = {
        "name": name,
        "handler": "mxnet_model:handler",
        "code_dir": str(folder.resolve()),
        "environment": MXNET_ENVIRONMENT,
        "scaling": {"max_instances": max_instances, "concurrency": concurrency},
        "resources": {"cpus": threads},
        "env": {
            "MXNET_ENGINE_TYPE": "NaiveEngine",
            "OMP_NUM_THREADS": str(threads),
            "MXNET_CPU_WORKER_NTHREADS": str(threads),
        },
        "config": {"spec": spec, "threads": threads},
        "serves": {
            "inputs": [
                {"name": str(entry["name"]), "datatype": "FP32", "shape": list(entry["shape"])}
            ],
            "outputs": [
                {"name": str(o), "datatype": "FP32", "shape": [int(entry["shape"][0]), -1]}
                for o in spec["outputs"]
            ],
        },
    }
    if executor is not None:
        out["executor"] = executor
    return out
