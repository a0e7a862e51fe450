"""The docker executor: each function instance is a container running ``trims worker``.

What a container gets (host side -> container side)::

    <store socket>                 -> /run/trims/store.sock   (bind mount of the socket file)
    <state_dir>/<instance>/        -> /run/trims/w/           (the worker listens on worker.sock)
    <spec.code_dir>                -> /srv/function           (read-only; the spec is rewritten)

Weights arrive over the store socket as file descriptors (SCM_RIGHTS works across the mount),
so the container needs neither the host IPC namespace nor /dev/shm. Only the store socket is
mounted, never its directory: the admin socket beside it stays out of reach, so function code
can acquire and release models but never administer the store.

Each container runs as a non-root user with every capability dropped, ``no-new-privileges``, a
read-only root filesystem (tmpfs /tmp), CPU and memory limits from the spec, the configured
network mode (``none`` by default) and GPUs through device requests. Which user: with a root
caller, each function its own uid (and a group of the same number) from ``uid_base`` and
``uid_count`` (Note [one uid per function] in :mod:`trims.runtime.executors.function_uids`), so
the store's per-uid limits and access lists tell functions apart; with the ``user`` setting,
every container that one user (sharing those limits); with a non-root caller, the caller's
own ids (the only ones whose worker socket it can be sure to connect to). Each container's
environment is :data:`WORKER_ENV_DEFAULTS`, the ``env`` setting, the spec's ``env`` and the
store socket's path, over the image's own: never anything of the gateway's environment. Labels
(:data:`LABEL_MANAGED`, :data:`LABEL_EXECUTOR`, ...) find its containers again; ``close()``
removes every container this executor made and :func:`remove_orphans` those of executors that
died without closing; an executor with an ``owner`` does that for its owner's containers
before its first start. Docker SDK calls block, so they run in threads; each instance has one
thread waiting for its container to end (``exit_reason`` comes from the container state:
OOMKilled, exit code, signal).

Which image: the spec's ``image`` when it names one; else the flavor of
``dockerfiles/build-image.sh`` that imports its models' frameworks (:func:`image_for`: torch ->
``trims-runtime:torch``, onnxruntime -> ``:onnx``, mxnet -> ``:mxnet``, torch and onnxruntime ->
``:all``); else (numpy models or none) the ``image`` setting. Each flavor carries the label
:data:`LABEL_FRAMEWORKS`, written at build time from what imports inside it; ``check(spec)`` at
deploy reads it with one ``docker image inspect`` (no container runs) and refuses a function
whose image is missing or cannot import a framework its models need.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from trims.config import default_socket
from trims.errors import (
    ErrorMap,
    NotFound,
    TrimsError,
    Unavailable,
    ValidationError,
    mapped_errors,
)
from trims.runtime.executors.base import (
    ExecutorBase,
    Instance,
    WorkerInstance,
    call_in_thread,
    refuse_environment,
)
from trims.runtime.executors.function_uids import (
    DEFAULT_UID_BASE,
    DEFAULT_UID_COUNT,
    FunctionUids,
    check_uid_range,
)
from trims.runtime.executors.state_dirs import OwnedDir, make_owned_dir
from trims.runtime.functions.spec import WORKER_ENV_DEFAULTS, FunctionSpec, parse_spec
from trims.runtime.settings import check_gateway_name
from trims.runtime.worker.access import User, check_code_as
from trims.runtime.worker.exits import describe_container_end

log = logging.getLogger(__name__)

T = TypeVar("T")

LABEL_MANAGED = "org.trims.managed"
LABEL_EXECUTOR = "org.trims.executor"
LABEL_FUNCTION = "org.trims.function"
LABEL_INSTANCE = "org.trims.instance"
LABEL_OWNER = "org.trims.owner"
#: Image label: the modules (comma-separated import names) the image imports; build-image.sh
#: writes it after importing each inside the image.
LABEL_FRAMEWORKS = "org.trims.frameworks"

#: Image flavors build-image.sh builds (the tag under ``image_repository``) and the frameworks
#: beyond numpy each imports, smallest first: a spec gets the first that holds all it needs.
FLAVORS: tuple[tuple[str, frozenset[str]], ...] = (
    ("onnx", frozenset({"onnxruntime"})),
    ("torch", frozenset({"torch"})),
    ("mxnet", frozenset({"mxnet"})),
    ("all", frozenset({"onnxruntime", "torch"})),
)

#: Paths inside the container.
CONTAINER_STORE_SOCKET = "/run/trims/store.sock"
#: The worker's socket in its instance's directory (the directory already names the instance).
WORKER_SOCKET = "worker.sock"
#: Longest path a Unix socket address holds (sun_path is 108 bytes with its terminating NUL).
_MAX_SOCKET_PATH = 107
CONTAINER_WORKER_DIR = "/run/trims/w"
CONTAINER_CODE_DIR = "/srv/function"

_NAME_RE = re.compile(r"[^a-zA-Z0-9_.-]")


def _fixed_ids(user: str | None) -> tuple[int, int] | None:
    """The (uid, gid) every container runs as, or None: each function its own.

    A non-root caller runs containers as itself: it can neither chown an instance's socket
    directory to another uid nor connect to a socket that the worker's umask keeps from it.
    """
    if user is not None:
        uid, _, gid = user.partition(":")
        return int(uid), int(gid or uid)
    if os.getuid() != 0:
        return os.getuid(), os.getgid()
    return None


@dataclass(frozen=True)
class DockerExecutorSettings:
    #: Image for functions whose spec names none and whose models need no framework beyond
    #: numpy; build it with dockerfiles/build-image.sh.
    image: str = "trims-runtime:latest"
    #: Repository of the framework images (tags ``onnx``, ``torch``, ``mxnet``, ``all``; see
    #: :data:`FLAVORS`) for specs naming no image; None = every such spec runs ``image``.
    image_repository: str | None = "trims-runtime"
    #: Host path of the daemon's store socket; None = trims.config.default_socket(); the socket
    #: is mounted only when it exists (otherwise models load from their ``source``).
    store_socket: Path | None = None
    #: Host directory for the per-instance worker socket directories; None = a temp dir
    #: removed on close().
    state_dir: Path | None = None
    #: Docker network mode: "none" (default: functions reach nothing), "bridge", "host", or
    #: the name of a user-defined network.
    network: str = "none"
    #: "uid:gid" every container runs as; they then share the store's per-uid connection
    #: limit and model access. None = each function its own uid and group from ``uid_base``
    #: (Note [one uid per function]) when this process is root, else the caller's own ids.
    user: str | None = None
    #: First uid of the functions' own (when ``user`` is None and this process is root); the
    #: range must hold no uid of a person or service on the host, nor the daemon's.
    uid_base: int = DEFAULT_UID_BASE
    #: How many uids from ``uid_base`` the functions draw from; more functions than that cannot
    #: run at once. Under dockerd's userns-remap the range must lie within the remapped ids.
    uid_count: int = DEFAULT_UID_COUNT
    #: Supplementary group that may connect to the store socket; None = the socket's group.
    store_group: int | None = None
    #: Memory added to the function's ``resources.memory_bytes`` for the interpreter and the
    #: imported frameworks (the cgroup counts them; the shared weights are charged to the
    #: daemon). 256 MiB covers Python + numpy + onnxruntime.
    memory_overhead_bytes: int = 256 << 20
    #: Most processes/threads in one container (fork-bomb guard).
    pids_limit: int = 1024
    #: Mount the root filesystem read-only (a tmpfs /tmp stays writable).
    read_only_rootfs: bool = True
    #: Docker Engine address; None = DOCKER_HOST or the local socket.
    docker_url: str | None = None
    #: Extra environment for every container (the function's own env is added on top).
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Extra labels for every container.
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Name of the gateway that owns the containers (label :data:`LABEL_OWNER`). When set, the
    #: executor's first start (or ``prepare()``) removes the containers of this owner that an
    #: executor which died without closing left behind: a restarted gateway of the same name
    #: cleans up after its crashed predecessor. Each gateway on a Docker host needs its own.
    owner: str | None = None

    def __post_init__(self) -> None:
        if self.user is not None and not re.fullmatch(r"\d+(:\d+)?", self.user):
            raise ValidationError(f"docker executor: user {self.user!r} must be 'uid' or 'uid:gid'")
        if self.user is not None and self.user.split(":")[0] == "0":
            raise ValidationError("docker executor: user must not be root (uid 0)")
        check_uid_range(self.uid_base, self.uid_count, "docker executor")
        if self.owner is not None:
            check_gateway_name(self.owner, "docker executor: owner")


@functools.cache
def _engine_errors() -> tuple[ErrorMap, ...]:
    """The docker SDK's errors as the trims errors that say what to do."""
    import docker.errors
    import requests.exceptions

    def client_error(e: Any) -> bool:
        return e.status_code is not None and 400 <= e.status_code < 500

    return (
        ErrorMap(
            docker.errors.ImageNotFound,
            NotFound,
            "{action}: image not found ({detail}); build it with 'bash dockerfiles/"
            "build-image.sh onnx|torch|mxnet|all' or name an existing image in the spec",
        ),
        ErrorMap(docker.errors.NotFound, NotFound),
        ErrorMap(
            docker.errors.APIError,
            ValidationError,
            "{action}: Docker Engine refused it: {detail}",
            when=client_error,
        ),
        ErrorMap(docker.errors.APIError, Unavailable, "{action}: Docker Engine error: {detail}"),
        ErrorMap(
            (docker.errors.DockerException, requests.exceptions.RequestException),
            Unavailable,
            "{action}: cannot reach the Docker Engine ({detail}); start dockerd or set DOCKER_HOST",
        ),
    )


