"""A function as Kubernetes objects: the pod template the kubernetes executor and the operator
both run, the executor's settings, and the labels that find pods again.

Plain dicts, no client call: the executor (:mod:`trims.runtime.executors.kubernetes`) creates
one Pod per instance from :func:`pod_manifest`; the operator (:mod:`trims.operators`) builds a
Deployment from :func:`function_pod_template`. Every pod runs as its function's own non-root
uid and group (Note [one uid per function] in :mod:`trims.runtime.executors.function_uids`: the
store's per-uid limits and access lists then tell functions apart), with the store socket's
group as a supplementary one, all capabilities dropped, no privilege escalation, the runtime's
default seccomp profile and a read-only root filesystem; it is scheduled only onto nodes where
a daemon pod runs (required pod affinity on the daemon's labels) and gets the node's store
socket through a hostPath mount of the socket file alone. CPU, memory and GPU
(``nvidia.com/gpu``) requests and limits come from the spec. Its environment is
:data:`WORKER_ENV_DEFAULTS`, the settings' ``env``, the spec's ``env`` and the store socket's
path: never anything of the gateway's or the operator's own environment.

This module is part of the runtime's public API (the operator imports it); the executor's pod
lifecycle stays in the executor.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from trims.config import parse_size
from trims.errors import ValidationError
from trims.runtime.executors.function_uids import (
    DEFAULT_UID_BASE,
    DEFAULT_UID_COUNT,
    check_uid_range,
    function_uid,
)
from trims.runtime.functions.spec import WORKER_ENV_DEFAULTS, FunctionSpec

__all__ = [
    "CONTAINER_STORE_SOCKET",
    "DAEMON_POD_LABELS",
    "LABEL_COMPONENT",
    "LABEL_EXECUTOR",
    "LABEL_FUNCTION",
    "LABEL_INSTANCE",
    "LABEL_MANAGED_BY",
    "LABEL_NAME",
    "RESERVED_UIDS",
    "RUNTIME_UID",
    "WORKER_PORT",
    "KubernetesExecutorSettings",
    "container_resources",
    "dns_name",
    "function_pod_template",
    "pod_manifest",
]

LABEL_NAME = "app.kubernetes.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_FUNCTION = "trims.io/function"
LABEL_INSTANCE = "trims.io/instance"
LABEL_EXECUTOR = "trims.io/executor"
#: Labels every daemon pod of the chart carries; function pods require one on their node.
DAEMON_POD_LABELS: Mapping[str, str] = MappingProxyType(
    {LABEL_NAME: "trims", LABEL_COMPONENT: "daemon"}
)

CONTAINER_STORE_SOCKET = "/run/trims/store.sock"
WORKER_PORT = 7070
#: The image's trims user, which the chart's daemon, gateway and operator run as; no function
#: pod gets it (Note [one uid per function]).
RUNTIME_UID = 10001
#: Uids no function pod runs as, whatever the range (Note [one uid per function]).
RESERVED_UIDS = frozenset({0, RUNTIME_UID})
_DNS_RE = re.compile(r"[^a-z0-9-]+")


def dns_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label from ``parts``: lower case, [a-z0-9-], at most ``limit`` characters."""
    name = _DNS_RE.sub("-", "-".join(parts).lower()).strip("-")
    return name[:limit].rstrip("-") or "trims"


