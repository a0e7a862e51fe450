"""Reading a converted layout back, and the invariants every converter's output must meet."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from trims.layout import ALIGNMENT, DTYPE_SIZES, PAGE, Manifest, TensorSpec, plan


def read_raw(path: Path, manifest: Manifest) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) as stored in the layout file."""
    data = path.read_bytes()
    return {
        t.name: (t.dtype, t.shape, data[t.offset : t.offset + t.nbytes]) for t in manifest.tensors
    }


def check_layout(path: Path, manifest: Manifest) -> None:
    """Digest, size, alignment, plan order and zero padding of a layout file."""
    data = path.read_bytes()
    assert len(data) == manifest.total_bytes
    assert manifest.total_bytes % PAGE == 0
    assert hashlib.sha256(data).hexdigest() == manifest.digest
    entries, total = plan(TensorSpec(t.name, t.dtype, t.shape) for t in manifest.tensors)
    assert entries == manifest.tensors
    assert total == manifest.total_bytes
    covered = np.zeros(len(data), dtype=bool)
    for t in manifest.tensors:
        assert t.offset % ALIGNMENT == 0
        assert t.nbytes == int(np.prod(t.shape, dtype=np.int64)) * DTYPE_SIZES[t.dtype]
        covered[t.offset : t.offset + t.nbytes] = True
    padding = np.frombuffer(data, dtype=np.uint8)[~covered]
    assert not padding.any(), "padding bytes must be zero"
    Manifest.from_dict(manifest.to_dict())


def torch_raw(tensor: Any) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype, shape, raw C-order bytes) of a torch tensor, bfloat16 included."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), flat.numpy().tobytes()


def numpy_raw(array: np.ndarray, dtype: str | None = None) -> tuple[str, tuple[int, ...], bytes]:
    return dtype or array.dtype.name, tuple(array.shape), np.ascontiguousarray(array).tobytes()


def sample_torch_tensors() -> dict[str, Any]:
    """Every dtype class that matters, with 0-d, empty and non-contiguous tensors."""
    import torch

    g = torch.Generator().manual_seed(7)
    base = torch.randn(5, 7, generator=g)
    return {
        "dense.weight": torch.randn(33, 17, generator=g),
        "dense.bias": torch.randn(17, generator=g, dtype=torch.float64),
        "half": torch.randn(3, 4, 5, generator=g).to(torch.float16),
        "brain": torch.randn(9, 3, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-50, 50, dtype=torch.int64).reshape(10, 10),
        "i32": torch.tensor([-(2**31), 2**31 - 1, 0], dtype=torch.int32),
        "i8": torch.tensor([-128, 127, 1], dtype=torch.int8),
        "u8": torch.tensor([0, 255, 3], dtype=torch.uint8),
        "mask": torch.tensor([[True, False, True]]),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "nan_inf": torch.tensor([float("nan"), float("inf"), -0.0]),
    }
