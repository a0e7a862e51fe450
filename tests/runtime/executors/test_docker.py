"""The docker executor against a real Docker Engine and the real runtime image.

Each test starts real containers from the image built by dockerfiles/build-image.sh; the
``docker_executor`` fixture fails a test that leaves a container behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.gateway import RunningGateway
from trims.errors import NotFound, Unavailable, UpstreamError, ValidationError
from trims.runtime.executors.base import Instance
from trims.runtime.executors.docker import (
    CONTAINER_STORE_SOCKET,
    LABEL_EXECUTOR,
    LABEL_FUNCTION,
    LABEL_INSTANCE,
    LABEL_OWNER,
    DockerExecutor,
    DockerInstance,
    describe_container_exit,
    remove_orphans,
)
from trims.runtime.executors.function_uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT
from trims.runtime.functions.spec import WORKER_ENV_DEFAULTS, FunctionSpec, load_spec_file

pytestmark = pytest.mark.docker

MakeFunction = Callable[..., FunctionSpec]
MakeExecutor = Callable[..., DockerExecutor]
READY = 60.0
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

ECHO = """
import os

def handler(request, ctx):
    return {"body": request.text(), "uid": os.getuid()}
"""


async def _call(instance: Instance, body: bytes = b"") -> Any:
    reply = await instance.invoke(body, {}, timeout=30, trace={})
    assert reply.status == 200, reply.body
    return json.loads(reply.body)


async def test_echo_runs_confined_in_a_container_and_is_removed_on_stop(
    docker_executor: MakeExecutor, make_function: MakeFunction, docker_client: Any
) -> None:
    executor = docker_executor()
    spec = make_function(ECHO, name="echo", resources={"cpus": 0.5, "memory_bytes": 64 << 20})
    instance = await executor.start(spec, "echo-1")
    assert isinstance(instance, DockerInstance)
    await instance.wait_ready(READY)
    uid, gid = executor.ids_for("echo")
    assert uid == gid and DEFAULT_UID_BASE <= uid < DEFAULT_UID_BASE + DEFAULT_UID_COUNT
    assert await _call(instance, b"hi") == {"body": "hi", "uid": uid}
    assert instance.alive() and instance.exit_reason is None

    attrs = docker_client.containers.get(instance.container_id).attrs
    host = attrs["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == (64 << 20) + executor.settings.memory_overhead_bytes
    assert host["MemorySwap"] == host["Memory"]
    assert host["NetworkMode"] == "none"
    assert host["CapDrop"] == ["ALL"]
    assert host["ReadonlyRootfs"] is True
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["IpcMode"] != "host"
    assert attrs["Config"]["User"] == f"{uid}:{gid}"
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL_EXECUTOR] == executor.id
    assert (labels[LABEL_FUNCTION], labels[LABEL_INSTANCE]) == ("echo", "echo-1")

    await executor.stop(instance, grace_s=5)
    assert not instance.alive()
    assert instance.exit_reason == "exited with code 0"
    filters = {"label": f"{LABEL_INSTANCE}=echo-1"}
    assert docker_client.containers.list(all=True, filters=filters) == []
    assert not instance.socket_dir.exists()


WHOAMI = """
import os

def handler(request, ctx):
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    try:
        os.setuid(0)
        setuid = "allowed"
    except PermissionError:
        setuid = "refused"
    return {"uids": os.getresuid(), "setuid": setuid,
            "cap_eff": int(status["CapEff"].strip(), 16),
            "cap_prm": int(status["CapPrm"].strip(), 16),
            "no_new_privs": int(status["NoNewPrivs"].strip())}
