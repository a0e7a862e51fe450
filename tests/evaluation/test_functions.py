"""The analyses as a runtime function: the handler contract with real Request/Context values."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trims.errors import ValidationError
from trims.evaluation import functions
from trims.evaluation.db import ResultsDB

runtime_functions = pytest.importorskip("trims.runtime.functions")


def _ctx(config: dict[str, object]) -> object:
    return runtime_functions.Context(
        function="analyze", instance_id="test", models={}, logger=logging.getLogger("test"),
        tracer=None, config=config,
    )  # fmt: skip


def _request(body: object) -> object:
    return runtime_functions.Request(
        json.dumps(body).encode(), {"content-type": "application/json"}
    )


def test_handler_runs_bricks_into_the_configured_database(tmp_path: Path) -> None:
    db = tmp_path / "results" / "eval.sqlite"
    body = {"analysis": "bricks", "models": ["squeezenet"], "granularity": [5],
            "max_time": 0.05, "min_reps": 3}  # fmt: skip
    result = functions.handler(_request(body), _ctx({"db": str(db)}))
    json.dumps(result)  # the answer is JSON as it is
    (model,) = result["models"]
    assert model["name"] == "squeezenet" and model["measured_ms"] > 0
    assert result["time_bricks_s"] > 0 and "G=5" in result["text"]
    # the measurements are in the deployment's database, for the next request to reuse
    store = ResultsDB(str(db))
    try:
        assert store.count() > 1
    finally:
        store.close()


def test_handler_layers_of_a_family_model(tmp_path: Path) -> None:
    body = {"analysis": "layers", "models": "torch:resnet18", "batch": 2}
    answer = functions.handler(_request(body), _ctx({"db": str(tmp_path / "r.sqlite")}))
    (model,) = json.loads(json.dumps(answer))["models"]  # as the gateway sends it
    assert model["name"] == "torch:resnet18"
    assert model["layers"][0]["input_shapes"][0] == [2, 3, 224, 224]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (["bricks"], "analysis"),
        ({"analysis": "speed"}, "analysis"),
        ({"analysis": "bricks", "db": "/etc/x.sqlite"}, r"unknown settings \['db'\]"),
        ({"analysis": "bricks", "threads": True}, "'threads' must be int"),
        ({"analysis": "bricks", "granularity": "1,x"}, "whole numbers"),
        ({"analysis": "bricks", "threads": -1}, "threads must be between 1 and 256"),
        ({"analysis": "bricks", "max_time": 1e9}, "max_time must be between"),
        ({"analysis": "lowerbound", "variants": "opt=fast"}, "unknown ORT opt level 'fast'"),
        ({"analysis": "layers", "models": ["/etc/passwd"]}, "not paths"),
    ],
)
def test_handler_refuses_bad_requests(body: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=message):
        functions.handler(_request(body), _ctx({"db": str(tmp_path / "r.sqlite")}))
