"""PyTorch adapter: tensors over the model buffer (no copy), modules loaded by assignment.

Host tensors are ``torch.frombuffer`` views of the private mapping, so they share its pages
with every other process holding the model; an in-place write copies only the touched page
into this process. :func:`load_module` builds a module on the ``meta`` device (no memory for
its parameters) and assigns the mapped tensors with ``load_state_dict(assign=True)``, so no
weight is ever copied or initialised twice. :func:`cuda_tensors` does the same for a GPU-tier
lease through ``__cuda_array_interface__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from trims.errors import ValidationError
from trims.runtime.adapters import HostWeights

if TYPE_CHECKING:
    import torch

    from trims.runtime.client import Lease


def torch_dtype(dtype: str) -> torch.dtype:
    import torch

    try:
        return {
            "float64": torch.float64,
            "float32": torch.float32,
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "int64": torch.int64,
            "int32": torch.int32,
            "int16": torch.int16,
            "int8": torch.int8,
            "uint64": torch.uint64,
            "uint32": torch.uint32,
            "uint16": torch.uint16,
            "uint8": torch.uint8,
            "bool": torch.bool,
            "complex64": torch.complex64,
            "complex128": torch.complex128,
        }[dtype]
    except KeyError:
        raise ValidationError(f"dtype {dtype!r} has no torch equivalent") from None


def tensors(weights: HostWeights) -> dict[str, torch.Tensor]:
    """Every tensor as a CPU ``torch.Tensor`` viewing the buffer, in manifest order."""
    import torch

    buffer = weights.buffer()
    out: dict[str, torch.Tensor] = {}
    for t in weights.manifest.tensors:
        dtype = torch_dtype(t.dtype)
        if t.numel == 0:
            out[t.name] = torch.empty(t.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=t.numel, offset=t.offset)
        out[t.name] = flat.view(t.shape)
    return out


def load_module(
    build: Callable[[], torch.nn.Module] | torch.nn.Module,
    state: HostWeights | dict[str, torch.Tensor],
    *,
    strict: bool = True,
) -> torch.nn.Module:
    """A module whose parameters and buffers are the mapped tensors (no copy, no init).

    ``build`` is a callable that constructs the module (run on the meta device, so it
    allocates nothing) or an existing module. ``state`` is a lease/mapping or a state dict.
    """
    import torch

    if isinstance(build, torch.nn.Module):
        module = build
    else:
        with torch.device("meta"):
            module = build()
    state_dict = state if isinstance(state, dict) else tensors(state)
    try:
        module.load_state_dict(state_dict, strict=strict, assign=True)
    except RuntimeError as e:
        raise ValidationError(
            f"the model's tensors do not fit {type(module).__name__}: {e}; check that the "
            "module matches the model version"
        ) from e
    left = [n for n, p in [*module.named_parameters(), *module.named_buffers()] if p.is_meta]
    if left:
        raise ValidationError(
            f"{type(module).__name__}: {', '.join(left)} not found in the model's tensors; "
            "add them to the model or create them in the module's constructor as persistent "
            "buffers"
        )
    return module.eval()


class _CudaArray:
    """The ``__cuda_array_interface__`` (v3) of one byte range of device memory."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
        }


def cuda_tensors(lease: Lease) -> dict[str, torch.Tensor]:
    """Every tensor of a GPU-tier lease as a CUDA tensor over the daemon's device memory."""
    import torch

    device = lease.device
    if device is None:
        raise ValidationError(
            f"lease {lease.id} of {lease.manifest.name} is in the {lease.tier} tier; acquire "
            "it with tier='gpu' for CUDA tensors, or use tensors() for host tensors"
        )
    whole = torch.as_tensor(
        _CudaArray(device.pointer, device.size), device=f"cuda:{device.device_index}"
    )
    out: dict[str, torch.Tensor] = {}
    for t in lease.manifest.tensors:
        raw = whole[t.offset : t.offset + t.nbytes]
        out[t.name] = raw.view(torch_dtype(t.dtype)).view(t.shape)
    return out
