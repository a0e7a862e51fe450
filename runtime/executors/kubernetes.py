"""The kubernetes executor: each function instance is a pod next to a trims daemon.

A pod runs ``trims worker --listen tcp:0.0.0.0:<port>`` and the gateway reaches it at its pod IP.
It is scheduled only onto nodes where a daemon pod runs (required pod affinity on the daemon's
labels, plus an optional node selector matching the DaemonSet's), and it gets that daemon's
store socket from the node through a hostPath mount of the socket file alone (the admin socket
beside it stays out of reach). Weights arrive as file descriptors over that socket, so the pod
needs no host IPC namespace.

Every pod runs as its function's own non-root uid (Note [one uid per function] in
:mod:`trims.runtime.executors.function_uids`: its name's, past the uids of the other functions
this executor runs) with all capabilities dropped, no privilege escalation, the runtime's
default seccomp profile and a read-only root filesystem; CPU, memory and GPU
(``nvidia.com/gpu``) requests and limits come from the spec. Labels (:data:`LABEL_EXECUTOR`, ...)
find the pods again; ``close()`` deletes every pod this executor made.

The pod objects come from :mod:`trims.runtime.kubernetes_objects` (plain dicts, no client call),
which the operator uses for its Deployments too. The client calls block, so they run in
threads; one watch per executor follows its pods (Note [one watch per executor]) and tells
each instance how its pod ended (``exit_reason`` from the container's terminated state:
OOMKilled, exit code, signal; or the pod's eviction, a failed init container, its deletion).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from trims.errors import (
    ErrorMap,
    NotFound,
    PermissionDenied,
    Timeout,
    Unavailable,
    ValidationError,
    error_for_status,
)
from trims.runtime.executors.base import (
    ExecutorBase,
    Instance,
    WorkerInstance,
    call_in_thread,
    refuse_environment,
)
from trims.runtime.executors.function_uids import FunctionUids
from trims.runtime.functions.spec import FunctionSpec
from trims.runtime.kubernetes_objects import (
    LABEL_EXECUTOR,
    RESERVED_UIDS,
    KubernetesExecutorSettings,
    pod_manifest,
)
from trims.runtime.worker.exits import describe_container_end

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Where a pod learns its namespace when the executor runs inside the cluster.
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


#: Waiting reasons a container does not recover from without a change to the pod or image.
FATAL_WAITING = frozenset(
    {"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"}
)


def describe_pod_end(pod: Mapping[str, Any], *, memory_limit: int | None) -> str | None:
    """Why a pod (as a dict) ended or can never start; None while it runs or may yet start.

    The pod's own verdict comes first where it says more than its containers: an eviction
    (the kubelet kills the worker, whose exit 137 would read "killed by SIGKILL") and a failed
    init container (a service mesh's, say: the worker never ran).
    """
    status = pod.get("status") or {}
    phase = status.get("phase")
    if phase == "Failed" and status.get("reason") == "Evicted":
        return f"pod evicted: {status.get('message') or 'no message'}"
    for cs in status.get("initContainerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if terminated and int(terminated.get("exitCode", 0)) != 0:
            return (
                f"init container {cs.get('name', '?')} failed with exit code "
                f"{terminated.get('exitCode')}: {terminated.get('message') or 'no message'}"
            )
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING:
            message = waiting.get("message") or "no message"
            return f"container cannot start: {waiting['reason']}: {message}"
        terminated = (cs.get("state") or {}).get("terminated")
        if not terminated:
            continue
        return describe_container_end(
            int(terminated.get("exitCode", -1)),
            oom_killed=terminated.get("reason") == "OOMKilled",
            memory_limit=memory_limit,
            init_text=str(terminated.get("message") or ""),
        )
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


@functools.cache
def _api_errors() -> tuple[ErrorMap, ...]:
    """The kubernetes client's errors as the trims errors that say what to do."""
    from kubernetes.client.exceptions import ApiException, OpenApiException
    from urllib3.exceptions import HTTPError

    def status_in(*codes: int) -> Callable[[Any], bool]:
        return lambda e: (e.status or 0) in codes

    return (
        ErrorMap(
            ApiException,
            PermissionDenied,
            "{action}: {detail}; grant the gateway's service account the chart's pod role",
            when=status_in(401, 403),
        ),
        ErrorMap(
            ApiException,
            ValidationError,
            "{action}: the API server rejected it: {detail}",
            when=status_in(400, 422),
        ),
        ErrorMap(ApiException, lambda e: error_for_status(e.status), when=status_in(404, 409)),
        ErrorMap(ApiException, Unavailable, "{action}: API server error {detail}"),
        ErrorMap(
            (OpenApiException, HTTPError, OSError),
            Unavailable,
            "{action}: cannot reach the Kubernetes API server ({detail})",
        ),
    )


def _api_message(error: Any) -> str:
    """What the API server said (its JSON ``message``), with the status for a server error."""
    try:
        message = str(json.loads(error.body).get("message") or error.reason)
    except (TypeError, ValueError, AttributeError):
        message = str(getattr(error, "reason", None) or error)
    status = getattr(error, "status", None)
    return f"{status}: {message}" if status and status >= 500 else message


async def _call(action: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking client call in a thread, translating its errors."""
    return await call_in_thread(action, _api_errors(), fn, *args, detail=_api_message, **kwargs)


class KubernetesInstance(WorkerInstance):
    """One pod; the executor's pod watch tells it how the pod is doing and why it ended."""

    exit_reason: str | None

    def __init__(
        self,
        instance_id: str,
        spec: FunctionSpec,
        pod_name: str,
        executor: KubernetesExecutor,
        uid: int,
    ) -> None:
        super().__init__(instance_id, spec.name, "kubernetes")
        self.spec = spec
        self.pod_name = pod_name
        #: The uid the pod runs as (Note [one uid per function]).
        self.uid = uid
        self.pod_ip: str | None = None
        #: Why the scheduler has not placed the pod yet (None once it is placed).
        self.pending: str | None = None
        self._executor = executor
        self._memory_limit = (
            None
            if spec.resources.memory_bytes is None
            else spec.resources.memory_bytes + executor.settings.memory_overhead_bytes
        )
        self._scheduled = asyncio.Event()

    def update(self, pod: Mapping[str, Any]) -> None:
        """The pod as the API server last saw it (a dict): its IP, why it waits, its end."""
        self.pending = pending_reason(pod)
        ip = (pod.get("status") or {}).get("podIP")
        if ip and self.pod_ip is None:
            self.pod_ip = ip
            self._scheduled.set()
        reason = describe_pod_end(pod, memory_limit=self._memory_limit)
        if reason is not None:
            self._end(reason)

    def _end(self, reason: str) -> None:
        super()._end(reason)
        self._scheduled.set()

    def address(self) -> str:
        return f"tcp:{self.pod_ip}:{self._executor.settings.port}"

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
        await self.close_connection()


class KubernetesExecutor(ExecutorBase[KubernetesInstance]):
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
        super().__init__()
        self._uids = FunctionUids(settings.uid_base, settings.uid_count)
        self.namespace = settings.namespace or _own_namespace()
        #: pod name -> instance, for the watch's events.
        self._by_pod: dict[str, KubernetesInstance] = {}
        #: pod name -> its last watch event's pod (None: deleted), for pods whose create call
        #: has not returned yet: the watch can report a pod before that, and its instance
        #: would otherwise miss the event (its IP, say) until the next relist. ``start`` takes
        #: the entry; only a create that failed on the client after the pod was made leaves one.
        self._early: dict[str, Mapping[str, Any] | None] = {}
        self._watch: _PodWatch | None = None

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

    def manifest(self, spec: FunctionSpec, instance_id: str, uid: int) -> dict[str, Any]:
        return pod_manifest(
            spec, instance_id, self.settings, namespace=self.namespace, executor_id=self.id, uid=uid
        )

    def _running(self) -> list[tuple[str, int]]:
        return [(i.function, i.uid) for i in self._instances.values()]

    async def start(self, spec: FunctionSpec, instance_id: str) -> Instance:
        self._check_start(instance_id)
        with self._uids.starting(spec.name, instance_id, self._running(), RESERVED_UIDS) as uid:
            body = self.manifest(spec, instance_id, uid)
            name = body["metadata"]["name"]
            await _call(
                f"create pod {name} for {spec.name}",
                self.core_api.create_namespaced_pod,
                self.namespace,
                body,
            )
            instance = self._track(KubernetesInstance(instance_id, spec, name, self, uid))
        self._by_pod[name] = instance
        if name in self._early:
            early = self._early.pop(name)
            if early is None:
                instance._end("pod was deleted")
            else:
                instance.update(early)
        if self._watch is None:
            self._watch = _PodWatch(self, asyncio.get_running_loop())
        log.debug("instance %s of %s: pod %s created (uid %d)", instance_id, spec.name, name, uid)
        return instance

    def _pod_event(self, kind: str, pod: Mapping[str, Any]) -> None:
        """One watch event (in the loop): the pod's instance learns of it, at once or, for a
        pod whose create call has not returned yet, when ``start`` has its instance."""
        name = str((pod.get("metadata") or {}).get("name", ""))
        instance = self._by_pod.get(name)
        if instance is None:
            self._early[name] = None if kind == "DELETED" else pod
            return
        if kind == "DELETED":
            instance._end("pod was deleted")
            self._by_pod.pop(name, None)
        else:
            instance.update(pod)

    def _pods_listed(self, names: frozenset[str]) -> None:
        """A fresh list of this executor's pods (in the loop): an instance whose pod is not in
        it was deleted while no watch was open."""
        for name, instance in list(self._by_pod.items()):
            if name not in names:
                instance._end("pod was deleted")
                self._by_pod.pop(name, None)

    async def _stop_failed(self, instance: KubernetesInstance, error: BaseException) -> None:
        log.warning("pod %s of %s could not be deleted: %s",
                    instance.pod_name, instance.function, error)  # fmt: skip

    async def _release(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._by_pod.clear()
        self._early.clear()
        if self._core is not None and self._api_client is None:
            self._core.api_client.close()
        self._core = None


class _PodWatch:
    """Note [one watch per executor]: the pods of one executor (label ``trims.io/executor``)
    are followed by one list + watch on the API server, in a thread (the client blocks), not
    one poll per pod. Each round lists the pods (an instance whose pod is missing was deleted
    while no watch was open), then watches from the list's resourceVersion until the server
    ends the watch (``timeoutSeconds``) or it fails; failures back off from 0.2 s to 5 s.
    Events reach the executor in its event loop (``call_soon_threadsafe``)."""

    #: Seconds a watch stays open before the server ends it and a new round starts.
    WATCH_S = 60
    BACKOFF_S = (0.2, 5.0)

    def __init__(self, executor: KubernetesExecutor, loop: asyncio.AbstractEventLoop) -> None:
        self._executor = executor
        self._loop = loop
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kubernetes-pod-watch-{executor.id}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """End the watch (the thread leaves at its next event or when the stream closes)."""
        self._stopped.set()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        from kubernetes import watch

        ex = self._executor
        api = ex.core_api
        selector = f"{LABEL_EXECUTOR}={ex.id}"
        backoff = self.BACKOFF_S[0]
        while not self._stopped.is_set():
            try:
                listed = api.list_namespaced_pod(ex.namespace, label_selector=selector)
                data = api.api_client.sanitize_for_serialization(listed)
                for pod in data.get("items") or []:
                    self._post(ex._pod_event, "MODIFIED", pod)
                names = frozenset(p["metadata"]["name"] for p in data.get("items") or [])
                self._post(ex._pods_listed, names)
                version = (data.get("metadata") or {}).get("resourceVersion")
                w = watch.Watch()
                for event in w.stream(
                    api.list_namespaced_pod, ex.namespace, label_selector=selector,
                    resource_version=version, timeout_seconds=self.WATCH_S,
                ):  # fmt: skip
                    if self._stopped.is_set():
                        w.stop()
                        break
                    pod = api.api_client.sanitize_for_serialization(event["object"])
                    self._post(ex._pod_event, str(event["type"]), pod)
                backoff = self.BACKOFF_S[0]
            except Exception as e:  # the API server's trouble: retried, the executor goes on
                if self._stopped.is_set():
                    return
                log.warning("watching the pods of executor %s: %s; again in %.1f s",
                            ex.id, e, backoff)  # fmt: skip
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, self.BACKOFF_S[1])


def _own_namespace() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"
