"""The kubernetes executor: each function instance is a pod next to a trims daemon.

A pod runs ``trims worker --listen tcp:0.0.0.0:<port>`` and the gateway reaches it at its pod IP.
It is scheduled only onto nodes where a daemon pod runs (required pod affinity on the daemon's
labels, plus an optional node selector matching the DaemonSet's), and it gets that daemon's
store socket from the node through a hostPath mount of the socket file alone (the admin socket
beside it stays out of reach). Weights arrive as file descriptors over that socket, so the pod
needs no host IPC namespace.

Every pod runs as a non-root user with all capabilities dropped, no privilege escalation, the
runtime's default seccomp profile and a read-only root filesystem; CPU, memory and GPU
(``nvidia.com/gpu``) requests and limits come from the spec. Labels (:data:`LABEL_EXECUTOR`, ...)
find the pods again; ``close()`` deletes every pod this executor made.

:func:`pod_manifest` and :func:`function_pod_template` build plain dicts (no client call); the
operator builds its Deployments from the same template. The client calls block, so they run in
threads; each instance has a task polling its pod until it ends (``exit_reason`` from the
container's terminated state: OOMKilled, exit code, signal; or the pod's eviction/deletion).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from trims.config import format_size, parse_size
from trims.errors import (
    AlreadyExists,
    NotFound,
    PermissionDenied,
    Timeout,
    TrimsError,
    Unavailable,
    ValidationError,
)
from trims.runtime.executors.base import (
    Instance,
    WorkerInstance,
    pop_managed,
    refuse_environment,
    terminate_all,
)
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.worker.exits import EXIT_INIT_FAILED, describe_returncode

log = logging.getLogger(__name__)

T = TypeVar("T")

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
RUNTIME_UID = 10001
#: Where a pod learns its namespace when the executor runs inside the cluster.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
_DNS_RE = re.compile(r"[^a-z0-9-]+")
_POLL_S = 0.5


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
        for key, var in (("store_group", "TRIMS_K8S_STORE_GROUP"), ("port", "TRIMS_K8S_PORT")):
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
) -> dict[str, Any]:
    """The pod ``metadata`` + ``spec`` that runs one worker of ``spec`` (for pods and Deployments).

    ``instance_id`` None: the worker names itself (a Deployment's replicas).
    """
    argv = [
        "worker",
        "--listen", f"tcp:0.0.0.0:{settings.port}",
        "--store-socket", CONTAINER_STORE_SOCKET,
        "--spec-json", json.dumps(spec.to_dict(), sort_keys=True),
    ]  # fmt: skip
    if instance_id is not None:
        argv += ["--instance-id", instance_id]
    env = {**settings.env, **spec.env, "TRIMS_SOCKET": CONTAINER_STORE_SOCKET}
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
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
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
) -> dict[str, Any]:
    """The Pod object the executor creates for one instance."""
    labels = {
        **settings.labels,
        LABEL_NAME: "trims",
        LABEL_COMPONENT: "function",
        LABEL_MANAGED_BY: "trims-gateway",
        LABEL_FUNCTION: spec.name,
        LABEL_INSTANCE: dns_name(instance_id),
        LABEL_EXECUTOR: executor_id,
    }
    template = function_pod_template(spec, settings, labels=labels, instance_id=instance_id)
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


#: Waiting reasons a container does not recover from without a change to the pod or image.
FATAL_WAITING = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)


def describe_pod_end(pod: Mapping[str, Any], *, memory_limit: int | None) -> str | None:
    """Why a pod (as a dict) ended or can never start; None while it runs or may yet start."""
    status = pod.get("status") or {}
    phase = status.get("phase")
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING:
            message = waiting.get("message") or "no message"
            return f"container cannot start: {waiting['reason']}: {message}"
        terminated = (cs.get("state") or {}).get("terminated")
        if not terminated:
            continue
        if terminated.get("reason") == "OOMKilled":
            limit = f" (container limit {format_size(memory_limit)})" if memory_limit else ""
            return f"out of memory{limit}: the kernel OOM-killed the container"
        code = int(terminated.get("exitCode", -1))
        detail = ""
        if code == EXIT_INIT_FAILED:
            message = str(terminated.get("message") or "")
            detail = message.rsplit("init failed:", 1)[-1].strip() if message else ""
        if code > 128:
            return describe_returncode(-(code - 128), memory_bytes=memory_limit, detail=detail)
        return describe_returncode(code, memory_bytes=memory_limit, detail=detail)
    if phase == "Failed":
        reason = status.get("reason") or "Failed"
        return f"pod {reason.lower()}: {status.get('message') or 'no message'}"
    if phase == "Succeeded":
        return "exited with code 0"
    return None


def pending_reason(pod: Mapping[str, Any]) -> str | None:
    """Why a pod is not scheduled yet (the scheduler's message), or None."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"{condition.get('reason') or 'unschedulable'}: {condition.get('message')}"
    return None


def _translate(action: str, error: Exception) -> TrimsError:
    """A kubernetes client error as the trims error that says what to do."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(error, ApiException):
        reason = _api_message(error)
        status = error.status or 0
        if status == 404:
            return NotFound(f"{action}: {reason}")
        if status == 409:
            return AlreadyExists(f"{action}: {reason}")
        if status in (401, 403):
            return PermissionDenied(
                f"{action}: {reason}; grant the gateway's service account the chart's pod role"
            )
        if status in (400, 422):
            return ValidationError(f"{action}: the API server rejected it: {reason}")
        return Unavailable(f"{action}: API server error {status}: {reason}")
    return Unavailable(f"{action}: cannot reach the Kubernetes API server ({error})")


def _api_message(error: Any) -> str:
    try:
        return str(json.loads(error.body).get("message") or error.reason)
    except (TypeError, ValueError, AttributeError):
        return str(error.reason)


async def _call(action: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking client call in a thread, translating its errors."""
    from kubernetes.client.exceptions import OpenApiException
    from urllib3.exceptions import HTTPError

    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except (OpenApiException, HTTPError, OSError) as e:
        raise _translate(action, e) from e


class KubernetesInstance(WorkerInstance):
    """One pod; a task polls it until it ends and records why."""

    exit_reason: str | None

    def __init__(
        self, instance_id: str, spec: FunctionSpec, pod_name: str, executor: KubernetesExecutor
    ) -> None:
        super().__init__(instance_id, spec.name, "kubernetes")
        self.spec = spec
        self.pod_name = pod_name
        self.pod_ip: str | None = None
        #: Why the scheduler has not placed the pod yet (None once it is placed).
        self.pending: str | None = None
        self._executor = executor
        self._memory_limit = (
            None
            if spec.resources.memory_bytes is None
            else spec.resources.memory_bytes + executor.settings.memory_overhead_bytes
        )
        loop = asyncio.get_running_loop()
        self._scheduled = asyncio.Event()
        self._ended: asyncio.Future[None] = loop.create_future()
        self._watch = loop.create_task(self._poll(), name=f"watch-pod-{pod_name}")

    async def _poll(self) -> None:
        api = self._executor.core_api
        namespace = self._executor.namespace
        while True:
            try:
                pod = await _call(
                    f"read pod {self.pod_name}", api.read_namespaced_pod, self.pod_name, namespace
                )
            except NotFound:
                self._end("pod was deleted")
                return
            except Unavailable as e:
                log.warning("pod %s of %s: %s; retrying", self.pod_name, self.function, e)
                await asyncio.sleep(_POLL_S * 4)
                continue
            data = api.api_client.sanitize_for_serialization(pod)
            self.pending = pending_reason(data)
            ip = (data.get("status") or {}).get("podIP")
            if ip and self.pod_ip is None:
                self.pod_ip = ip
                self._scheduled.set()
            reason = describe_pod_end(data, memory_limit=self._memory_limit)
            if reason is not None:
                self._end(reason)
                return
            await asyncio.sleep(_POLL_S)

    def _end(self, reason: str) -> None:
        if self.exit_reason is None:
            self.exit_reason = reason
        self._scheduled.set()
        if not self._ended.done():
            self._ended.set_result(None)

    def address(self) -> str:
        return f"tcp:{self.pod_ip}:{self._executor.settings.port}"

    def alive(self) -> bool:
        return not self._ended.done()

    async def wait_ready(self, timeout: float) -> None:
        """Wait for the pod to be scheduled and get an IP, then for the worker's HELLO."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            await asyncio.wait_for(self._scheduled.wait(), timeout)
        except TimeoutError:
            why = f" ({self.pending})" if self.pending else ""
            raise Timeout(
                f"pod {self.pod_name} of {self.function} got no IP within {timeout:.1f} s{why}; "
                f"see 'kubectl describe pod {self.pod_name}' (is a trims daemon on some node?)"
            ) from None
        await super().wait_ready(max(0.001, deadline - loop.time()))

    async def wait_exit_reason(self, timeout: float) -> str | None:
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), timeout)
        except TimeoutError:
            return None
        return self.exit_reason

    async def terminate(self, grace_s: float) -> None:
        """Delete the pod (SIGTERM, the worker drains; SIGKILL after ``grace_s``).

        A pod that already ended is deleted too: failed pods otherwise stay in the API.
        """
        api = self._executor.core_api
        try:
            await _call(
                f"delete pod {self.pod_name}",
                api.delete_namespaced_pod,
                self.pod_name,
                self._executor.namespace,
                grace_period_seconds=int(grace_s),
            )
        except NotFound:
            self._end("pod was deleted")
        await asyncio.wait_for(asyncio.shield(self._ended), grace_s + 30.0)
        self._watch.cancel()
        await self.close_connection()


class KubernetesExecutor:
    name = "kubernetes"

    def __init__(
        self,
        settings: KubernetesExecutorSettings | None = None,
        *,
        api_client: Any = None,
        **options: Any,
    ) -> None:
        """No arguments: settings from ``TRIMS_K8S_*`` (see KubernetesExecutorSettings.from_env).

        ``api_client``: a configured ``kubernetes.client.ApiClient`` (default: in-cluster config,
        else the kubeconfig).
        """
        if settings is None:
            try:
                settings = (
                    KubernetesExecutorSettings(**options)
                    if options
                    else KubernetesExecutorSettings.from_env(os.environ)
                )
            except TypeError as e:
                raise ValidationError(f"kubernetes executor: {e}") from e
        self.settings = settings
        self.id = uuid.uuid4().hex[:12]
        self._api_client = api_client
        self._core: Any = None
        self._instances: dict[str, KubernetesInstance] = {}
        self._closed = False
        self.namespace = settings.namespace or _own_namespace()

    @property
    def instances(self) -> Sequence[Instance]:
        return tuple(self._instances.values())

    @property
    def core_api(self) -> Any:
        """The CoreV1Api, configured on first use (in-cluster, else the kubeconfig)."""
        if self._core is None and self._api_client is not None:
            from kubernetes import client

            self._core = client.CoreV1Api(self._api_client)
        if self._core is None:
            from kubernetes import client, config

            try:
                if self.settings.kubeconfig:
                    config.load_kube_config(config_file=self.settings.kubeconfig)
                else:
                    try:
                        config.load_incluster_config()
                    except config.ConfigException:
                        config.load_kube_config()
            except (config.ConfigException, OSError) as e:
                raise Unavailable(
                    f"kubernetes executor: no cluster configuration ({e}); run inside a pod "
                    "or set kubeconfig"
                ) from e
            self._core = client.CoreV1Api()
        return self._core

    def check(self, spec: FunctionSpec) -> None:
        """At deploy, only that the spec names no host environment: the code is in the image,
        which the pod runs as a non-root user (its securityContext); the kubelet reports what
        it cannot start."""
        refuse_environment(spec, self.name)

    def manifest(self, spec: FunctionSpec, instance_id: str) -> dict[str, Any]:
        return pod_manifest(
            spec, instance_id, self.settings, namespace=self.namespace, executor_id=self.id
        )

    async def start(self, spec: FunctionSpec, instance_id: str) -> Instance:
        if self._closed:
            raise ValidationError("kubernetes executor is closed; create a new one")
        if instance_id in self._instances:
            raise ValidationError(f"instance id {instance_id!r} is already in use")
        body = self.manifest(spec, instance_id)
        name = body["metadata"]["name"]
        await _call(
            f"create pod {name} for {spec.name}",
            self.core_api.create_namespaced_pod,
            self.namespace,
            body,
        )
        instance = KubernetesInstance(instance_id, spec, name, self)
        self._instances[instance_id] = instance
        log.debug("instance %s of %s: pod %s created", instance_id, spec.name, name)
        return instance

    async def stop(self, instance: Instance, grace_s: float = 10.0) -> None:
        await pop_managed(self._instances, instance, "kubernetes").terminate(grace_s)

    async def close(self) -> None:
        self._closed = True
        instances, self._instances = list(self._instances.values()), {}
        for instance, error in await terminate_all(instances, 5.0):
            log.warning("pod %s of %s could not be deleted: %s",
                        instance.pod_name, instance.function, error)  # fmt: skip
        if self._core is not None and self._api_client is None:
            self._core.api_client.close()
        self._core = None


def _own_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"
