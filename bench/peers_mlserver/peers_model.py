"""The benchmark's models and their forward pass, shared by both systems in bench/peers.py.

The trims function (copied into its code directory) and the MLServer runtime
(``peers_runtime.py``) import this one file, so both run the same torch code on the same
safetensors tensors: ``layers.{i}.weight`` ([out, in] float32) and ``layers.{i}.bias``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Width of the "full" model: Linear(4096, 4096) float32 layers of 64 MiB each.
WIDTH = 4096
#: The small MLP of the throughput runs: 64 -> 256 -> 256 -> 10, ReLU between.
MLP_SIZES = (64, 256, 256, 10)


def write_layers(path: Path, sizes: tuple[int, ...], seed: int = 0) -> None:
    """Linear layers ``sizes[i] -> sizes[i + 1]`` with PyTorch's default init bounds
    (uniform, +-1/sqrt(fan_in)), as a safetensors file readable by everyone."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = 1.0 / fan_in**0.5
        weight = rng.random((fan_out, fan_in), dtype=np.float32) * (2 * bound) - bound
        tensors[f"layers.{i}.weight"] = weight.astype(np.float32, copy=False)
        tensors[f"layers.{i}.bias"] = np.zeros(fan_out, dtype=np.float32)
    save_file(tensors, str(path))
    path.chmod(0o644)  # safetensors writes 0600; trims workers run as nobody


def forward(tensors: Mapping[str, Any], x: Any, relu: bool) -> Any:
    """``x`` ([batch, in] torch float32) through every layer: reads every weight once."""
    import torch

    layers = len(tensors) // 2
    with torch.inference_mode():
        for i in range(layers):
            x = torch.nn.functional.linear(
                x, tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.bias"]
            )
            if relu and i < layers - 1:
                x = torch.relu(x)
    return x
