"""Which framework can trace which level, and why not."""

from __future__ import annotations

import pytest

from trims.errors import ValidationError
from trims.tracing.levels import Level
from trims.tracing.sources import NO_CUDA, availability


@pytest.mark.parametrize("framework", ["torch", "onnxruntime", "mxnet"])
@pytest.mark.parametrize("level", [Level.NONE, Level.MODEL, Level.LAYER, Level.FULL])
def test_levels_every_framework_has(framework: str, level: Level) -> None:
    assert availability(framework, level, cuda=False) is None


def test_library_and_kernel() -> None:
    assert availability("torch", Level.LIBRARY, cuda=False) is None
    assert availability("torch", Level.KERNEL, cuda=False) == NO_CUDA
    assert availability("torch", Level.KERNEL, cuda=True) is None
    assert "MLAS" in (availability("onnxruntime", Level.LIBRARY, cuda=True) or "")
    assert availability("onnxruntime", Level.KERNEL, cuda=False) == NO_CUDA
    assert "torch" in (availability("onnxruntime", Level.KERNEL, cuda=True) or "")
    assert "operators" in (availability("mxnet", Level.LIBRARY, cuda=False) or "")
    assert "CPU build" in (availability("mxnet", Level.KERNEL, cuda=True) or "")


def test_unknown_framework_lists_the_known_ones() -> None:
    with pytest.raises(ValidationError, match="torch, onnxruntime, mxnet"):
        availability("tensorflow", Level.LAYER, cuda=False)
