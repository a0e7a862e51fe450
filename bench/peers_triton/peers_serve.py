"""A PyTriton server on bench/peers.py's models (``peers_model.forward``).

``python peers_serve.py SPEC``: SPEC is the JSON ``bench/peer_triton.py`` writes (ports,
``instances``, ``models``: name, safetensors path, relu). PyTriton runs the ``tritonserver``
binary as a child process; each model instance is one inference callable on one handler
thread of this process, behind one python-backend stub process that only relays requests.
So every instance answers with this process's pid.

The weights are opened with ``safetensors.torch.load_file`` (a private mmap: no copy), once
per model: its instances share them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from peers_model import forward
from pytriton.model_config import ModelConfig, Tensor
from pytriton.proxy.types import Request
from pytriton.triton import Triton, TritonConfig
from safetensors.torch import load_file

#: [1, width] in, [1, out] and [1] out: no batching, as the other peers serve it
INPUTS = [Tensor(name="input", dtype=np.float32, shape=(-1, -1))]
OUTPUTS = [
    Tensor(name="output", dtype=np.float32, shape=(-1, -1)),
    Tensor(name="pid", dtype=np.int64, shape=(1,)),
]


class Forward:
    """One model instance: PyTriton calls it on the instance's own handler thread."""

    def __init__(self, tensors: dict[str, torch.Tensor], relu: bool) -> None:
        self.tensors, self.relu = tensors, relu
        self.pid = np.array([os.getpid()], dtype=np.int64)

    def __call__(self, requests: list[Request]) -> list[dict[str, np.ndarray]]:
        answers = []
        for request in requests:
            x = torch.from_numpy(request["input"])
            answers.append({"output": forward(self.tensors, x, self.relu).numpy(), "pid": self.pid})
        return answers


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=spec["http_port"],
        grpc_address="127.0.0.1",
        grpc_port=spec["grpc_port"],
        metrics_port=spec["metrics_port"],
        allow_gpu_metrics=False,
        # on SIGINT Triton waits this long for every open HTTP connection to close, and a
        # benchmark's client keeps its idle ones open (the default 30 s, every stop)
        exit_timeout_secs=1,
    )
    triton = Triton(config=config, workspace=spec["workspace"])
    for model in spec["models"]:
        tensors = load_file(model["path"], device="cpu")
        triton.bind(
            model_name=model["name"],
            infer_func=[Forward(tensors, bool(model["relu"])) for _ in range(spec["instances"])],
            inputs=INPUTS,
            outputs=OUTPUTS,
            config=ModelConfig(batching=False),
        )
    # until SIGINT, PyTriton's way to stop: it stops tritonserver, then its models' handlers
    triton.serve()


if __name__ == "__main__":
    main()
