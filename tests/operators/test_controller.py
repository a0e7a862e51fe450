"""The operator's API calls through the real kubernetes client, against a local API server
(tests/fixtures/kube_api.py): server-side apply of what reconcile wants, status writes, the
list/watch loop."""

from __future__ import annotations

import time
from typing import Any

import pytest

from trims.operators.controller import Operator, OperatorSettings, _Gone
from trims.operators.crd import API_VERSION, KIND
from trims.runtime.kubernetes_objects import KubernetesExecutorSettings

kubernetes_validate = pytest.importorskip("kubernetes_validate")


def function(name: str, spec: dict[str, Any], version: str = "5") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name, "namespace": "fns", "uid": f"uid-{name}", "generation": 2,
            "resourceVersion": version,
        },
        "spec": spec,
    }  # fmt: skip


def operator(kube_api: Any) -> Operator:
    settings = OperatorSettings(
        namespace="fns", pods=KubernetesExecutorSettings(image="trims-runtime:9")
    )
    return Operator(settings, api_client=kube_api.api_client())


def test_sync_applies_deployment_and_service_and_writes_status(kube_api: Any) -> None:
    kube_api.functions[("fns", "echo")] = function(
        "echo", {"handler": "handler:handler", "scaling": {"min_instances": 2}}
    )
    kube_api.ready_replicas = 2
    assert operator(kube_api).sync_once() == "1"

    deployment = kube_api.applied[("deployments", "fns", "trims-fn-echo")]
    service = kube_api.applied[("services", "fns", "trims-fn-echo")]
    for obj in (deployment, service):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    assert deployment["spec"]["replicas"] == 2
    assert set(kube_api.apply_content_types) == {"application/apply-patch+yaml"}
    status = kube_api.statuses[("fns", "echo")]
    assert status["observedGeneration"] == 2
    assert status["readyReplicas"] == 2 and status["image"] == "trims-runtime:9"
    assert status["conditions"][0]["status"] == "True"


def test_invalid_function_gets_a_status_and_nothing_else(kube_api: Any) -> None:
    kube_api.functions[("fns", "bad")] = function("bad", {"handler": "h:h", "replicas": -2})
    operator(kube_api).sync_once()
    assert kube_api.applied == {}
    condition = kube_api.statuses[("fns", "bad")]["conditions"][0]
    assert (condition["status"], condition["reason"]) == ("False", "InvalidSpec")
    assert "replicas" in condition["message"]


def test_watch_reconciles_events_and_list_again_on_410(kube_api: Any) -> None:
    from kubernetes import watch

    op = operator(kube_api)
    kube_api.watch_events = [
        {"type": "ADDED", "object": function("a", {"handler": "h:h"}, version="7")},
        {"type": "DELETED", "object": function("b", {"handler": "h:h"}, version="8")},
    ]
    assert op._watch(watch.Watch(), "1", time.monotonic() + 5) == "8"
    assert ("deployments", "fns", "trims-fn-a") in kube_api.applied
    assert ("deployments", "fns", "trims-fn-b") not in kube_api.applied

    kube_api.watch_events = [
        {
            "type": "ERROR",
            "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},
        }
    ]
    with pytest.raises(_Gone):
        op._watch(watch.Watch(), "8", time.monotonic() + 5)


def test_deleted_function_is_left_to_the_garbage_collector(kube_api: Any) -> None:
    obj = function("gone", {"handler": "h:h"})
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert operator(kube_api).reconcile(obj) is None
    assert kube_api.applied == {} and kube_api.statuses == {}


def test_trims_operator_run_reconciles_and_stops_on_sigterm(kube_api: Any, tmp_path: Any) -> None:
    import signal
    import subprocess
    import sys

    kube_api.functions[("fns", "echo")] = function("echo", {"handler": "handler:handler"})
    kube_api.watch_hold_s = 0.5
    config = kube_api.kubeconfig(tmp_path / "kubeconfig")
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trims", "operator", "run", "--kubeconfig", str(config),
             "--namespace", "fns", "--image", "trims-runtime:7"],
            stdout=out, stderr=out,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while ("fns", "echo") not in kube_api.statuses and proc.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deployment = kube_api.applied[("deployments", "fns", "trims-fn-echo")]
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "trims-runtime:7"
    assert "function fns/echo reconciled" in log.read_text()
