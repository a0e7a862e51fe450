"""The kubernetes executor's pods, checked against the official Kubernetes schemas.

No cluster is reachable here: every Pod the executor would create is validated with
kubernetes-validate (strict: unknown fields fail), and its scheduling, mounts and security
settings are checked field by field.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.fixtures.net import free_port
from trims.config import format_size
from trims.errors import Unavailable, UpstreamError, ValidationError
from trims.runtime.executors.kubernetes import describe_pod_end, pending_reason
from trims.runtime.functions.spec import WORKER_ENV_DEFAULTS, FunctionSpec, parse_spec
from trims.runtime.kubernetes_objects import (
    CONTAINER_STORE_SOCKET,
    DAEMON_POD_LABELS,
    LABEL_EXECUTOR,
    LABEL_FUNCTION,
    RUNTIME_UID,
    KubernetesExecutorSettings,
    dns_name,
    function_pod_template,
    pod_manifest,
)

kubernetes_validate = pytest.importorskip("kubernetes_validate")

KUBE_VERSION = "1.30.0"

SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"name": "echo", "handler": "handler:handler"},
    "limits": {
        "name": "resnet",
        "image": "registry.example/resnet:1",
        "handler": "handler:handler",
        "resources": {"cpus": 1.5, "memory_bytes": 512 << 20, "gpus": 1},
    },
    "models_env": {
        "name": "embed",
        "handler": "handler:handler",
        "code_dir": "/srv/code",
        "models": [{"name": "minilm", "framework": "torch"}],
        "env": {"OMP_NUM_THREADS": "1"},
        "config": {"top_k": 5},
    },
}


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("case", sorted(SPECS))
def test_pod_is_valid_and_confined(case: str) -> None:
    spec = parse_spec(SPECS[case])
    settings = KubernetesExecutorSettings(node_selector={"trims.io/node": "true"})
    pod = pod_manifest(spec, "Inst_1", settings, namespace="fns", executor_id="abc123")
    validate(pod)

    meta, pod_spec = pod["metadata"], pod["spec"]
    assert meta["name"] == dns_name("trims", spec.name, "Inst_1") == f"trims-{spec.name}-inst-1"
    assert meta["labels"][LABEL_FUNCTION] == spec.name
    assert meta["labels"][LABEL_EXECUTOR] == "abc123"
    assert pod_spec["restartPolicy"] == "Never"
    assert pod_spec["automountServiceAccountToken"] is False
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["securityContext"]["runAsUser"] != 0
    assert pod_spec["securityContext"]["supplementalGroups"] == [settings.store_group]
    assert pod_spec.get("hostIPC") is not True and pod_spec.get("hostNetwork") is not True
    (container,) = pod_spec["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["readOnlyRootFilesystem"] is True

    # Scheduled only where a daemon runs, with the daemon's socket file (not its directory).
    assert pod_spec["nodeSelector"] == {"trims.io/node": "true"}
    (term,) = pod_spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == dict(DAEMON_POD_LABELS)
    assert term["topologyKey"] == "kubernetes.io/hostname"
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["store-socket"]["hostPath"] == {"path": settings.store_socket, "type": "Socket"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["store-socket"] == CONTAINER_STORE_SOCKET

    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    args = container["args"]
    assert args[:3] == ["worker", "--listen", f"tcp:0.0.0.0:{settings.port}"]
    spec_json = args[args.index("--spec-json") + 1]
    assert parse_spec(json.loads(spec_json)) == spec
    assert args[args.index("--instance-id") + 1] == "Inst_1"


def _pod_ids(pod: dict[str, Any]) -> tuple[int, int]:
    context = pod["spec"]["securityContext"]
    return context["runAsUser"], context["runAsGroup"]


def test_each_function_runs_as_its_own_uid_and_group() -> None:
    """Note [one uid per function]: the store's per-uid limits tell functions apart; the
    uid comes from the name, so the operator's Deployments get the executor's."""
    settings = KubernetesExecutorSettings()
    pods = {
        case: pod_manifest(parse_spec(SPECS[case]), "i1", settings, namespace="f", executor_id="e")
        for case in sorted(SPECS)
    }
    for pod in pods.values():
        validate(pod)
    ids = {case: _pod_ids(pod) for case, pod in pods.items()}
    assert len(set(ids.values())) == len(SPECS)
    for uid, gid in ids.values():
        assert uid == gid and settings.uid_base <= uid < settings.uid_base + settings.uid_count
        assert uid not in (0, RUNTIME_UID)
    again = pod_manifest(
        parse_spec(SPECS["minimal"]), "i2", settings, namespace="f", executor_id="x"
    )
    assert _pod_ids(again) == ids["minimal"]
    template = function_pod_template(parse_spec(SPECS["minimal"]), settings, labels={})
    assert _pod_ids(template) == ids["minimal"]
    # the chart's own uid (the daemon's) is never a function's, even inside the range
    narrow = KubernetesExecutorSettings(uid_base=RUNTIME_UID, uid_count=2)
    for case in SPECS:
        pod = pod_manifest(parse_spec(SPECS[case]), "i1", narrow, namespace="f", executor_id="e")
        assert _pod_ids(pod) == (RUNTIME_UID + 1, RUNTIME_UID + 1)


def test_resources_become_requests_and_limits() -> None:
    spec = parse_spec(SPECS["limits"])
    settings = KubernetesExecutorSettings(memory_overhead_bytes=256 << 20)
    pod = pod_manifest(spec, "r1", settings, namespace="fns", executor_id="e")
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/resnet:1"
    assert container["resources"] == {
        "requests": {"cpu": "1500m", "memory": "768Mi", "nvidia.com/gpu": "1"},
        "limits": {"cpu": "1500m", "memory": "768Mi", "nvidia.com/gpu": "1"},
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]


def test_openmp_threads_wait_passively_unless_the_spec_says_otherwise() -> None:
    """Note [passive OpenMP threads]: the default, which the spec's env overrides."""
    settings = KubernetesExecutorSettings()

    def env_of(doc: dict[str, Any]) -> dict[str, str]:
        pod = pod_manifest(parse_spec(doc), "i1", settings, namespace="fns", executor_id="x")
        return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}

    assert env_of(SPECS["models_env"])["OMP_WAIT_POLICY"] == "PASSIVE"
    chosen = {**SPECS["models_env"], "env": {"OMP_WAIT_POLICY": "ACTIVE"}}
    assert env_of(chosen)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_settings_from_the_chart_environment() -> None:
    settings = KubernetesExecutorSettings.from_env(
        {
            "TRIMS_K8S_NAMESPACE": "trims",
            "TRIMS_K8S_IMAGE": "trims-runtime:1",
            "TRIMS_K8S_STORE_SOCKET": "/run/x/store.sock",
            "TRIMS_K8S_STORE_GROUP": "2000",
            "TRIMS_K8S_NODE_SELECTOR": '{"trims.io/node": "true"}',
            "TRIMS_K8S_PORT": "7171",
            "TRIMS_K8S_MEMORY_OVERHEAD": "128Mi",
            "TRIMS_K8S_UID_BASE": "300000",
            "TRIMS_K8S_UID_COUNT": "1000",
        }
    )
    assert (settings.uid_base, settings.uid_count) == (300_000, 1000)
    assert settings.namespace == "trims" and settings.image == "trims-runtime:1"
    assert (settings.store_socket, settings.store_group, settings.port) == (
        "/run/x/store.sock",
        2000,
        7171,
    )
    assert dict(settings.node_selector) == {"trims.io/node": "true"}
    assert settings.memory_overhead_bytes == 128 << 20
    with pytest.raises(ValidationError, match="TRIMS_K8S_NODE_SELECTOR"):
        KubernetesExecutorSettings.from_env({"TRIMS_K8S_NODE_SELECTOR": "[1]"})
    with pytest.raises(ValidationError, match="TRIMS_K8S_PORT"):
        KubernetesExecutorSettings.from_env({"TRIMS_K8S_PORT": "http"})


