"""Reconcile one Function object: the Deployment and Service it should have, and its status.

Pure functions over dicts (no API calls), so every object the operator would create can be
checked against the Kubernetes schemas without a cluster. Both objects carry an owner
reference to the Function, so deleting the Function lets the garbage collector delete them.
The Deployment's pods come from the same template the kubernetes executor uses for single
instances (:func:`trims.runtime.kubernetes_objects.function_pod_template`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trims.errors import ValidationError
from trims.operators.crd import API_VERSION, KIND
from trims.runtime.functions.spec import FunctionSpec, parse_spec
from trims.runtime.kubernetes_objects import (
    LABEL_COMPONENT,
    LABEL_FUNCTION,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    KubernetesExecutorSettings,
    dns_name,
    function_pod_template,
)

MANAGER = "trims-operator"
SPEC_HASH_ANNOTATION = "trims.io/spec-hash"


@dataclass(frozen=True)
class Desired:
    """What a Function should have: its parsed spec, replica count and objects to apply."""

    spec: FunctionSpec
    replicas: int
    objects: tuple[dict[str, Any], ...]


def workload_name(function: str) -> str:
    """Name of the Deployment and Service of a Function."""
    return dns_name("trims-fn", function)


def function_spec(obj: Mapping[str, Any]) -> tuple[FunctionSpec, int]:
    """The function spec and replica count of a Function object (ValidationError if invalid)."""
    metadata = obj.get("metadata") or {}
    body = dict(obj.get("spec") or {})
    replicas = body.pop("replicas", None)
    spec = parse_spec({**body, "name": metadata.get("name")})
    if replicas is None:
        replicas = max(1, spec.scaling.min_instances)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ValidationError(f"spec.replicas: must be an integer >= 0, got {replicas!r}")
    if spec.scaling.standby:
        raise ValidationError(
            "spec.scaling.standby: standby instances are kept by a gateway's local or docker "
            "executor; the operator runs replicas (raise spec.replicas instead, or set standby "
            "to 0)"
        )
    return spec, replicas


def owner_reference(obj: Mapping[str, Any]) -> dict[str, Any]:
    metadata = obj["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": metadata["name"],
        "uid": metadata["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def spec_hash(spec: FunctionSpec) -> str:
    return hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def desired_objects(obj: Mapping[str, Any], settings: KubernetesExecutorSettings) -> Desired:
    """The Deployment and Service for Function ``obj`` (ValidationError if its spec is invalid)."""
    spec, replicas = function_spec(obj)
    namespace = obj["metadata"].get("namespace") or "default"
    name = workload_name(spec.name)
    selector = {LABEL_NAME: "trims", LABEL_COMPONENT: "function", LABEL_FUNCTION: spec.name}
    labels = {**settings.labels, **selector, LABEL_MANAGED_BY: MANAGER}
    metadata = {
        "name": name,
        "namespace": namespace,
        "labels": labels,
        "ownerReferences": [owner_reference(obj)],
    }
    template = function_pod_template(spec, settings, labels=labels)
    template["metadata"]["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(spec)}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": template,
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": "wire", "port": settings.port, "targetPort": "wire", "protocol": "TCP"}
            ],
        },
    }
    return Desired(spec, replicas, (deployment, service))


def ready_condition(status: str, reason: str, message: str, now: str) -> dict[str, Any]:
    return {
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now,
    }


def function_status(
    obj: Mapping[str, Any],
    *,
    desired: Desired | None,
    error: str | None,
    deployment_status: Mapping[str, Any] | None,
    settings: KubernetesExecutorSettings,
    now: str,
) -> dict[str, Any]:
    """The Function's ``status``: observed generation, replicas, where to reach it, Ready."""
    generation = (obj.get("metadata") or {}).get("generation")
    if desired is None:
        return {
            "observedGeneration": generation,
            "conditions": [ready_condition("False", "InvalidSpec", error or "invalid spec", now)],
        }
    ready = int((deployment_status or {}).get("readyReplicas") or 0)
    namespace = obj["metadata"].get("namespace") or "default"
    name = workload_name(desired.spec.name)
    if ready >= desired.replicas:
        condition = ready_condition(
            "True", "ReplicasReady", f"{ready}/{desired.replicas} worker pods ready", now
        )
    else:
        condition = ready_condition(
            "False", "ReplicasStarting", f"{ready}/{desired.replicas} worker pods ready", now
        )
    return {
        "observedGeneration": generation,
        "replicas": desired.replicas,
        "readyReplicas": ready,
        "image": desired.spec.image or settings.image,
        "service": f"{name}.{namespace}.svc:{settings.port}",
        "conditions": [condition],
    }
