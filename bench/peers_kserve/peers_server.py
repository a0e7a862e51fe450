"""A KServe model server running bench/peers.py's models (``peers_model.forward``).

Run as ``python peers_server.py CONFIG.json``, where the JSON says ``http_port``,
``grpc_port``, ``workers`` (KServe's uvicorn worker processes; 1 serves from this process),
``loaded`` (load every model now, or only on ``/v2/repository/models/NAME/load``) and
``models``: ``[{"name", "path" (absolute .safetensors), "relu"}]``.

The weights are opened with ``safetensors.torch.load_file``: tensors backed by a private mmap
of the file, so a load copies nothing and the first forward pass faults the pages in.

With ``workers > 1`` KServe loads the models here first and then spawns its workers (the
``spawn`` start method, not ``fork``): each worker unpickles the repository it is handed,
models included, and torch's pickling moves each weight into one shared-memory segment that
this process and every worker map. The repository API loads into the one process whose
socket took the request, so it is only meaningful with one process (``workers <= 1``).

Inputs: ``input`` (FP32, [batch, in], V2 JSON or the binary tensor extension); outputs:
``output`` (FP32) and ``pid`` (INT64, [1]: the process that ran the forward pass).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelRepository, ModelServer
from peers_model import forward
from safetensors.torch import load_file


class PeersModel(Model):  # type: ignore[misc]
    def __init__(self, name: str, path: str, relu: bool) -> None:
        super().__init__(name)
        self.path, self.relu = path, relu
        self.tensors: dict[str, torch.Tensor] = {}

    def load(self) -> bool:
        self.tensors = load_file(self.path, device="cpu")
        self.ready = True
        return True

    def predict(self, payload: InferRequest, headers: dict[str, str] | None = None) -> Any:
        x = torch.tensor(payload.inputs[0].as_numpy())
        y = forward(self.tensors, x, self.relu).numpy()
        pid = np.array([os.getpid()], dtype=np.int64)
        return InferResponse(
            response_id=payload.id or "",
            model_name=self.name,
            infer_outputs=[
                InferOutput("output", list(y.shape), "FP32", data=y),
                InferOutput("pid", [1], "INT64", data=pid),
            ],
            use_binary_outputs=payload.use_binary_outputs,
            requested_outputs=payload.request_outputs,
        )


class PeersRepository(ModelRepository):  # type: ignore[misc]
    """Knows every configured model by name; ``load`` opens one (the repository API)."""

    def __init__(self, models: list[dict[str, Any]]) -> None:
        super().__init__(models_dir="")
        self.known = {m["name"]: m for m in models}

    def load(self, name: str) -> bool:
        m = self.known[name]
        model = PeersModel(name, m["path"], bool(m["relu"]))
        model.load()
        self.update(model)
        return bool(model.ready)


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    repository = PeersRepository(config["models"])
    if config["loaded"]:
        for name in repository.known:
            repository.load(name)
    server = ModelServer(
        http_port=config["http_port"],
        grpc_port=config["grpc_port"],
        workers=max(1, config["workers"]),
        registered_models=repository,
        # a log line per request, which the benchmark does not read
        enable_latency_logging=False,
    )
    server.start(list(repository.get_models().values()))


if __name__ == "__main__":
    main()
