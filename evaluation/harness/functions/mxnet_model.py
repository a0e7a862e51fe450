"""An MXNet manifest's graph as a function, in the gateway's ``mxnet`` environment.

The gateway system under test deploys this handler with the spec
:func:`trims.evaluation.harness.sut_mxnet.mxnet_function_spec` writes: ``environment: mxnet``
(MXNet 1.9.1 needs ``numpy<1.24``, so the local executor runs it with the interpreter the gateway
declares under that name), ``config.spec`` the graph's JSON form
(:func:`trims.evaluation.mxnet_backend.spec`) and ``env`` MXNet's engine and thread settings,
which must be set before MXNet is imported (the zygote of that environment does not import it).
``init`` builds the graph as the direct MXNet system under test's child does
(:class:`trims.evaluation.tracing.mxnet_child.Child`, weights seeded the same way), so both
systems under test compute with the same weights and give the same outputs.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trims.runtime.functions import Context, Request


def init(ctx: Context) -> None:
    from trims.evaluation.tracing.mxnet_child import Child

    ctx.state["graph"] = Child(dict(ctx.config["spec"]))


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    graph = ctx.state["graph"]
    x = np.ascontiguousarray(inputs[graph.input_name], dtype=np.float32)
    return dict(zip(graph.outputs, graph.infer(x), strict=True))


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    """A .npy batch in the body -> the first output's rows as JSON lists."""
    graph = ctx.state["graph"]
    batch = np.load(io.BytesIO(request.body), allow_pickle=False)
    outputs = infer({graph.input_name: batch}, ctx)
    return {"outputs": outputs[graph.outputs[0]].tolist()}
