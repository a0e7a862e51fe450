"""A TorchServe custom handler running bench/peers.py's models (``peers_model.forward``).

Packed by ``torch-model-archiver --handler peers_handler.py --config-file model-config.yaml``;
the model config's ``handler`` section names the weights and whether ReLU runs between
layers: ``{"weights": "<absolute .safetensors path>", "relu": bool}``. The weights are opened
with ``safetensors.torch.load_file`` (a private mmap of the file: no copy, every worker shares
the page cache's one copy), as the MLServer runtime does.

Requests come as V2 JSON on TorchServe's KServe v2 route (``/v2/models/NAME/infer``), which
hands the body to the handler as it is; TorchServe's ``kservev2`` envelope is not used: it
names each output after the input of the same index, so one input cannot answer two outputs
(IndexError in its ``_batch_to_json``). The handler reads the V2 request itself and answers
``output`` (FP32) and ``pid`` (INT64 [1], this worker process).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from peers_model import forward
from safetensors.torch import load_file


class PeersHandler:
    def initialize(self, context: Any) -> None:
        # TorchServe's performance guide: one torch thread per worker, parallelism from workers
        torch.set_num_threads(1)
        config = context.model_yaml_config["handler"]
        self.tensors = load_file(config["weights"], device="cpu")
        self.relu = bool(config["relu"])
        self.name = context.manifest["model"]["modelName"]

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[dict[str, Any]]:
        """One V2 answer per request of the batch (TorchServe decodes a JSON body; other
        content types arrive as bytes)."""
        answers = []
        for row in data:
            body = row["body"]
            answers.append(self.infer(json.loads(body) if isinstance(body, bytes) else body))
        return answers

    def infer(self, request: dict[str, Any]) -> dict[str, Any]:
        tensor = request["inputs"][0]
        x = np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"])
        y = forward(self.tensors, torch.from_numpy(x), self.relu).numpy()
        outputs = [
            {
                "name": "output",
                "datatype": "FP32",
                "shape": list(y.shape),
                "data": y.ravel().tolist(),
            },
            {"name": "pid", "datatype": "INT64", "shape": [1], "data": [os.getpid()]},
        ]
        return {"model_name": self.name, "outputs": outputs}
