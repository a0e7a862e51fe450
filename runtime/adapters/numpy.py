"""NumPy adapter: one array per tensor, each a view into the model buffer (no copy).

NumPy has no bfloat16, so bfloat16 tensors appear as ``uint16`` arrays holding the raw bits;
the torch adapter gives them their real dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trims.layout import Manifest, TensorEntry

#: Layout dtype -> NumPy dtype; bfloat16 is carried as its raw 16-bit pattern.
NUMPY_DTYPES: dict[str, str] = {"bfloat16": "uint16"}


def numpy_dtype(dtype: str) -> np.dtype[Any]:
    return np.dtype(NUMPY_DTYPES.get(dtype, dtype))


def tensor_view(buffer: Any, entry: TensorEntry) -> np.ndarray[Any, Any]:
    """A C-contiguous view of one tensor inside ``buffer``; writable when the buffer is."""
    dtype = numpy_dtype(entry.dtype)
    flat = np.frombuffer(buffer, dtype=dtype, count=entry.numel, offset=entry.offset)
    return flat.reshape(entry.shape)


def tensors(buffer: Any, manifest: Manifest) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of ``manifest`` as a view into ``buffer``, in manifest order."""
    return {t.name: tensor_view(buffer, t) for t in manifest.tensors}
