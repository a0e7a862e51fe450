"""The studies as a runtime function: the handler contract with real Request/Context values."""

from __future__ import annotations

import json
import logging

import pytest

from trims.errors import NotFound, ValidationError
from trims.kernels import functions, studies

runtime_functions = pytest.importorskip("trims.runtime.functions")


def _ctx() -> object:
    return runtime_functions.Context(
        function="kernels", instance_id="test", models={}, logger=logging.getLogger("test"),
        tracer=None, config={},
    )  # fmt: skip


def _request(body: object) -> object:
    return runtime_functions.Request(
        json.dumps(body).encode(), {"content-type": "application/json"}
    )


def test_handler_runs_a_study_with_settings() -> None:
    body = {"study": "klap", "settings": {"rmat_scale": 5, "spmv_rows": 32, "mandelbrot_size": 16,
                                          "tree_nodes": 32, "repeat": 1}}  # fmt: skip
    result = functions.handler(_request(body), _ctx())
    assert result["study"] == "klap" and all(r["correct"] for r in result["rows"])
    json.dumps(result)  # the answer is JSON as it is


def test_handler_refuses_bad_requests() -> None:
    with pytest.raises(ValidationError, match="study"):
        functions.handler(_request(["tcu"]), _ctx())
    with pytest.raises(NotFound, match="choose one of tcu, klap, transfer, als"):
        functions.handler(_request({"study": "fft"}), _ctx())
    with pytest.raises(ValidationError, match=r"unknown tcu settings \['bogus'\]"):
        functions.handler(_request({"study": "tcu", "settings": {"bogus": 1}}), _ctx())


def test_settings_from_json_lists() -> None:
    settings = studies.settings_from("tcu", {"segments": [16, 0], "max_log2": 12})
    assert settings.segments == (16, 0) and settings.max_log2 == 12
