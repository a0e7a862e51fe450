"""The MXNet environment has no onnx: there, only the MXNet runner's own tests are collected."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_KEEP = {"__init__.py", "conftest.py", "test_mxnet_runner.py"}

collect_ignore = (
    []
    if importlib.util.find_spec("onnx")
    else [p.name for p in Path(__file__).parent.glob("*.py") if p.name not in _KEEP]
)