"""


async def test_function_code_in_a_container_cannot_regain_root(
    docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    executor = docker_executor()
    spec = make_function(WHOAMI, name="whoami")
    executor.check(spec)
    instance = await executor.start(spec, "whoami-1")
    await instance.wait_ready(READY)
    got = await _call(instance)
    await executor.stop(instance, grace_s=5)
    assert 0 not in got["uids"] and got["setuid"] == "refused"
    assert (got["cap_eff"], got["cap_prm"], got["no_new_privs"]) == (0, 0, 1)


async def test_the_echo_example_answers_from_a_container(docker_executor: MakeExecutor) -> None:
    spec = load_spec_file(EXAMPLES / "echo" / "function.yaml")
    executor = docker_executor()
    instance = await executor.start(spec, "example-echo")
    await instance.wait_ready(READY)
    reply = await instance.invoke(b"\x00bytes\xff", {"content-type": "x/y"}, timeout=30, trace={})
    assert (reply.status, reply.body, reply.headers["content-type"]) == (
        200,
        b"\x00bytes\xff",
        "x/y",
    )
    await executor.stop(instance, grace_s=5)


async def test_model_comes_from_the_daemon_over_the_mounted_socket(
    start_daemon: Callable[..., Any], docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    weights = np.arange(4096, dtype=np.float32)
    daemon = start_daemon(models={"vec": {"w": weights}})
    executor = docker_executor(store_socket=daemon.socket)
    spec = make_function(
        """
        import os

        def handler(request, ctx):
            model = ctx.models["vec"]
            return {"sum": float(model.numpy()["w"].sum()), "via": model.via,
                    "socket": os.environ["TRIMS_SOCKET"]}
        """,
        name="vec",
        models=[{"name": "vec"}],
    )
    instance = await executor.start(spec, "vec-1")
    await instance.wait_ready(READY)
    answer = await _call(instance)
    assert answer == {"sum": float(weights.sum()), "via": "store", "socket": CONTAINER_STORE_SOCKET}
    assert daemon.request("stats")["result"]["leases"] >= 1
    await executor.stop(instance, grace_s=5)


async def test_crash_mid_request_reports_the_signal(
    docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    executor = docker_executor()
    spec = make_function(
        """
        import os, signal

        def handler(request, ctx):
            os.kill(os.getpid(), signal.SIGSEGV)
        """,
        name="crash",
    )
    instance = await executor.start(spec, "crash-1")
    await instance.wait_ready(READY)
    with pytest.raises(UpstreamError, match="crash-1 of crash died: killed by SIGSEGV"):
        await instance.invoke(b"", {}, timeout=30, trace={})
    assert instance.exit_reason == "killed by SIGSEGV"
    assert not instance.alive()
    await executor.stop(instance, grace_s=5)


async def test_allocating_past_the_memory_limit_is_reported_as_out_of_memory(
    docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    executor = docker_executor()
    spec = make_function(
        """
        def handler(request, ctx):
            hog = bytearray(1 << 30)
            return str(len(hog))
        """,
        name="hog",
        resources={"memory_bytes": 32 << 20},
    )
    instance = await executor.start(spec, "hog-1")
    await instance.wait_ready(READY)
    with pytest.raises(UpstreamError, match="out of memory"):
        await instance.invoke(b"", {}, timeout=30, trace={})
    await executor.stop(instance, grace_s=5)


async def test_the_kernel_oom_killer_is_reported_from_the_container_state(
    docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    """No overhead allowance: the cgroup limit bites before the worker's own address-space cap."""
    executor = docker_executor(memory_overhead_bytes=0)
    spec = make_function(
        """
        def handler(request, ctx):
            hog = bytearray(b"x") * (60 << 20)
            return str(len(hog))
        """,
        name="oom",
        resources={"memory_bytes": 64 << 20},
    )
    instance = await executor.start(spec, "oom-1")
    await instance.wait_ready(READY)
    with pytest.raises(UpstreamError, match=r"out of memory \(container limit 64\.0 MiB\)"):
        await instance.invoke(b"", {}, timeout=30, trace={})
    assert isinstance(instance, DockerInstance) and instance.state["OOMKilled"] is True
    await executor.stop(instance, grace_s=5)