def _pod(state: dict[str, Any] | None, phase: str = "Running", **status: Any) -> dict[str, Any]:
    statuses = [] if state is None else [{"name": "worker", "state": state}]
    return {"status": {"phase": phase, "containerStatuses": statuses, **status}}


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        (_pod({"running": {}}), None),
        (_pod(None, phase="Pending"), None),
        (
            _pod({"terminated": {"reason": "OOMKilled", "exitCode": 137}}, "Failed"),
            "out of memory (container limit 64.0 MiB)",
        ),
        (_pod({"terminated": {"reason": "Error", "exitCode": 139}}, "Failed"), "killed by SIGSEGV"),
        (
            _pod({"terminated": {"exitCode": 113, "message": "init failed: no GPU"}}, "Failed"),
            "init failed: no GPU",
        ),
        (
            _pod(None, "Failed", reason="Evicted", message="node low on memory"),
            "pod evicted: node low on memory",
        ),
        (_pod({"terminated": {"exitCode": 0}}, "Succeeded"), "exited with code 0"),
        (
            _pod(
                {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}, "Pending"
            ),
            "container cannot start: ImagePullBackOff: no such image",
        ),
        (_pod({"waiting": {"reason": "ContainerCreating"}}, "Pending"), None),
    ],
)
def test_pod_end_in_words(pod: dict[str, Any], reason: str | None) -> None:
    described = describe_pod_end(pod, memory_limit=64 << 20)
    if reason is None:
        assert described is None
    else:
        assert described is not None and described.startswith(reason)


