"""ResNet-50 image classification over weights shared through the store.

``init`` builds the network on the ``meta`` device (no memory for parameters) and assigns the
store's mapped tensors to it, so N instances hold one copy of the 98 MiB of weights.
``handler`` takes an image (PNG/JPEG, or a .npy array of shape [3, H, W] or [N, 3, H, W]) and
answers the top-k classes; ``infer`` serves the same network over the Open Inference Protocol.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from network import ResNet50

from trims.runtime.adapters.torch import load_module
from trims.runtime.functions import ClientError, Context, Request

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)


def init(ctx: Context) -> None:
    torch.set_num_threads(int(ctx.config.get("threads", 1)))
    ctx.state["net"] = load_module(ResNet50, ctx.models["resnet50"].torch())


def _decode(request: Request) -> np.ndarray:
    if request.body[:6] == b"\x93NUMPY":
        array = np.load(io.BytesIO(request.body), allow_pickle=False).astype(np.float32)
        return array[None] if array.ndim == 3 else array
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(request.body)).convert("RGB").resize((224, 224))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ClientError(
            f"the body must be a PNG or JPEG image, or a .npy array [3, H, W] / [N, 3, H, W]: {e}",
            status=422,
        ) from None
    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
    return ((pixels - MEAN) / STD)[None]


def _probabilities(net: torch.nn.Module, batch: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        logits = net(torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)))
        return torch.softmax(logits, dim=1).numpy()


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    probs = _probabilities(ctx.state["net"], _decode(request))
    k = int(ctx.config.get("top_k", 5))
    results = []
    for row in probs:
        top = np.argsort(row)[::-1][:k]
        results.append([{"class": int(c), "probability": float(row[c])} for c in top])
    return {"predictions": results}


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    return {"probabilities": _probabilities(ctx.state["net"], inputs["input"])}