@dataclass(frozen=True)
class KubernetesExecutorSettings:
    #: Namespace of the function pods; None = the executor's own pod namespace, else "default".
    namespace: str | None = None
    #: Image for functions whose spec names none (the runtime image, dockerfiles/).
    image: str = "trims-runtime:latest"
    #: "Always", "IfNotPresent" or "Never" (images imported into the nodes).
    image_pull_policy: str = "IfNotPresent"
    #: The daemon's store socket on the node (the DaemonSet's hostPath).
    store_socket: str = "/run/trims/store.sock"
    #: Group that may connect to the store socket (the daemon's --socket-group gid).
    store_group: int = RUNTIME_UID
    #: First uid of the functions' own (Note [one uid per function]); the range must hold no
    #: uid of the daemon (the chart's runAsUser) or of anyone else on the nodes.
    uid_base: int = DEFAULT_UID_BASE
    #: How many uids from ``uid_base`` the functions draw from.
    uid_count: int = DEFAULT_UID_COUNT
    #: Node labels the daemon DaemonSet selects on; function pods select the same nodes.
    node_selector: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Labels of the daemon pods; a function pod requires one on its node (pod affinity).
    daemon_labels: Mapping[str, str] = field(default_factory=lambda: DAEMON_POD_LABELS)
    #: TCP port the worker listens on inside its pod.
    port: int = WORKER_PORT
    #: Memory added to ``resources.memory_bytes`` for the interpreter and frameworks.
    memory_overhead_bytes: int = 256 << 20
    #: CPU requested when the spec sets no limit (cores).
    default_cpu_request: float = 0.1
    #: Service account of the function pods (one without API permissions).
    service_account: str | None = None
    #: Seconds a deleted pod gets to drain before SIGKILL.
    termination_grace_s: int = 30
    #: Path of a kubeconfig file; None = in-cluster config, else ~/.kube/config.
    kubeconfig: str | None = None
    #: Extra environment and labels for every pod.
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            raise ValidationError(
                f"kubernetes executor: image_pull_policy {self.image_pull_policy!r} must be "
                "Always, IfNotPresent or Never"
            )
        if not 0 < self.port < 65536:
            raise ValidationError(f"kubernetes executor: port {self.port} is out of range")
        check_uid_range(self.uid_base, self.uid_count, "kubernetes executor")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KubernetesExecutorSettings:
        """Settings from ``TRIMS_K8S_*`` variables (the Helm chart sets them on the gateway)."""
        kwargs: dict[str, Any] = {}
        for key, var in (
            ("namespace", "TRIMS_K8S_NAMESPACE"),
            ("image", "TRIMS_K8S_IMAGE"),
            ("image_pull_policy", "TRIMS_K8S_IMAGE_PULL_POLICY"),
            ("store_socket", "TRIMS_K8S_STORE_SOCKET"),
            ("service_account", "TRIMS_K8S_SERVICE_ACCOUNT"),
        ):
            if env.get(var):
                kwargs[key] = env[var]
        for key, var in (
            ("store_group", "TRIMS_K8S_STORE_GROUP"),
            ("port", "TRIMS_K8S_PORT"),
            ("uid_base", "TRIMS_K8S_UID_BASE"),
            ("uid_count", "TRIMS_K8S_UID_COUNT"),
        ):
            if env.get(var):
                kwargs[key] = _int_var(env, var)
        if env.get("TRIMS_K8S_MEMORY_OVERHEAD"):
            kwargs["memory_overhead_bytes"] = parse_size(env["TRIMS_K8S_MEMORY_OVERHEAD"])
        if env.get("TRIMS_K8S_NODE_SELECTOR"):
            kwargs["node_selector"] = _json_mapping(env["TRIMS_K8S_NODE_SELECTOR"])
        return cls(**kwargs)


