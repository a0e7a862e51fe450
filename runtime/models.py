"""``open_model``: what function code calls to get a model's weights.

With a reachable store the model comes from the daemon as a private mapping of the node's
single copy (:class:`StoreModel`); without one, and given a ``source`` file, it is loaded
directly with the framework's own loader (:class:`trims.runtime.direct.DirectModel`). Both
answer the same methods, and the log says which path was taken, so a function runs unchanged
with and without the store::

    model = open_model("resnet50", source="/models/resnet50.safetensors")
    net = model.torch_module(torchvision_free_resnet50)   # or .numpy(), .onnx_session(), ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from trims.errors import NotFound, Unavailable
from trims.runtime.client import Lease, StoreClient
from trims.runtime.direct import DirectModel
from trims.runtime.model_base import ModelBase

log = logging.getLogger(__name__)


class Model(Protocol):
    """What function code may ask of a model, wherever its weights came from."""

    name: str
    #: "store" (mapped from the daemon) or "direct" (loaded from the file in this process).
    via: str

    def numpy(self) -> dict[str, np.ndarray[Any, Any]]: ...
    def torch(self) -> dict[str, Any]: ...
    def torch_module(self, build: Callable[[], Any] | Any, *, strict: bool = True) -> Any: ...
    def onnx_session(
        self,
        *,
        providers: Sequence[str] | None = None,
        sess_options: Any = None,
        prepack: bool = True,
    ) -> Any: ...
    def onnx_model(self) -> Any: ...
    def mxnet(self) -> dict[str, Any]: ...
    def mxnet_executor(self, symbol: Any, input_shapes: Mapping[str, tuple[int, ...]]) -> Any: ...
    def close(self) -> None: ...


class StoreModel(ModelBase):
    """A model leased from the store; every framework view shares the mapping (no copy)."""

    via = "store"

    def __init__(self, lease: Lease, client: StoreClient | None = None) -> None:
        self.lease = lease
        self.name = lease.manifest.name
        self.version = lease.manifest.version
        self._own_client = client

    def numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        return self.lease.numpy()

    def torch(self) -> dict[str, Any]:
        from trims.runtime.adapters import torch as torch_adapter

        if self.lease.device is not None:
            return torch_adapter.cuda_tensors(self.lease)
        return torch_adapter.tensors(self.lease)

    def onnx_session(
        self,
        *,
        providers: Sequence[str] | None = None,
        sess_options: Any = None,
        prepack: bool = True,
    ) -> Any:
        from trims.runtime.adapters import onnxruntime as ort_adapter

        return ort_adapter.session(
            self.lease, providers=providers, sess_options=sess_options, prepack=prepack
        )

    def onnx_model(self) -> Any:
        """The stored ONNX graph as an ``onnx.ModelProto`` with every initializer's data in it
        (a copy of the weights: for tools that rewrite or export the graph, not for serving,
        which :meth:`onnx_session` does over the mapping)."""
        from trims.runtime.adapters import onnxruntime as ort_adapter

        return ort_adapter.model_proto(self.lease)

    def mxnet(self) -> dict[str, Any]:
        from trims.runtime.adapters import mxnet as mx_adapter

        return mx_adapter.ndarrays(self.lease)

    def populate(self) -> str | None:
        """Fill this process's page tables for the host mapping now (a standby's prepare);
        how (see :func:`trims.runtime.mapping.populate`), or None for a device-tier lease."""
        if self.lease.device is not None:
            return None
        return self.lease.mapping.populate_now()

    def mxnet_executor(self, symbol: Any, input_shapes: Mapping[str, tuple[int, ...]]) -> Any:
        from trims.runtime.adapters import mxnet as mx_adapter

        return mx_adapter.bind(symbol, self.lease, input_shapes)

    def close(self) -> None:
        """Release the lease (views stay valid) and close a client this model opened."""
        try:
            self.lease.release()
        finally:
            if self._own_client is not None:
                self._own_client.close()


def open_model(
    name: str,
    *,
    version: str | None = None,
    source: str | Path | None = None,
    fmt: str | None = None,
    client: StoreClient | None = None,
    socket_path: str | Path | None = None,
    tier: str = "cpu",
) -> StoreModel | DirectModel:
    """The model from the store when reachable, else loaded directly from ``source``.

    Falls back to ``source`` when the daemon is unreachable or does not know the model; without
    a ``source`` those errors propagate. The log records which path was taken and why.
    """
    own = client is None
    store = client or StoreClient(socket_path)
    try:
        lease = store.acquire(name, version, tier=tier)
    except (Unavailable, NotFound) as e:
        if own:
            store.close()
        if source is None:
            raise
        reason = "not reachable" if isinstance(e, Unavailable) else "does not have it"
        log.warning(
            "model %s: the store at %s is %s; loading %s directly (this process holds its own "
            "copy, nothing is shared)",
            name,
            store.socket_path,
            reason,
            source,
        )
        return DirectModel(name, source, fmt)
    log.info(
        "model %s:%s mapped from the store's %s tier (lease %s, %d bytes shared)",
        lease.manifest.name,
        lease.manifest.version,
        lease.tier,
        lease.id,
        lease.manifest.total_bytes,
    )
    return StoreModel(lease, store if own else None)
