"""Pipeline step ``decode``: a PNG image -> the model's input tensor, as a ``.npy`` body.

Config: ``size`` ([height, width]; the image is resized to it when it differs, which needs
Pillow), ``divisor`` (input = grey level / divisor) and ``shape`` (the tensor's shape, e.g.
``[64]`` for the digits MLP's flattened 8x8 image). The digits model takes the 17 grey levels
(0..16) of scikit-learn's digits scaled by 1/16; a digit PNG stores level x 15 (0..240), so
``divisor: 240`` gives exactly level / 16.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from pngread import read_gray8

from trims.runtime.functions import Context, Request, Response

NPY = "application/x-npy"


def gray(data: bytes, size: tuple[int, int] | None) -> np.ndarray:
    """The image as uint8 grey levels [height, width]; Pillow when installed, else pngread."""
    try:
        from PIL import Image
    except ImportError:
        image = read_gray8(data)
        if size is not None and image.shape != size:
            raise ValueError(
                f"the image is {image.shape}, not {size}; install Pillow to resize"
            ) from None
        return image
    with Image.open(io.BytesIO(data)) as opened:
        picture = opened.convert("L")
        if size is not None and picture.size != (size[1], size[0]):
            picture = picture.resize((size[1], size[0]), Image.Resampling.BOX)
        return np.asarray(picture, dtype=np.uint8)


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array, allow_pickle=False)
    return out.getvalue()


def handler(request: Request, ctx: Context) -> Any:
    size = ctx.config.get("size")
    image = gray(request.body, tuple(size) if size else None)
    tensor = image.astype(np.float32) / np.float32(ctx.config.get("divisor", 255))
    shape = ctx.config.get("shape")
    if shape:
        tensor = tensor.reshape(shape)
    return Response(body=npy(tensor), headers={"Content-Type": NPY})