def _explanation(error: Any) -> str:
    """What the engine said (an APIError's explanation), else the error's text."""
    return str(getattr(error, "explanation", None) or error)


async def _call(action: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking docker SDK call in a thread, translating its errors."""
    return await call_in_thread(action, _engine_errors(), fn, *args, detail=_explanation, **kwargs)


def required_modules(spec: FunctionSpec) -> frozenset[str]:
    """The framework modules a spec's models need beyond numpy (which every image holds)."""
    return frozenset(m.framework for m in spec.models) - {"numpy"}


def flavor_for(needed: frozenset[str]) -> str | None:
    """The smallest image flavor that imports ``needed`` (None: ``needed`` is empty)."""
    if not needed:
        return None
    for flavor, frameworks in FLAVORS:
        if needed <= frameworks:
            return flavor
    raise ValidationError(
        f"models: no trims image holds {' and '.join(sorted(needed))} together (MXNet 1.9.1 "
        "needs numpy<1.24, which torch and onnxruntime cannot use): deploy the mxnet models in "
        "a function of their own, or name an image that holds them all in 'image'",
        field="models",
    )


def image_for(spec: FunctionSpec, settings: DockerExecutorSettings) -> str:
    """The image a spec's containers run: its own ``image``, else the framework flavor its
    models need (under ``settings.image_repository``), else ``settings.image``."""
    if spec.image is not None:
        return spec.image
    flavor = flavor_for(required_modules(spec))
    if flavor is None or settings.image_repository is None:
        return settings.image
    return f"{settings.image_repository}:{flavor}"


def _build_hint(needed: frozenset[str]) -> str:
    """How to get an image that imports ``needed``."""
    flavor = flavor_for(needed) or "onnx"
    return f"build it with 'bash dockerfiles/build-image.sh {flavor}'"


def describe_container_exit(
    state: Mapping[str, Any], *, memory_limit: int | None, logs: str
) -> str:
    """A stopped container's ``State`` as a reason: 'out of memory ...', 'killed by SIGSEGV'
    (tini, the image's PID 1, exits with 128 + N when the worker died of signal N)."""
    if state.get("Error") and not state.get("OOMKilled"):
        return f"container failed: {state['Error']}"
    return describe_container_end(
        int(state.get("ExitCode", -1)),
        oom_killed=bool(state.get("OOMKilled")),
        memory_limit=memory_limit,
        init_text=logs,
    )


class DockerInstance(WorkerInstance):
    """One container; a thread waits for it to end and records why."""

    exit_reason: str | None

    def __init__(
        self,
        instance_id: str,
        spec: FunctionSpec,
        container: Any,
        socket_dir: Path,
        memory_limit: int | None,
        uid: int,
    ) -> None:
        super().__init__(instance_id, spec.name, "docker")
        self.spec = spec
        self.container = container
        #: The uid the container runs as (Note [one uid per function]).
        self.uid = uid
        self.socket_dir = socket_dir
        self.socket_path = socket_dir / WORKER_SOCKET
        self.memory_limit = memory_limit
        self.state: Mapping[str, Any] = {}
        loop = asyncio.get_running_loop()
        self._waiter = threading.Thread(
            target=self._wait_container,
            args=(loop,),
            name=f"docker-wait-{instance_id}",
            daemon=True,
        )
        self._waiter.start()

    @property
    def container_id(self) -> str:
        return str(self.container.id)

    def _wait_container(self, loop: asyncio.AbstractEventLoop) -> None:
        """Thread: block until the container stops, then read its state and log tail."""
        import docker.errors
        import requests.exceptions

        reason: str
        try:
            self.container.wait()
            self.container.reload()
            self.state = dict(self.container.attrs.get("State", {}))
            logs = self.container.logs(tail=50).decode(errors="replace")
            reason = describe_container_exit(self.state, memory_limit=self.memory_limit, logs=logs)
        except docker.errors.NotFound:
            reason = "container was removed"
        except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
            reason = f"lost track of the container: {e}"
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._set_ended, reason)

    def _set_ended(self, reason: str) -> None:
        self._end(reason)
        if self.state.get("ExitCode", 0) != 0 or self.state.get("OOMKilled"):
            log.warning("instance %s of %s ended: %s", self.id, self.function, self.exit_reason)

    def address(self) -> str:
        return f"unix:{self.socket_path}"

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM (the worker drains), SIGKILL after ``grace_s``, then remove the container."""
        if self.alive():
            await _call(f"stop container of {self.id}", self.container.stop, timeout=int(grace_s))
        await asyncio.wait_for(asyncio.shield(self._ended), grace_s + 30.0)
        await self.close_connection()
        await _remove_container(self.container)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


async def _remove_container(container: Any) -> None:
    """Remove a container; one that is already gone is fine."""
    with contextlib.suppress(NotFound):
        await _call(f"remove container {container.id[:12]}", container.remove, force=True)


class DockerExecutor(ExecutorBase[DockerInstance]):
    name = "docker"

    def __init__(self, settings: DockerExecutorSettings | None = None, **options: Any) -> None:
        """``DockerExecutor(network="bridge")`` is short for DockerExecutorSettings(...)."""
        if settings is None:
            try:
                settings = DockerExecutorSettings(**options)
            except TypeError as e:
                raise ValidationError(f"docker executor: {e}") from e
        self.settings = settings
        self.id = uuid.uuid4().hex[:12]
        self._client: Any = None
        self._state_dir = settings.state_dir
        self._owned_dir: OwnedDir | None = None
        super().__init__()
        self._swept = False
        self._fixed_ids = _fixed_ids(settings.user)
        self._uids = FunctionUids(settings.uid_base, settings.uid_count)
        store = settings.store_socket or default_socket(dict(os.environ))
        self._store_socket: Path | None = store

    @property
    def client(self) -> Any:
        """The docker SDK client, made on first use."""
        if self._client is None:
            import docker
            import docker.errors

            try:
                if self.settings.docker_url:
                    self._client = docker.DockerClient(base_url=self.settings.docker_url)
                else:
                    self._client = docker.from_env()
            except docker.errors.DockerException as e:
                with mapped_errors("docker executor", _engine_errors(), _explanation):
                    raise e
        return self._client

    @property
    def state_dir(self) -> Path:
        if self._state_dir is None:
            self._owned_dir = make_owned_dir("trims-docker-")  # Note [stale state directories]
            self._state_dir = self._owned_dir.path
        self._state_dir.mkdir(parents=True, exist_ok=True)
        return self._state_dir

    def labels(self, spec: FunctionSpec, instance_id: str) -> dict[str, str]:
        owner = {LABEL_OWNER: self.settings.owner} if self.settings.owner else {}
        return {
            **self.settings.labels,
            **owner,
            LABEL_MANAGED: "true",
            LABEL_EXECUTOR: self.id,
            LABEL_FUNCTION: spec.name,
            LABEL_INSTANCE: instance_id,
        }

    async def prepare(self) -> list[str]:
        """Once: remove this owner's containers left by dead executors; their names.

        Without an ``owner`` there is no telling another gateway's containers from orphans,
        so nothing is removed.
        """
        if self._swept or self.settings.owner is None:
            return []
        self._swept = True
        owner = {**self.settings.labels, LABEL_OWNER: self.settings.owner}
        try:
            return await asyncio.to_thread(remove_orphans, self.client, [self.id], owner)
        except TrimsError as e:
            # an engine that is down now must not keep a gateway from starting: try again later
            self._swept = False
            log.warning("orphaned containers of %s not swept: %s; trying again at the next "
                        "start", self.settings.owner, e)  # fmt: skip
            return []

    def check(self, spec: FunctionSpec) -> None:
        """At deploy: ValidationError if the image is missing or cannot import what the models
        need (:meth:`check_image`), or if the container's user (the uid the function has now
        or would get, Note [one uid per function]) could not read the code it gets (the
        bind-mounted ``code_dir``: the directory and the handler module, not its host
        ancestors). Only a root caller can take that user's ids to check; others run
        containers as themselves."""
        refuse_environment(spec, self.name)
        self.check_image(spec)
        if os.getuid() != 0 or spec.code_dir is None:
            return
        uid, gid = self.ids_for(spec.name)
        store_group = self._store_group()
        user = User(uid, gid, () if store_group is None else (store_group,))
        check_code_as(spec, user, mounted=True)

    def _running(self) -> list[tuple[str, int]]:
        return [(i.function, i.uid) for i in self._instances.values()]

    def _reserved_uids(self) -> set[int]:
        """Uids no function gets: root, the gateway's own and the daemon's (its socket's owner)."""
        reserved = {0, os.getuid()}
        store = self._store_socket
        with contextlib.suppress(OSError):
            if store is not None:
                reserved.add(store.stat().st_uid)
        return reserved

    def ids_for(self, function: str) -> tuple[int, int]:
        """The (uid, gid) the containers of ``function`` run as now, or would if it started."""
        if self._fixed_ids is not None:
            return self._fixed_ids
        uid = self._uids.uid_for(function, self._running(), self._reserved_uids())
        return uid, uid

    @contextlib.contextmanager
    def _ids_while_starting(self, function: str, instance_id: str) -> Iterator[tuple[int, int]]:
        """The (uid, gid) of a new instance, held until the block has tracked it."""
        if self._fixed_ids is not None:
            yield self._fixed_ids
            return
        with self._uids.starting(
            function, instance_id, self._running(), self._reserved_uids()
        ) as uid:
            yield uid, uid

    def check_image(self, spec: FunctionSpec) -> str:
        """The image ``spec`` runs (:func:`image_for`); ValidationError when it is not on the
        Docker host or its :data:`LABEL_FRAMEWORKS` lacks a framework the models need.

        One ``docker image inspect`` over the engine's local socket; no container runs. An
        image without the label (not built by build-image.sh) is trusted; an engine that does
        not answer is not a reason to refuse (the first start reports it).
        """
        try:
            import docker.errors
            import requests.exceptions
        except ImportError as e:
            raise ValidationError(
                f"the docker executor needs the docker SDK ({e}): pip install 'trims[docker]'"
            ) from e

        image = image_for(spec, self.settings)
        needed = required_modules(spec)
        field_name = "image" if spec.image is not None else "models"
        try:
            labels = self.client.images.get(image).attrs["Config"].get("Labels") or {}
        except docker.errors.ImageNotFound as e:
            repository, _, tag = image.rpartition(":")
            if repository == self.settings.image_repository and tag in dict(FLAVORS):
                hint = f"build it with 'bash dockerfiles/build-image.sh {tag}'"
            elif spec.image is not None:
                hint = "pull or build it, or name another image"
            else:
                hint = _build_hint(needed)
            raise ValidationError(
                f"function {spec.name}: image {image} is not on this Docker host; {hint}",
                field=field_name,
            ) from e
        except (
            TrimsError,
            docker.errors.DockerException,
            requests.exceptions.RequestException,
        ) as e:
            log.warning("function %s: image %s not checked (%s); its first start will tell",
                        spec.name, image, e)  # fmt: skip
            return image
        label = labels.get(LABEL_FRAMEWORKS)
        if label is None:
            return image
        missing = sorted(needed - set(label.split(",")))
        if missing:
            models = ", ".join(
                f"{m.name} ({m.framework})" for m in spec.models if m.framework in missing
            )
            flavor = flavor_for(needed)
            use = (
                f"use image {self.settings.image_repository or 'trims-runtime'}:{flavor} "
                f"({_build_hint(needed)})"
            )
            if spec.image is not None:
                use += " or drop 'image' from the spec to have it picked"
            raise ValidationError(
                f"function {spec.name}: image {image} cannot import module "
                f"{', '.join(repr(m) for m in missing)}, which its models need ({models}); it "
                f"imports only {label}: {use}",
                field=field_name,
            )
        return image

    def _store_group(self) -> int | None:
        """The supplementary group a container gets to reach the store socket (None: none)."""
        store = self._store_socket
        if store is None or not store.exists():
            return None
        gid = self.settings.store_group
        return store.stat().st_gid if gid is None else gid

    def _socket_dir(self, instance_id: str, ids: tuple[int, int]) -> Path:
        """A directory only this instance's container (running as ``ids``) writes its socket
        into."""
        path = self.state_dir / instance_id
        if len(os.fsencode(path / WORKER_SOCKET)) > _MAX_SOCKET_PATH:
            raise ValidationError(
                f"the worker socket {path / WORKER_SOCKET} is longer than the "
                f"{_MAX_SOCKET_PATH} bytes a Unix socket address holds; give the docker "
                "executor a shorter state directory"
            )
        path.mkdir(mode=0o700)
        if os.getuid() == 0:
            os.chown(path, *ids)
        elif os.getuid() != ids[0]:
            path.chmod(0o777)
        return path

    def container_spec(
        self,
        spec: FunctionSpec,
        instance_id: str,
        socket_dir: Path,
        *,
        ids: tuple[int, int] | None = None,
        standby: bool = False,
    ) -> dict[str, Any]:
        """Keyword arguments for ``containers.create`` (pure: no engine call); ``ids``: the
        (uid, gid) it runs as (None: :meth:`ids_for` the function now); ``standby``: the
        worker prepares and waits for ACTIVATE (Note [standby instances] in
        :mod:`trims.runtime.gateway.pool`)."""
        import docker.types

        uid, gid = self.ids_for(spec.name) if ids is None else ids

        mounts = [
            docker.types.Mount(CONTAINER_WORKER_DIR, str(socket_dir), type="bind"),
        ]
        data = spec.to_dict()
        group_add: list[str] = []
        worker_argv = [
            "worker",
            "--listen", f"unix:{CONTAINER_WORKER_DIR}/{WORKER_SOCKET}",
            "--instance-id", instance_id,
        ]  # fmt: skip
        if standby:
            worker_argv.append("--standby")
        # Note [passive OpenMP threads]. Built from these alone, never from os.environ: the
        # gateway's secrets (its tokens, say) must not reach function code.
        environment = {**WORKER_ENV_DEFAULTS, **self.settings.env, **spec.env}
        store = self._store_socket
        if store is not None and store.exists():
            mounts.append(docker.types.Mount(CONTAINER_STORE_SOCKET, str(store), type="bind"))
            worker_argv += ["--store-socket", CONTAINER_STORE_SOCKET]
            environment["TRIMS_SOCKET"] = CONTAINER_STORE_SOCKET
            group_add.append(str(self._store_group()))
        else:
            log.warning(
                "store socket %s does not exist; instance %s of %s loads models from their source",
                store, instance_id, spec.name,
            )  # fmt: skip
        working_dir = None
        if spec.code_dir is not None:
            mounts.append(
                docker.types.Mount(CONTAINER_CODE_DIR, spec.code_dir, type="bind", read_only=True)
            )
            data["code_dir"] = CONTAINER_CODE_DIR
            working_dir = CONTAINER_CODE_DIR
        worker_argv += ["--spec-json", json.dumps(parse_spec(data).to_dict())]
        resources = spec.resources
        memory_limit = None
        if resources.memory_bytes is not None:
            memory_limit = resources.memory_bytes + self.settings.memory_overhead_bytes
        device_requests = None
        if resources.gpus:
            device_requests = [
                docker.types.DeviceRequest(count=resources.gpus, capabilities=[["gpu"]])
            ]
        name = _NAME_RE.sub("-", f"trims-{spec.name}-{instance_id}")[:200]
        return {
            "image": image_for(spec, self.settings),
            "command": worker_argv,
            "name": name,
            "user": f"{uid}:{gid}",
            "group_add": group_add or None,
            "environment": environment,
            "labels": self.labels(spec, instance_id),
            "mounts": mounts,
            "working_dir": working_dir,
            "network_mode": self.settings.network,
            "nano_cpus": int(resources.cpus * 1e9) if resources.cpus else None,
            "mem_limit": memory_limit,
            "memswap_limit": memory_limit,
            "pids_limit": self.settings.pids_limit,
            "device_requests": device_requests,
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "read_only": self.settings.read_only_rootfs,
            "tmpfs": {"/tmp": "rw,nosuid,nodev,size=64m"},
            "init": False,
            "detach": True,
        }

    async def start(self, spec: FunctionSpec, instance_id: str) -> Instance:
        return await self._start(spec, instance_id, standby=False)

    async def start_standby(self, spec: FunctionSpec, instance_id: str) -> Instance:
        """A container whose worker prepares (models, code) and runs init only when activated
        (Note [standby instances] in :mod:`trims.runtime.gateway.pool`)."""
        return await self._start(spec, instance_id, standby=True)

    async def _start(self, spec: FunctionSpec, instance_id: str, *, standby: bool) -> Instance:
        self._check_start(instance_id)
        await self.prepare()
        client = self.client
        with self._ids_while_starting(spec.name, instance_id) as ids:
            socket_dir = self._socket_dir(instance_id, ids)
            kwargs = self.container_spec(spec, instance_id, socket_dir, ids=ids, standby=standby)
            action = f"start instance {instance_id} of {spec.name} (image {kwargs['image']})"
            try:
                container = await _call(action, client.containers.create, **kwargs)
            except TrimsError:
                shutil.rmtree(socket_dir, ignore_errors=True)
                raise
            try:
                await _call(action, container.start)
            except TrimsError:
                await _remove_container(container)
                shutil.rmtree(socket_dir, ignore_errors=True)
                raise
            instance = self._track(
                DockerInstance(
                    instance_id, spec, container, socket_dir, kwargs["mem_limit"], ids[0]
                )
            )
        log.debug("instance %s of %s started (container %s, uid %d)", instance_id, spec.name,
                  instance.container_id[:12], ids[0])  # fmt: skip
        return instance

    async def _stop_failed(self, instance: DockerInstance, error: BaseException) -> None:
        log.warning("instance %s of %s: stopping its container failed (%s); removing it",
                    instance.id, instance.function, error)  # fmt: skip
        with contextlib.suppress(TrimsError):
            await _remove_container(instance.container)

    async def _release(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._owned_dir is not None:
            self._owned_dir.remove()


def remove_orphans(
    client: Any,
    live_executors: Sequence[str] = (),
    labels: Mapping[str, str] = MappingProxyType({}),
) -> list[str]:
    """Remove trims containers whose executor is not in ``live_executors``; their names.

    For a gateway that restarts after a crash: its old executor never closed, so its containers
    still run (or sit exited) under labels nobody owns. ``labels`` narrows the sweep to
    containers that also carry these (the ``labels`` setting of the executors concerned).
    """
    import docker.errors
    import requests.exceptions

    selector = [f"{LABEL_MANAGED}=true", *(f"{k}={v}" for k, v in labels.items())]
    removed: list[str] = []
    try:
        containers = client.containers.list(all=True, filters={"label": selector})
        for container in containers:
            if container.labels.get(LABEL_EXECUTOR) in live_executors:
                continue
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
                removed.append(container.name)
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        with mapped_errors("remove orphaned trims containers", _engine_errors(), _explanation):
            raise e
    if removed:
        log.info("removed %d orphaned trims containers: %s", len(removed), ", ".join(removed))
    return removed