async def test_init_failure_carries_the_reason(
    docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    executor = docker_executor()
    spec = make_function(
        """
        def init(ctx):
            raise RuntimeError("no GPU in this box")

        def handler(request, ctx):
            return b""
        """,
        name="badinit",
    )
    instance = await executor.start(spec, "badinit-1")
    with pytest.raises(UpstreamError, match="no GPU in this box"):
        await instance.wait_ready(READY)
    await executor.stop(instance, grace_s=5)


async def test_a_standby_container_runs_init_only_when_activated(
    docker_executor: MakeExecutor, make_function: MakeFunction
) -> None:
    # Note [standby instances]: the container starts and its worker prepares ahead of need.
    executor = docker_executor()
    spec = make_function(
        """
        import os

        INITS = []

        def init(ctx):
            INITS.append(os.getpid())

        def handler(request, ctx):
            return {"inits": len(INITS)}
        """,
        name="standby",
    )
    instance = await executor.start_standby(spec, "standby-1")
    await instance.wait_standby(READY)
    with pytest.raises(Unavailable, match="not ready"):
        await instance.invoke(b"", {}, timeout=30, trace={})
    await instance.activate(READY)
    assert await _call(instance) == {"inits": 1}
    await executor.stop(instance, grace_s=5)


async def test_missing_image_is_not_found_with_the_fix(
    docker_executor: MakeExecutor, make_function: MakeFunction, docker_client: Any
) -> None:
    executor = docker_executor(image="trims-no-such-image:never")
    with pytest.raises(NotFound, match=r"build-image\.sh"):
        await executor.start(make_function(ECHO, name="ghost"), "ghost-1")
    assert executor.instances == ()
    filters = {"label": f"{LABEL_EXECUTOR}={executor.id}"}
    assert docker_client.containers.list(all=True, filters=filters) == []


def test_gpus_and_network_reach_the_container_request(
    make_function: MakeFunction, tmp_path: Any
) -> None:
    """Pure: the create() arguments, no engine needed (no GPU here to run them on)."""
    executor = DockerExecutor(network="bridge", store_socket=tmp_path / "absent.sock")
    spec = make_function(ECHO, name="gpu", resources={"gpus": 2, "cpus": 1})
    kwargs = executor.container_spec(spec, "gpu-1", tmp_path)
    (request,) = kwargs["device_requests"]
    assert (request["Count"], request["Capabilities"]) == (2, [["gpu"]])
    assert kwargs["network_mode"] == "bridge"
    assert kwargs["nano_cpus"] == 1_000_000_000
    assert kwargs["mem_limit"] is None
    assert kwargs["user"] != "0" and not kwargs["user"].startswith("0:")
    assert "--store-socket" not in kwargs["command"]


def test_a_worker_socket_path_too_long_for_unix_is_refused_with_the_fix(tmp_path: Any) -> None:
    """Pure: the worker socket is <state_dir>/<instance>/worker.sock; past 107 bytes bind()
    would fail inside the container and the gateway would only time out."""
    deep = tmp_path / ("d" * 90)
    executor = DockerExecutor(store_socket=tmp_path / "absent.sock", state_dir=deep)
    with pytest.raises(ValidationError, match="shorter state directory"):
        executor._socket_dir("an-instance-id-1", executor.ids_for("fn"))
    assert not (deep / "an-instance-id-1").exists()
    short = DockerExecutor(store_socket=tmp_path / "absent.sock", state_dir=tmp_path / "s")
    assert short._socket_dir("fn-1", short.ids_for("fn")).is_dir()


def test_root_user_is_refused() -> None:
    with pytest.raises(ValidationError, match="root"):
        DockerExecutor(user="0:0")


async def test_orphans_of_a_dead_executor_are_removed(
    docker_executor: MakeExecutor, make_function: MakeFunction, docker_client: Any
) -> None:
    mark = {"org.trims.test": uuid.uuid4().hex}
    crashed = docker_executor(labels=mark)
    instance = await crashed.start(make_function(ECHO, name="orphan"), "orphan-1")
    await instance.wait_ready(READY)
    live = docker_executor(labels=mark)
    kept = await live.start(make_function(ECHO, name="kept"), "kept-1")
    removed = remove_orphans(docker_client, live_executors=[live.id], labels=mark)
    assert [name.rsplit("-", 2)[-2:] for name in removed] == [["orphan", "1"]]
    assert kept.alive()
    with pytest.raises(UpstreamError, match="orphan-1 of orphan died"):
        await instance.invoke(b"", {}, timeout=30, trace={})


async def test_a_restarted_owner_removes_what_its_crashed_predecessor_left(
    docker_executor: MakeExecutor, make_function: MakeFunction, docker_client: Any
) -> None:
    owner = f"gw-{uuid.uuid4().hex[:8]}"
    crashed = docker_executor(owner=owner)
    left = await crashed.start(make_function(ECHO, name="left"), "left-1")
    neighbour = docker_executor(owner=f"{owner}-next-door")
    kept = await neighbour.start(make_function(ECHO, name="kept"), "kept-1")
    labels = docker_client.containers.get(left.container_id).labels
    assert labels[LABEL_OWNER] == owner

    restarted = docker_executor(owner=owner)
    # the first start sweeps: the predecessor's container goes, the neighbour's stays
    mine = await restarted.start(make_function(ECHO, name="mine"), "mine-1")
    assert not [c for c in docker_client.containers.list(all=True) if c.id == left.container_id]
    assert kept.alive() and mine.alive()
    assert await restarted.prepare() == []  # once per executor
    await mine.wait_ready(READY)
    assert (await _call(mine, b"ok"))["body"] == "ok"
    # without an owner, no container can be told from another gateway's: none is removed
    assert await docker_executor().prepare() == []
    assert kept.alive()


def test_owner_must_be_a_label_value() -> None:
    with pytest.raises(ValidationError, match="owner 'a b'"):
        DockerExecutor(owner="a b")


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ({"OOMKilled": True, "ExitCode": 137}, "out of memory (container limit 64.0 MiB)"),
        ({"ExitCode": 139}, "killed by SIGSEGV"),
        ({"ExitCode": 0}, "exited with code 0"),
        ({"ExitCode": 113}, "init failed: boom"),
    ],
)
def test_container_state_in_words(state: dict[str, Any], reason: str) -> None:
    logs = "starting\ninit failed: boom\n"
    assert describe_container_exit(state, memory_limit=64 << 20, logs=logs).startswith(reason)


