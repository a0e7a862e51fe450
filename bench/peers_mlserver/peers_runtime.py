"""An MLServer runtime running bench/peers.py's models (``peers_model.forward``).

model-settings.json: ``"implementation": "peers_runtime.PeersModel"``, ``"parameters":
{"uri": "<absolute .safetensors path>", "extra": {"relu": bool}}``. The weights are opened
with ``safetensors.torch.load_file`` (``safe_open(framework="pt")``): on CPU it returns
tensors backed by a private mmap of the file, so loading copies nothing, every worker of the
server shares the page cache's one copy, and a load costs only the file's mapping; the first
forward pass faults the pages in.

Inputs: ``input`` (FP32, [batch, in]); outputs: ``output`` (FP32) and ``pid`` (INT64, [1]: the
process that answered, so the benchmark can tell its workers apart).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from peers_model import forward
from safetensors.torch import load_file


class PeersModel(MLModel):  # type: ignore[misc]
    async def load(self) -> bool:
        params = self.settings.parameters
        self._tensors = load_file(params.uri, device="cpu")
        self._relu = bool((params.extra or {}).get("relu", False))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = torch.from_numpy(NumpyCodec.decode_input(payload.inputs[0]))
        y = forward(self._tensors, x, self._relu).numpy()
        pid = np.array([os.getpid()], dtype=np.int64)
        return InferenceResponse(
            model_name=self.name,
            outputs=[
                NumpyCodec.encode_output(name="output", payload=y),
                NumpyCodec.encode_output(name="pid", payload=pid),
            ],
        )
