"""The analyses as a runtime function: the handler contract with real Request/Context values."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.store import DaemonProcess
from trims.errors import ValidationError
from trims.evaluation import functions
from trims.evaluation.db import ResultsDB

runtime_functions = pytest.importorskip("trims.runtime.functions")


def _ctx(config: Mapping[str, object], models: Mapping[str, object] | None = None) -> object:
    return runtime_functions.Context(
        function="analyze", instance_id="test", models=models or {},
        logger=logging.getLogger("test"), tracer=None, config=config,
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


def _squeezenet_file(tmp_path: Path) -> Path:
    import onnx

    from trims.evaluation import zoo

    path = tmp_path / "sq.onnx"
    onnx.save(zoo.materialize("squeezenet"), str(path))
    return path


def _layers_of(answer: dict[str, object]) -> list[tuple[str, object]]:
    (model,) = json.loads(json.dumps(answer))["models"]
    return [(layer["op_type"], layer["output_shapes"]) for layer in model["layers"]]


def test_a_model_of_the_functions_spec_is_analysed_from_the_store_or_its_file(
    store_daemon: DaemonProcess, tmp_path: Path
) -> None:
    from trims.runtime.client import StoreClient
    from trims.runtime.direct import DirectModel
    from trims.runtime.models import StoreModel, open_model

    source = _squeezenet_file(tmp_path)
    with StoreClient(store_daemon.socket) as admin:
        admin.add("sq", source)
    stored = open_model("sq", source=source, socket_path=store_daemon.socket)
    direct = DirectModel("sq", source)
    assert isinstance(stored, StoreModel)
    db = {"db": str(tmp_path / "r.sqlite")}
    body = {"analysis": "layers", "models": "store:sq"}
    with stored:
        from_store = functions.handler(_request(body), _ctx(db, {"sq": stored}))
    from_file = functions.handler(_request(body), _ctx(db, {"sq": direct}))
    zoo_model = functions.handler(
        _request({"analysis": "layers", "models": "squeezenet"}), _ctx(db, {})
    )
    assert _layers_of(from_store) == _layers_of(from_file) == _layers_of(zoo_model)
    assert from_store["models"][0]["flops"] == zoo_model["models"][0]["flops"]
    assert from_store["models"][0]["param_bytes"] == zoo_model["models"][0]["param_bytes"]


def test_store_models_are_only_the_functions_own_and_onnx(tmp_path: Path) -> None:
    from trims.runtime.direct import DirectModel

    st = pytest.importorskip("safetensors.numpy")
    st.save_file({"w": np.ones(3, dtype=np.float32)}, str(tmp_path / "w.safetensors"))
    ctx = _ctx({"db": str(tmp_path / "r.sqlite")},
               {"w": DirectModel("w", tmp_path / "w.safetensors")})  # fmt: skip
    with pytest.raises(ValidationError, match=r"this function's models \(store:w\)"):
        functions.handler(_request({"analysis": "layers", "models": "store:other"}), ctx)
    with pytest.raises(ValidationError, match="'store:w' of this function is not an ONNX model"):
        functions.handler(_request({"analysis": "layers", "models": "store:w"}), ctx)
