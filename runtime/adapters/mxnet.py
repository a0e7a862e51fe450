"""MXNet adapter: NDArrays over the model buffer (no copy), bound into an executor.

``mx.nd.from_numpy(view, zero_copy=True)`` wraps a NumPy view of the mapping through DLPack:
the NDArray's data pointer is the mapping itself and the NDArray keeps the view (and so the
mapping) alive. MXNet 1.9 marks the NumPy view read-only; the NDArray stays writable and, as
everywhere, a write copies only the touched page into this process (MAP_PRIVATE).

:func:`bind` hands those NDArrays to ``Symbol.bind`` as the executor's argument and auxiliary
arrays, which the executor uses as given. Names follow MXNet's saved ``.params`` files:
``arg:<name>`` for arguments, ``aux:<name>`` for auxiliary states (Gluon ``export`` writes
those); names without a prefix count as arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trims.errors import ValidationError
from trims.runtime.adapters import HostWeights
from trims.runtime.adapters import numpy as numpy_adapter

#: dtypes MXNet 1.9 NDArrays can hold.
MXNET_DTYPES = frozenset(
    {"float64", "float32", "float16", "int64", "int32", "int8", "uint8", "bool"}
)


def ndarrays(weights: HostWeights) -> dict[str, Any]:
    """Every tensor as an ``mx.nd.NDArray`` on the CPU whose memory is the mapping."""
    import mxnet as mx

    buffer = weights.buffer()
    out: dict[str, Any] = {}
    for t in weights.manifest.tensors:
        if t.dtype not in MXNET_DTYPES:
            raise ValidationError(
                f"tensor {t.name!r} of model {weights.manifest.name} is {t.dtype}, which MXNet "
                f"1.9 cannot hold; supported: {sorted(MXNET_DTYPES)}"
            )
        view = numpy_adapter.tensor_view(buffer, t)
        if t.numel == 0:
            out[t.name] = mx.nd.array(view, dtype=view.dtype)
        else:
            out[t.name] = mx.nd.from_numpy(view, zero_copy=True)
    return out


def split_params(arrays: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arguments, auxiliary states) by the ``arg:`` / ``aux:`` prefixes of saved params."""
    args: dict[str, Any] = {}
    aux: dict[str, Any] = {}
    for name, value in arrays.items():
        kind, sep, rest = name.partition(":")
        if sep and kind == "aux":
            aux[rest] = value
        elif sep and kind == "arg":
            args[rest] = value
        else:
            args[name] = value
    return args, aux


def bind(
    symbol: Any,
    weights: HostWeights | Mapping[str, Any],
    input_shapes: Mapping[str, tuple[int, ...]],
    *,
    ctx: Any = None,
) -> Any:
    """An inference executor of ``symbol`` whose weights are the mapped NDArrays.

    ``input_shapes`` names the data inputs (``{"data": (1, 3, 224, 224)}``); they get fresh
    arrays, every other argument and auxiliary state must come from ``weights``.
    """
    import mxnet as mx

    arrays = weights if isinstance(weights, Mapping) else ndarrays(weights)
    args, aux = split_params(arrays)
    ctx = ctx or mx.cpu()
    for name, shape in input_shapes.items():
        args[name] = mx.nd.zeros(shape, ctx=ctx)
    missing = [n for n in symbol.list_arguments() if n not in args]
    missing += [n for n in symbol.list_auxiliary_states() if n not in aux]
    if missing:
        raise ValidationError(
            f"the symbol needs {', '.join(missing)}, which the model does not have; pass data "
            "inputs in input_shapes and check the model version matches the symbol"
        )
    try:
        return symbol.bind(
            ctx,
            {n: args[n] for n in symbol.list_arguments()},
            args_grad=None,
            grad_req="null",
            aux_states={n: aux[n] for n in symbol.list_auxiliary_states()},
        )
    except mx.base.MXNetError as e:
        raise ValidationError(f"MXNet cannot bind the model's weights to the symbol: {e}") from e
