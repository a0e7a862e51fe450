"""Leveled-trace fixtures. Traces need onnx (the layer IR): the MXNet venv collects none here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

collect_ignore = (
    [] if importlib.util.find_spec("onnx") else [p.name for p in Path(__file__).parent.glob("*.py")]
)


@pytest.fixture(scope="session")
def residual_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small residual CNN (5 convolutions, 2 adds) as an ONNX file, for torch and ORT."""
    import onnx

    from tests.evaluation import graphs

    path = tmp_path_factory.mktemp("models") / "residual.onnx"
    onnx.save(graphs.residual(2), str(path))
    return path