def test_unschedulable_pod_says_why() -> None:
    pod = _pod(None, "Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 node(s) didn't match pod affinity rules."},
    ])  # fmt: skip
    assert pending_reason(pod) == (
        "Unschedulable: 0/3 nodes are available: 3 node(s) didn't match pod affinity rules."
    )
    assert pending_reason(_pod({"running": {}})) is None


def test_names_are_dns_labels() -> None:
    name = dns_name("trims", "A" * 80, "x_y")
    assert len(name) <= 63 and name == name.lower() and "_" not in name
    assert not name.endswith("-")


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValidationError, match="image_pull_policy"):
        KubernetesExecutorSettings(image_pull_policy="Sometimes")
    with pytest.raises(ValidationError, match="port"):
        KubernetesExecutorSettings(port=0)
    with pytest.raises(ValidationError, match="uid_base 0"):
        KubernetesExecutorSettings(uid_base=0)


# -- the executor through the real kubernetes client, against tests/fixtures/kube_api.py ---------


def _executor(kube_api: Any, **options: Any) -> Any:
    from trims.runtime.executors.kubernetes import KubernetesExecutor

    settings = KubernetesExecutorSettings(namespace="fns", port=free_port(), **options)
    return KubernetesExecutor(settings, api_client=kube_api.api_client())


