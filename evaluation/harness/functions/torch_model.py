"""A torch manifest's model as a function: the gateway system under test deploys this handler.

Deployed by ``code_dir`` (this folder) with the spec :func:`trims.evaluation.harness.sut.
torch_function_spec` writes: ``config.manifest`` is the manifest (its JSON form; paths in it
must be ``package:`` references, as there is no manifest folder here), ``config.input`` and
``config.output`` the tensor names served over the Open Inference Protocol, ``config.threads``
torch's intra-op threads. ``init`` builds the module as the direct system under test does
(:func:`.manifest_run.torch_model`: the manifest's builder, or its state dict
mapped from the store), so both systems under test run the same weights.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trims.runtime.functions import Context, Request


def init(ctx: Context) -> None:
    import torch

    from trims.evaluation.harness.manifest import Manifest
    from trims.evaluation.harness.manifest_run import torch_model

    torch.set_num_threads(int(ctx.config.get("threads", 1)))
    manifest = Manifest.model_validate(ctx.config["manifest"])
    module, close, _ = torch_model(manifest)
    ctx.state["module"] = module
    ctx.state["close"] = close


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    import torch

    x = np.ascontiguousarray(inputs[str(ctx.config["input"])], dtype=np.float32)
    with torch.inference_mode():
        out = ctx.state["module"](torch.from_numpy(x))
    return {str(ctx.config["output"]): out.numpy()}


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    """A .npy batch in the body -> the output rows as JSON lists."""
    batch = np.load(io.BytesIO(request.body), allow_pickle=False)
    (output,) = infer({str(ctx.config["input"]): batch}, ctx).values()
    return {"outputs": output.tolist()}
