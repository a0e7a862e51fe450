"""The ``trace`` benchmark function: the handler contract with real Request/Context values."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import pytest

from trims.errors import ValidationError
from trims.evaluation.tracing import function, store

runtime_functions = pytest.importorskip("trims.runtime.functions")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "trace" / "function.yaml"


def _ctx(config: Mapping[str, object]) -> object:
    return runtime_functions.Context(
        function="trace",
        instance_id="test",
        models={},
        logger=logging.getLogger("test"),
        tracer=None,
        config=config,
    )


def _request(body: object) -> object:
    return runtime_functions.Request(
        json.dumps(body).encode(), {"content-type": "application/json"}
    )


def test_handler_returns_the_summary_and_the_chrome_trace(tmp_path: Path) -> None:
    db = tmp_path / "results" / "eval.sqlite"
    body = {
        "model": "torch:resnet18",
        "framework": "onnxruntime",
        "level": "layer",
        "runs": 3,
        "batch": 1,
        "quick": True,
    }
    answer = json.loads(json.dumps(function.handler(_request(body), _ctx({"db": str(db)}))))
    assert answer["model"] == "torch:resnet18" and answer["framework"] == "onnxruntime"
    assert [lv["level"] for lv in answer["levels"]] == ["model", "layer"]
    assert answer["coverage_pct"] > 0
    chrome = answer["chrome"]
    assert chrome["otherData"]["trace_id"] == answer["trace_id"]
    assert sum(1 for e in chrome["traceEvents"] if e["ph"] == "X") == answer["spans"]
    assert store.load_trace(str(db), answer["trace_id"])[1]["trace_id"] == answer["trace_id"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (["torch:resnet18"], "send a JSON object"),
        ({"framework": "torch"}, "send a JSON object"),
        ({"model": "torch:resnet18", "db": "/etc/x"}, r"unknown settings \['db'\]"),
        ({"model": "/etc/passwd"}, "not paths"),
        ({"model": "torch:resnet18", "runs": True}, "'runs' must be int"),
        ({"model": "torch:resnet18", "runs": 10_000}, "'runs' is at most 200"),
        ({"model": "torch:resnet18", "batch": 65}, "'batch' is at most 64"),
        ({"model": "torch:resnet18", "max_time": 1e9}, "'max_time' is at most 30"),
        ({"model": "torch:resnet18", "level": "deep"}, "model, layer, library, kernel, full"),
        ({"model": "torch:resnet18", "framework": "tf"}, "torch, onnxruntime, mxnet"),
    ],
)
def test_bad_requests_are_refused_before_any_model_loads(
    body: object, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ValidationError, match=message):
        function.handler(_request(body), _ctx({"db": str(tmp_path / "r.sqlite")}))
    assert not (tmp_path / "r.sqlite").exists()


def test_shipped_function_yaml_names_the_handler() -> None:
    from trims.runtime.functions.spec import load_spec_file

    spec = load_spec_file(EXAMPLE)
    assert spec.handler == "trims.evaluation.tracing.function:handler"
    from trims.runtime.gateway.code_rules import check_code

    check_code(spec)