@contextlib.asynccontextmanager
async def _docker_gateway(
    make_executor: MakeExecutor, store_socket: Path
) -> AsyncIterator[RunningGateway]:
    """A real gateway on 127.0.0.1 whose functions run in containers of ``make_executor``."""
    import aiohttp
    from aiohttp import web

    from trims.runtime.gateway.app import create_app
    from trims.runtime.settings import GatewaySettings

    settings = GatewaySettings(port=0, store_socket=store_socket, drain_timeout_s=5.0, auth=False)
    app = create_app(settings, lambda name: make_executor(store_socket=store_socket))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        async with aiohttp.ClientSession() as session:
            yield RunningGateway(f"http://127.0.0.1:{runner.addresses[0][1]}", app, session)
    finally:
        await runner.cleanup()


def _docker_spec(spec: FunctionSpec) -> dict[str, Any]:
    return {**spec.to_dict(), "executor": "docker"}


#: The sum of the function's one model's tensor "w", and the request body.
SUM = """
def handler(request, ctx):
    (model,) = ctx.models.values()
    return {"sum": float(model.numpy()["w"].sum()), "body": request.text()}
"""


async def test_gateway_invokes_a_docker_function_over_http(
    docker_executor: MakeExecutor,
    start_daemon: Callable[..., Any],
    make_function: MakeFunction,
) -> None:
    """The gateway with the docker executor: deploy, cold start a container, invoke, metrics."""
    weights = np.ones(256, dtype=np.float32)
    daemon = start_daemon(models={"ones": {"w": weights}})
    spec = make_function(SUM, name="ones", models=[{"name": "ones"}])
    async with _docker_gateway(docker_executor, daemon.socket) as gateway:
        await gateway.deploy(_docker_spec(spec))
        status, _, body = await gateway.invoke("ones", b"x")
        assert status == 200, body
        assert json.loads(body) == {"sum": 256.0, "body": "x"}
        async with gateway.session.get(f"{gateway.url}/metrics") as r:
            metrics = await r.text()
    assert 'trims_cold_starts_total{function="ones"} 1.0' in metrics


#: Opens connections to the store socket until the daemon refuses one, and keeps them open.
HOG = """
import os
import socket

from trims.protocol import recv_frame, send_frame

HELD = []


def handler(request, ctx):
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.environ["TRIMS_SOCKET"])
        s.settimeout(0.5)
        try:
            reply, _ = recv_frame(s)  # the daemon speaks first only to refuse
        except TimeoutError:
            s.settimeout(None)
            try:
                send_frame(s, {"id": 1, "op": "stats", "args": {}})
                reply, _ = recv_frame(s)
            except OSError as e:
                reply = {"ok": False, "error": {"message": str(e)}}
        if not reply["ok"]:
            s.close()
            return {"held": len(HELD), "refused": reply["error"]["message"]}
        HELD.append(s)
"""


async def test_a_function_holding_its_uids_store_connections_leaves_anothers_cold_start_alone(
    docker_executor: MakeExecutor,
    start_daemon: Callable[..., Any],
    make_function: MakeFunction,
) -> None:
    """Issue 41, finding 7: the store limits connections per uid, and every container ran as
    10001, so one function holding its share made the next function's cold start fail (502).
    Each function now runs as its own uid (Note [one uid per function])."""
    limit = 4
    weights = np.arange(64, dtype=np.float32)
    daemon = start_daemon(
        models={"vec": {"w": weights}}, max_connections_per_uid=limit, idle_timeout=0
    )
    hog = make_function(HOG, name="hog")
    vec = make_function(SUM, name="vec", models=[{"name": "vec"}])
    async with _docker_gateway(docker_executor, daemon.socket) as gateway:
        await gateway.deploy(_docker_spec(hog))
        status, _, body = await gateway.invoke("hog")
        assert status == 200, body
        held = json.loads(body)
        assert held["held"] >= limit - 1 and "--max-connections-per-uid" in held["refused"]

        await gateway.deploy(_docker_spec(vec))
        status, _, body = await gateway.invoke("vec")
        assert status == 200, body
        assert json.loads(body) == {"sum": float(weights.sum()), "body": ""}

        # the hog still holds its uid's every slot: the limit was in force all along
        status, _, body = await gateway.invoke("hog")
        assert status == 200, body
        assert json.loads(body)["held"] == held["held"]