def _int_var(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError as e:
        raise ValidationError(f"{var} must be an integer, got {env[var]!r}") from e


def _json_mapping(text: str) -> Mapping[str, str]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValidationError(f"TRIMS_K8S_NODE_SELECTOR is not a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise ValidationError("TRIMS_K8S_NODE_SELECTOR must be a JSON object of label: value")
    return {str(k): str(v) for k, v in value.items()}


def _quantity_bytes(n: int) -> str:
    """Bytes as a Kubernetes quantity ("256Mi" when it divides evenly)."""
    for suffix, unit in (("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _quantity_cpu(cores: float) -> str:
    return f"{max(1, round(cores * 1000))}m"


def container_resources(
    spec: FunctionSpec, settings: KubernetesExecutorSettings
) -> dict[str, dict[str, str]]:
    """Requests and limits: CPU and memory from the spec (plus the runtime overhead), GPUs."""
    res = spec.resources
    requests: dict[str, str] = {"cpu": _quantity_cpu(res.cpus or settings.default_cpu_request)}
    limits: dict[str, str] = {}
    if res.cpus:
        limits["cpu"] = _quantity_cpu(res.cpus)
    if res.memory_bytes is not None:
        memory = _quantity_bytes(res.memory_bytes + settings.memory_overhead_bytes)
        requests["memory"] = limits["memory"] = memory
    if res.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(res.gpus)
    return {"requests": requests, "limits": limits}


def function_pod_template(
    spec: FunctionSpec,
    settings: KubernetesExecutorSettings,
    *,
    labels: Mapping[str, str],
    instance_id: str | None = None,
    uid: int | None = None,
) -> dict[str, Any]:
    """The pod ``metadata`` + ``spec`` that runs one worker of ``spec`` (for pods and Deployments).

    ``instance_id`` None: the worker names itself (a Deployment's replicas). ``uid``: the uid
    and gid it runs as; None: the one from the function's name (what a Deployment, which no
    executor tracks, gets).
    """
    if uid is None:
        uid = function_uid(
            spec.name, settings.uid_base, settings.uid_count, held={}, reserved=RESERVED_UIDS
        )
    argv = [
        "worker",
        "--listen", f"tcp:0.0.0.0:{settings.port}",
        "--store-socket", CONTAINER_STORE_SOCKET,
        "--spec-json", json.dumps(spec.to_dict(), sort_keys=True),
    ]  # fmt: skip
    if instance_id is not None:
        argv += ["--instance-id", instance_id]
    # Note [passive OpenMP threads]: the defaults first, so settings and the spec override them.
    # Never anything from os.environ: the gateway's secrets must not reach function code.
    store = {"TRIMS_SOCKET": CONTAINER_STORE_SOCKET}
    env = {**WORKER_ENV_DEFAULTS, **settings.env, **spec.env, **store}
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image or settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "args": argv,
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [{"name": "wire", "containerPort": settings.port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "wire"}, "periodSeconds": 2},
        # The log tail becomes the termination message: "init failed: <reason>" reaches the
        # exit reason without reading logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": container_resources(spec, settings),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "store-socket", "mountPath": CONTAINER_STORE_SOCKET},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": uid,
            "runAsGroup": uid,
            "supplementalGroups": [settings.store_group],
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "affinity": {
            "podAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {"matchLabels": dict(settings.daemon_labels)},
                        "topologyKey": "kubernetes.io/hostname",
                    }
                ]
            }
        },
        "volumes": [
            {
                "name": "store-socket",
                "hostPath": {"path": settings.store_socket, "type": "Socket"},
            },
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        ],
    }
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if spec.resources.gpus:
        pod_spec["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    return {"metadata": {"labels": dict(labels)}, "spec": pod_spec}


def pod_manifest(
    spec: FunctionSpec,
    instance_id: str,
    settings: KubernetesExecutorSettings,
    *,
    namespace: str,
    executor_id: str,
    uid: int | None = None,
) -> dict[str, Any]:
    """The Pod object the executor creates for one instance, running as ``uid`` (None: the one
    from the function's name)."""
    labels = {
        **settings.labels,
        LABEL_NAME: "trims",
        LABEL_COMPONENT: "function",
        LABEL_MANAGED_BY: "trims-gateway",
        LABEL_FUNCTION: spec.name,
        LABEL_INSTANCE: dns_name(instance_id),
        LABEL_EXECUTOR: executor_id,
    }
    template = function_pod_template(
        spec, settings, labels=labels, instance_id=instance_id, uid=uid
    )
    pod_spec = template["spec"]
    pod_spec["restartPolicy"] = "Never"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": dns_name("trims", spec.name, instance_id),
            "namespace": namespace,
            "labels": labels,
        },
        "spec": pod_spec,
    }
