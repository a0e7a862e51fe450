"""The Open Inference Protocol's tensor datatypes and binary-extension header, once.

The gateway decodes and encodes infer requests with them (``trims.runtime.gateway.tensors``);
the evaluation harness's gateway client speaks the same protocol to it
(``trims.evaluation.harness.sut``). Names are the KServe V2 / Triton ones; the NumPy dtypes are
little-endian, as the binary tensor extension sends them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["CODE_PLATFORM", "DTYPES", "HEADER_LENGTH", "PLATFORMS", "platform_of"]

#: The binary tensor extension's header: the length of the JSON part before the raw tensors.
HEADER_LENGTH = "Inference-Header-Content-Length"

#: Open Inference Protocol datatype -> the NumPy dtype of its elements (BYTES: Python objects).
DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

#: A function's model framework (``models[].framework``) -> the ``platform`` its model metadata
#: reports: Triton's backend names where one fits (``onnxruntime_onnx``, ``pytorch_libtorch``),
#: the framework's own name otherwise.
PLATFORMS: dict[str, str] = {
    "onnxruntime": "onnxruntime_onnx",
    "torch": "pytorch_libtorch",
    "mxnet": "mxnet",
    "numpy": "numpy",
}

#: The platform of a served function with no model: its ``infer`` is plain code.
CODE_PLATFORM = "trims"


def platform_of(frameworks: Iterable[str], declared: str = CODE_PLATFORM) -> str:
    """The platform a served function reports: ``declared`` when the spec names one, else that
    of its first model's framework, else :data:`CODE_PLATFORM`."""
    if declared != CODE_PLATFORM:
        return declared
    for framework in frameworks:
        return PLATFORMS.get(framework, framework)
    return CODE_PLATFORM