#: What the worker process runs as and sees in its environment.
IDS_AND_ENV = """
import os

def handler(request, ctx):
    return {"ids": [os.getuid(), os.getgid()], "groups": sorted(os.getgroups()),
            "env": sorted(os.environ)}
"""


async def test_each_function_runs_as_its_own_uid_which_the_deploy_check_uses(
    docker_executor: MakeExecutor,
    make_function: MakeFunction,
    start_daemon: Callable[..., Any],
    docker_client: Any,
) -> None:
    """Two functions, two uids (and groups of the same number); the instances of one share
    it. The deploy check reads the code as that uid: code only it may read passes."""
    daemon = start_daemon()
    executor = docker_executor(store_socket=daemon.socket)
    specs = {name: make_function(IDS_AND_ENV, name=name) for name in ("first", "second")}
    for name, spec in specs.items():
        assert spec.code_dir is not None
        uid, gid = executor.ids_for(name)
        for path in (Path(spec.code_dir), Path(spec.code_dir) / "handler.py"):
            os.chown(path, uid, gid)
            path.chmod(0o700 if path.is_dir() else 0o600)
        executor.check(spec)
    instances = [
        await executor.start(specs["first"], "first-1"),
        await executor.start(specs["first"], "first-2"),
        await executor.start(specs["second"], "second-1"),
    ]
    got = []
    for instance in instances:
        await instance.wait_ready(READY)
        got.append(await _call(instance))
    first, again, second = (answer["ids"] for answer in got)
    assert first == again and first != second
    for uid, gid in (first, second):
        assert uid == gid and DEFAULT_UID_BASE <= uid < DEFAULT_UID_BASE + DEFAULT_UID_COUNT
        assert uid not in (0, os.getuid(), daemon.socket.stat().st_uid)
    assert all(daemon.socket.stat().st_gid in answer["groups"] for answer in got)
    users = {
        docker_client.containers.get(i.container_id).attrs["Config"]["User"] for i in instances
    }
    assert users == {f"{first[0]}:{first[1]}", f"{second[0]}:{second[1]}"}
    for instance in instances:
        await executor.stop(instance, grace_s=5)


async def test_a_container_gets_nothing_of_the_gateways_environment(
    docker_executor: MakeExecutor,
    make_function: MakeFunction,
    docker_client: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 41, finding 2: the environment is the defaults, the setting's and the spec's env
    and the store socket's path over the image's own; the gateway's tokens never reach it."""
    monkeypatch.setenv("TRIMS_GATEWAY_TOKENS", "admin-secret:admin")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "gateway-only")
    executor = docker_executor(env={"FROM_SETTINGS": "1"})
    spec = make_function(IDS_AND_ENV, name="env", env={"FROM_SPEC": "2"})
    instance = await executor.start(spec, "env-1")
    await instance.wait_ready(READY)
    seen = set((await _call(instance))["env"])
    assert isinstance(instance, DockerInstance)
    container = docker_client.containers.get(instance.container_id)
    image_env = docker_client.images.get(container.image.id).attrs["Config"]["Env"]
    given = {*WORKER_ENV_DEFAULTS, "FROM_SETTINGS", "FROM_SPEC"}
    image_names = {entry.partition("=")[0] for entry in image_env}
    assert {entry.partition("=")[0] for entry in container.attrs["Config"]["Env"]} == (
        image_names | given
    )
    assert "TRIMS_GATEWAY_TOKENS" not in seen and "AWS_SECRET_ACCESS_KEY" not in seen
    assert given <= seen
    await executor.stop(instance, grace_s=5)


async def test_an_unreachable_engine_does_not_stop_the_sweep_from_being_tried_again(
    tmp_path: Path,
) -> None:
    executor = DockerExecutor(
        owner="gw-down", docker_url=f"unix://{tmp_path}/no-engine.sock", state_dir=tmp_path
    )
    assert await executor.prepare() == []  # logged, not raised: the gateway still starts
    with pytest.raises(Unavailable, match="cannot reach the Docker Engine"):
        await executor.start(FunctionSpec(name="f", handler="m:f"), "f-1")
    await executor.close()
