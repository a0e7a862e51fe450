"""What the operator makes of a Function: every object valid against the Kubernetes schemas,
owned by the Function, and selecting the pods it creates."""

from __future__ import annotations

from typing import Any

import pytest

from trims.errors import ValidationError
from trims.operators.crd import API_VERSION, KIND
from trims.operators.reconcile import (
    SPEC_HASH_ANNOTATION,
    desired_objects,
    function_status,
    workload_name,
)
from trims.runtime.kubernetes_objects import DAEMON_POD_LABELS, KubernetesExecutorSettings

kubernetes_validate = pytest.importorskip("kubernetes_validate")

SETTINGS = KubernetesExecutorSettings(image="trims-runtime:1", node_selector={"pool": "gpu"})


def function(spec: dict[str, Any], name: str = "embed") -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": "fns", "uid": "uid-7", "generation": 3},
        "spec": spec,
    }


SPEC = {
    "handler": "handler:handler",
    "models": [{"name": "minilm", "framework": "torch"}],
    "resources": {"cpus": 2, "memory_bytes": 1 << 30},
    "scaling": {"min_instances": 3},
}


def test_function_becomes_a_valid_deployment_and_service() -> None:
    desired = desired_objects(function(SPEC), SETTINGS)
    deployment, service = desired.objects
    for obj in desired.objects:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
        assert obj["metadata"]["name"] == workload_name("embed") == "trims-fn-embed"
        assert obj["metadata"]["namespace"] == "fns"
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == (KIND, "embed", "uid-7")
        assert owner["controller"] is True

    assert desired.replicas == deployment["spec"]["replicas"] == 3
    template = deployment["spec"]["template"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    assert template["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    affinity = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert affinity[0]["labelSelector"]["matchLabels"] == dict(DAEMON_POD_LABELS)
    assert pod["containers"][0]["image"] == "trims-runtime:1"
    assert "--instance-id" not in pod["containers"][0]["args"]
    assert service["spec"]["ports"][0]["port"] == SETTINGS.port


def test_spec_change_changes_the_pod_template_hash() -> None:
    a = desired_objects(function(SPEC), SETTINGS).objects[0]
    b = desired_objects(function({**SPEC, "env": {"A": "1"}}), SETTINGS).objects[0]
    hash_a = a["spec"]["template"]["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    hash_b = b["spec"]["template"]["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    assert hash_a != hash_b


def test_explicit_replicas_win_and_zero_is_allowed() -> None:
    assert desired_objects(function({**SPEC, "replicas": 0}), SETTINGS).replicas == 0


def test_invalid_spec_names_the_field() -> None:
    with pytest.raises(ValidationError, match=r"scaling\.concurrency"):
        desired_objects(function({"handler": "h:h", "scaling": {"concurrency": 0}}), SETTINGS)
    with pytest.raises(ValidationError, match="name"):
        desired_objects(function({"handler": "h:h"}, name="Bad_Name"), SETTINGS)
    # Standby instances are the local executor's; the operator says so rather than ignore them.
    with pytest.raises(ValidationError, match=r"scaling\.standby.*spec\.replicas"):
        desired_objects(function({**SPEC, "scaling": {"standby": 1}}), SETTINGS)


def test_status_reports_readiness_and_where_to_reach_it() -> None:
    obj = function(SPEC)
    desired = desired_objects(obj, SETTINGS)
    now = "2026-01-01T00:00:00Z"
    starting = function_status(
        obj, desired=desired, error=None, deployment_status={"readyReplicas": 1},
        settings=SETTINGS, now=now,
    )  # fmt: skip
    assert starting["observedGeneration"] == 3
    assert (starting["replicas"], starting["readyReplicas"]) == (3, 1)
    assert starting["conditions"][0]["status"] == "False"
    assert starting["service"] == "trims-fn-embed.fns.svc:7070"
    ready = function_status(
        obj, desired=desired, error=None, deployment_status={"readyReplicas": 3},
        settings=SETTINGS, now=now,
    )  # fmt: skip
    assert ready["conditions"][0]["status"] == "True"
    invalid = function_status(
        obj, desired=None, error="scaling.concurrency: bad", deployment_status=None,
        settings=SETTINGS, now=now,
    )  # fmt: skip
    assert invalid["conditions"][0]["reason"] == "InvalidSpec"
    assert "scaling.concurrency" in invalid["conditions"][0]["message"]


@pytest.mark.parametrize("name", ["embed\n", "embed\r", "em\0bed", "../x", "", "x" * 64])
def test_function_names_are_matched_in_full(name: str) -> None:
    with pytest.raises(ValidationError, match="name"):
        desired_objects(function({"handler": "h:h"}, name=name), SETTINGS)


@pytest.mark.parametrize("model", ["minilm\n", "minilm\r", "mini\0lm", "../x", "", "x" * 129])
def test_model_names_of_a_function_are_matched_in_full(model: str) -> None:
    spec = {**SPEC, "models": [{"name": model, "framework": "torch"}]}
    with pytest.raises(ValidationError, match="model"):
        desired_objects(function(spec), SETTINGS)