async def test_instance_runs_in_a_pod_answers_and_is_deleted(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor = _executor(kube_api)
    spec = make_function(
        """
        import os

        def handler(request, ctx):
            return {"body": request.text(), "socket": os.environ["TRIMS_SOCKET"]}
        """,
        name="echo",
    )
    instance = await executor.start(spec, "echo-1")
    await instance.wait_ready(60)
    assert instance.address().startswith("tcp:127.0.0.")
    reply = await instance.invoke(b"hi", {}, timeout=30, trace={})
    assert json.loads(reply.body) == {"body": "hi", "socket": CONTAINER_STORE_SOCKET}
    assert instance.alive()
    created = kube_api.pods[("fns", "trims-echo-echo-1")].body
    validate(created)
    await executor.stop(instance, grace_s=5)
    assert not instance.alive()
    assert instance.exit_reason in ("pod was deleted", "exited with code 0")
    # the watch can report the worker's exit before the API drops the deleted pod
    assert kube_api.wait_pods_gone() == {}
    await executor.close()


async def test_functions_an_executor_runs_at_once_never_share_a_uid(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    """Two uids in the range: two functions take both, a third gets none; the instances of
    one function share its uid."""
    executor = _executor(kube_api, uid_base=400_000, uid_count=2)
    try:
        instances = [
            await executor.start(make_function(UP, name="first"), "first-1"),
            await executor.start(make_function(UP, name="first"), "first-2"),
            await executor.start(make_function(UP, name="second"), "second-1"),
        ]
        for instance in instances:  # the executor's watch has seen each pod: close() is quick
            await instance.wait_ready(20)
        uids = {
            name: _pod_ids(kube_api.pods[("fns", f"trims-{name}")].body)[0]
            for name in ("first-first-1", "first-first-2", "second-second-1")
        }
        assert uids["first-first-1"] == uids["first-first-2"] != uids["second-second-1"]
        assert set(uids.values()) == {400_000, 400_001}
        with pytest.raises(Unavailable, match="raise uid_count"):
            await executor.start(make_function(UP, name="third"), "third-1")
        assert ("fns", "trims-third-third-1") not in kube_api.pods
    finally:
        await executor.close()


async def test_a_pod_the_watch_reports_before_its_create_call_returns_gets_its_ip(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    """The executor's watch can see a pod (ADDED, with its IP) before the create call that
    made it returns; that event reaches the instance, which does not wait for the relist a
    watch round (60 s) later."""
    executor = _executor(kube_api)
    try:
        instances = [
            await executor.start(make_function(UP, name=f"quick{n}"), f"quick{n}-1")
            for n in range(4)
        ]
        for instance in instances:
            await instance.wait_ready(20)
    finally:
        await executor.close()


async def test_a_pod_gets_nothing_of_the_gateways_environment(
    kube_api: Any, make_function: Callable[..., FunctionSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 41, finding 2: a pod's env is the defaults, the settings' and the spec's env and
    the store socket's path; the gateway's tokens never reach it."""
    monkeypatch.setenv("TRIMS_GATEWAY_TOKENS", "admin-secret:admin")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "gateway-only")
    executor = _executor(kube_api, env={"FROM_SETTINGS": "1"})
    try:
        await executor.start(make_function(UP, name="env", env={"FROM_SPEC": "2"}), "env-1")
        body = kube_api.pods[("fns", "trims-env-env-1")].body
        validate(body)
        (container,) = body["spec"]["containers"]
        assert {e["name"] for e in container["env"]} == {
            *WORKER_ENV_DEFAULTS,
            "FROM_SETTINGS",
            "FROM_SPEC",
            "TRIMS_SOCKET",
        }
    finally:
        await executor.close()


async def test_crashed_pod_reports_why(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor = _executor(kube_api)
    spec = make_function(
        """
        import os, signal

        def handler(request, ctx):
            os.kill(os.getpid(), signal.SIGSEGV)
        """,
        name="crash",
    )
    instance = await executor.start(spec, "crash-1")
    await instance.wait_ready(60)
    with pytest.raises(UpstreamError, match="crash-1 of crash died: killed by SIGSEGV"):
        await instance.invoke(b"", {}, timeout=30, trace={})
    await executor.close()
    assert kube_api.pods == {}


async def test_init_failure_reaches_wait_ready(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor = _executor(kube_api)
    spec = make_function(
        """
        def init(ctx):
            raise RuntimeError("weights missing")

        def handler(request, ctx):
            return b""
        """,
        name="badinit",
    )
    instance = await executor.start(spec, "badinit-1")
    with pytest.raises(UpstreamError, match="weights missing"):
        await instance.wait_ready(60)
    await executor.close()


async def test_api_errors_become_trims_errors(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    from trims.errors import AlreadyExists, NotFound

    executor = _executor(kube_api)
    spec = make_function("def handler(request, ctx):\n    return b''\n", name="dup")
    first = await executor.start(spec, "dup-1")
    other = _executor(kube_api)
    with pytest.raises(AlreadyExists, match="pod trims-dup-dup-1"):
        await other.start(spec, "dup-1")
    await executor.close()
    with pytest.raises(NotFound):
        await other.stop(first)
    await other.close()


# -- how the node ends a pod, as the fake kubelet reports it, in the executor's words ----------

UP = "def handler(request, ctx):\n    return b'up'\n"
MEMORY = 64 << 20


async def _running(
    kube_api: Any,
    make_function: Callable[..., FunctionSpec],
    name: str,
    code: str = UP,
    **spec: Any,
) -> tuple[Any, Any, str]:
    """A ready instance of ``name``, its executor and its pod's name."""
    executor = _executor(kube_api)
    instance = await executor.start(make_function(code, name=name, **spec), f"{name}-1")
    await instance.wait_ready(60)
    return executor, instance, f"trims-{name}-{name}-1"


async def test_an_oom_killed_pod_says_out_of_memory_with_its_limit(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor, instance, pod = await _running(
        kube_api, make_function, "big", resources={"memory_bytes": MEMORY}
    )
    kube_api.oom_kill("fns", pod)
    limit = MEMORY + executor.settings.memory_overhead_bytes
    with pytest.raises(UpstreamError) as e:
        await instance.invoke(b"", {}, timeout=30, trace={})
    assert e.value.message == (
        f"instance big-1 of big died: out of memory (container limit {format_size(limit)}): "
        "the kernel OOM-killed the container"
    )
    await executor.close()
    assert kube_api.pods == {}


async def test_a_sigkill_from_outside_is_named_and_hints_at_the_memory_limit(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor, instance, pod = await _running(
        kube_api, make_function, "capped", resources={"memory_bytes": MEMORY}
    )
    kube_api.kill("fns", pod, signal.SIGKILL)
    with pytest.raises(
        UpstreamError, match=r"capped died: killed by SIGKILL \(possibly out of mem"
    ):
        await instance.invoke(b"", {}, timeout=30, trace={})
    assert instance.exit_reason.startswith("killed by SIGKILL")
    await executor.close()


async def test_a_signal_without_a_memory_limit_is_just_named(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor, instance, pod = await _running(kube_api, make_function, "plain")
    kube_api.kill("fns", pod, signal.SIGKILL)
    with pytest.raises(UpstreamError) as e:
        await instance.invoke(b"", {}, timeout=30, trace={})
    assert e.value.message == "instance plain-1 of plain died: killed by SIGKILL"
    await executor.close()


async def test_an_exit_code_is_reported_as_is(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    code = "import os\n\ndef handler(request, ctx):\n    os._exit(3)\n"
    executor, instance, _ = await _running(kube_api, make_function, "quits", code)
    with pytest.raises(UpstreamError) as e:
        await instance.invoke(b"", {}, timeout=30, trace={})
    assert e.value.message == "instance quits-1 of quits died: exited with code 3"
    await executor.close()


async def test_an_evicted_pod_says_evicted_with_the_kubelets_message(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    executor, instance, pod = await _running(kube_api, make_function, "evicted")
    message = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 42Mi."
    try:
        kube_api.evict("fns", pod, message)
        with pytest.raises(UpstreamError) as e:
            await instance.invoke(b"", {}, timeout=30, trace={})
        assert e.value.message == f"instance evicted-1 of evicted died: pod evicted: {message}"
    finally:
        await executor.close()


async def test_an_image_that_cannot_be_pulled_fails_the_start_with_the_pull_error(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    image = "registry.example/missing:1"
    kube_api.image_pull_errors[image] = f'rpc error: pull access denied for "{image}"'
    executor = _executor(kube_api)
    instance = await executor.start(make_function(UP, name="nopull", image=image), "nopull-1")
    with pytest.raises(UpstreamError) as e:
        await instance.wait_ready(60)
    assert e.value.message == (
        "instance nopull-1 of nopull died: container cannot start: ImagePullBackOff: "
        f'rpc error: pull access denied for "{image}"'
    )
    await executor.close()
    assert kube_api.pods == {}


async def test_a_failed_init_container_is_named_with_its_message(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    kube_api.init_container_failure = ("mesh-init", 1, "iptables: permission denied")
    executor = _executor(kube_api)
    instance = await executor.start(make_function(UP, name="meshed"), "meshed-1")
    try:
        with pytest.raises(UpstreamError) as e:
            await instance.wait_ready(60)
        assert "mesh-init" in e.value.message
        assert "iptables: permission denied" in e.value.message
    finally:
        await executor.close()


async def test_a_pod_deleted_behind_the_executors_back_ends_its_instance(
    kube_api: Any, make_function: Callable[..., FunctionSpec]
) -> None:
    """The executor's one pod watch (no poll per pod) sees the deletion and ends the instance;
    a second instance of the same executor is untouched."""
    executor, first, pod = await _running(kube_api, make_function, "gone")
    second = await executor.start(make_function(UP, name="kept"), "kept-1")
    try:
        await second.wait_ready(60)
        with kube_api._lock:
            deleted = kube_api.pods.pop(("fns", pod))
        deleted.stop(0)
        assert await first.wait_exit_reason(30) in ("pod was deleted", "killed by SIGTERM")
        assert not first.alive() and second.alive()
    finally:
        await executor.close()
