"""The ``evaluate`` benchmark function: its handler with real Request/Context values, and the
shipped spec deployed on a real gateway, invoked sync and async."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.gateway import RunningGateway
from tests.fixtures.unprivileged import writable_by_functions
from trims.errors import ValidationError
from trims.evaluation.harness import function
from trims.evaluation.harness.results import list_evaluations

runtime_functions = pytest.importorskip("trims.runtime.functions")


EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "evaluate" / "function.yaml"
#: A short digits-mlp evaluation: both modes, Offline, every one of its 450 test digits.
DIGITS = {
    "models": ["digits-mlp"],
    "scenario": "offline",
    "mode": "both",
    "batch": 32,
    "settings": {"min_duration_ms": 200, "min_query_count": 1},
}


def _ctx(config: Mapping[str, object]) -> Any:
    return runtime_functions.Context(
        function="evaluate", instance_id="test", models={},
        logger=logging.getLogger("test"), tracer=None, config=config,
    )  # fmt: skip


def _request(body: object) -> Any:
    return runtime_functions.Request(
        json.dumps(body).encode(), {"content-type": "application/json"}
    )


def _check_digits(answer: dict[str, Any]) -> dict[str, Any]:
    assert answer["system"]["cores"] >= 1 and "frameworks" in answer["system"]
    [entry] = answer["evaluations"]
    assert (entry["model"], entry["framework"], entry["scenario"], entry["sut"], entry["mode"]) == (
        "digits-mlp", "onnxruntime", "offline", "direct", "both",
    )  # fmt: skip
    assert entry["batch"] == 32 and entry["qps"] > 0
    assert set(entry["latency_ms"]) >= {"p50", "p90", "p99"}
    accuracy = entry["accuracy"]
    assert (accuracy["metric"], accuracy["dataset"], accuracy["samples"]) == (
        "top1", "digits/test", 450,
    )  # fmt: skip
    assert abs(accuracy["value"] - accuracy["reference"]) <= 0.005
    return entry  # type: ignore[no-any-return]


def test_a_digits_evaluation_is_answered_and_recorded(tmp_path: Path) -> None:
    db = tmp_path / "results" / "eval.sqlite"
    config = {"db": str(db), "work_dir": str(tmp_path / "models")}
    answer = function.handler(_request(DIGITS), _ctx(config))
    entry = _check_digits(json.loads(json.dumps(answer)))
    [record] = list_evaluations(str(db))
    assert record.id == entry["id"] and record.run_id == entry["run_id"]
    e = record.evaluation
    assert (e.manifest_name, e.executor, e.mode) == ("digits-mlp", "local", "both")
    assert "== performance ==" in e.summary and "Result is" in e.summary
    assert e.accuracy is not None and e.accuracy.value == entry["accuracy"]["value"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (["digits-mlp"], "send a JSON object"),
        ({"scenario": "offline"}, "send a JSON object"),
        ({"models": ["digits-mlp"], "db": "/etc/x"}, r"unknown settings \['db'\]"),
        ({"models": ["/etc/passwd"]}, "not paths"),
        ({"models": ["../manifests/digits-mlp.yaml"]}, "not shipped manifests"),
        ({"models": []}, "not shipped manifests"),
        ({"models": ["digits-mlp"] * 9}, "at most 8 models"),
        ({"models": ["digits-mlp"], "batch": True}, "'batch' must be int"),
        ({"models": ["digits-mlp"], "batch": 0}, "between 1 and 256"),
        ({"models": ["digits-mlp"], "threads": 64}, "between 1 and 16"),
        ({"models": ["digits-mlp"], "scenario": "burst"}, "unknown scenario"),
        ({"models": ["digits-mlp"], "mode": "twice"}, "unknown mode"),
        ({"models": ["digits-mlp"], "sut": "gateway"}, "runs the direct system under test"),
        ({"models": ["digits-mlp"], "settings": []}, "'settings' must be object"),
        ({"models": ["digits-mlp"], "settings": {"mlperf_defaults": True}}, "10 minutes"),
        ({"models": ["digits-mlp"], "settings": {"min_duration_ms": 3_600_000}}, "between 0"),
        ({"models": ["digits-mlp"], "settings": {"max_duration_ms": -1}}, "between 0"),
        ({"models": ["digits-mlp"], "settings": {"server_target_qps": "x"}}, "int or float"),
    ],
)
def test_bad_requests_are_refused_before_any_model_loads(
    body: object, message: str, tmp_path: Path
) -> None:
    config = {"db": str(tmp_path / "r.sqlite"), "work_dir": str(tmp_path / "models")}
    with pytest.raises(ValidationError, match=message):
        function.handler(_request(body), _ctx(config))
    assert not (tmp_path / "r.sqlite").exists() and not (tmp_path / "models").exists()


def test_a_framework_constraint_is_checked_for_every_model_before_the_first_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trims.evaluation.harness import manifest

    real = manifest.installed_version
    monkeypatch.setattr(
        manifest,
        "installed_version",
        lambda name: "1.0" if name == "torch" else real(name),
    )
    body = {"models": ["digits-mlp", "torch-resnet18"], "scenario": "offline"}
    config = {"db": str(tmp_path / "r.sqlite"), "work_dir": str(tmp_path / "models")}
    with pytest.raises(ValidationError, match=r"installed torch 1.0 does not satisfy"):
        function.handler(_request(body), _ctx(config))
    assert not (tmp_path / "r.sqlite").exists() and not (tmp_path / "models").exists()


def test_settings_are_bounded_and_every_run_has_a_time_cap() -> None:
    req = function.checked({"models": "digits-mlp"})
    assert req.models == ("digits-mlp",) and req.sut == "direct"
    assert req.settings.max_duration_ms == function.SETTINGS_LIMITS["max_duration_ms"]
    req = function.checked(
        {"models": ["digits-mlp"], "settings": {"max_duration_ms": 500, "server_target_qps": 5}}
    )
    assert req.settings.max_duration_ms == 500 and req.settings.server_target_qps == 5


def test_the_shipped_spec_names_the_handler() -> None:
    from trims.runtime.functions.spec import load_spec_file
    from trims.runtime.gateway.code_rules import check_code

    spec = load_spec_file(EXAMPLE)
    assert spec.handler == "trims.evaluation.harness.function:handler"
    assert str(spec.config["db"]).endswith(".sqlite")
    check_code(spec)


async def test_sync_and_async_invocations_on_a_gateway_land_in_the_database(
    start_gateway: Callable[..., Awaitable[RunningGateway]], tmp_path: Path
) -> None:
    from trims.runtime.functions.spec import load_spec_file

    shared = writable_by_functions(tmp_path / "shared")
    db = shared / "eval.sqlite"
    spec = load_spec_file(EXAMPLE).to_dict()
    spec["config"] = {**spec["config"], "db": str(db), "work_dir": str(shared / "models")}
    gw = await start_gateway()
    await gw.deploy(spec)
    headers = {"content-type": "application/json"}
    status, _, body = await gw.invoke("evaluate", json.dumps(DIGITS).encode(), headers)
    assert status == 200, body
    first = _check_digits(json.loads(body))

    async with gw.session.post(
        f"{gw.url}/v1/functions/evaluate/invoke?async=true", json=DIGITS
    ) as r:
        assert r.status == 202
        accepted = await r.json()
    for _ in range(600):
        status, record = await gw.get_json(accepted["status_url"])
        assert status == 200
        if record["state"] != "running":
            break
        await asyncio.sleep(0.2)
    assert record["state"] == "succeeded", record
    assert record["result"]["status"] == 200
    second = _check_digits(json.loads(record["result"]["body"]))
    assert second["id"] == first["id"] + 1

    status, _, body = await gw.invoke(
        "evaluate", json.dumps({"models": ["/etc/passwd"]}).encode(), headers
    )
    assert status == 422 and b"not paths" in body
    stored = await asyncio.to_thread(list_evaluations, str(db))
    assert [r.run_id for r in stored] == [first["run_id"], second["run_id"]]
