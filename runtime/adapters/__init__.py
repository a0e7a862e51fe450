"""Framework adapters: build framework objects over a model buffer without copying the weights.

Each adapter takes :class:`HostWeights` (a :class:`trims.runtime.client.Lease`, a
:class:`trims.runtime.mapping.HostMapping`, or any object with a manifest and a buffer) and
returns the framework's objects viewing that buffer: ``numpy``, ``torch``, ``onnxruntime``,
``mxnet``. The framework is imported only by its adapter module.
"""

from __future__ import annotations

from typing import Protocol

from trims.layout import Manifest


class HostWeights(Protocol):
    """A model buffer in host memory and the manifest that describes it."""

    @property
    def manifest(self) -> Manifest: ...

    def buffer(self) -> memoryview: ...
