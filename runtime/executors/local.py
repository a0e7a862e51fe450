"""The local executor: worker processes on this machine, reached over Unix sockets.

``zygote=True`` (default) forks workers from a zygote that has already imported numpy, torch
and onnxruntime; ``zygote=False`` spawns ``python -m trims worker`` for each instance (the
cold-start baseline). Either way the worker confines itself (memory limit, ``run_as`` user,
dies with its parent) before it loads function code, writes its log to
``<state_dir>/<instance>.log``, and gets ``TRIMS_SOCKET`` so its models come from the store.
The zygote and the workers inherit only an allow-listed part of this process's environment
(Note [worker environment] in :mod:`trims.runtime.executors.base`) and none of its descriptors
(Note [what a worker inherits] in :mod:`trims.runtime.worker.sandbox`); the processes function
code starts end with its instance (Note [an instance's processes end with it], same module:
each worker is a subreaper, and so is the zygote; a spawned worker's are killed here before the
worker when it must be killed).

A function may name an environment (``environment: mxnet`` in its spec): another interpreter,
declared once in the settings (``environments={"mxnet": "/venv/bin/python"}``), for frameworks
that cannot live beside the others (MXNet 1.9.1 needs ``numpy<1.24``). Each environment gets
its own zygote, started on first use with the same preload list (modules it lacks are skipped),
and the environment must have trims installed. A spec naming an environment the settings do not
declare is refused at deploy.

Function code never runs as root (Note [function code never runs as root] in
:mod:`trims.runtime.worker.sandbox`): an executor running as root runs workers as ``run_as``,
by default ``trims`` if that user exists, else ``nobody``; ``run_as`` naming root is refused.
:meth:`LocalExecutor.check` (called at deploy) refuses a function whose code that user cannot
read, checked as that user in a forked child; at start the executor warns when that user cannot
read the interpreter's library or the trims packages (the zygote preloads what workers need, so
only modules that function code imports itself are affected).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Protocol

from trims.config import default_socket
from trims.errors import NotFound, Unavailable, ValidationError
from trims.runtime.executors.base import ExecutorBase, Instance, WorkerInstance, inherited_env
from trims.runtime.executors.state_dirs import OwnedDir, make_owned_dir
from trims.runtime.executors.zygote import ZygoteHandle
from trims.runtime.functions.spec import WORKER_ENV_DEFAULTS, FunctionSpec
from trims.runtime.worker.access import User, check_code_as, unreadable_runtime
from trims.runtime.worker.exits import EXIT_INIT_FAILED, describe_returncode, init_failure
from trims.runtime.worker.sandbox import effective_run_as, kill_descendants, resolve_user
from trims.telemetry import inject_context, otlp_endpoint_from_env

log = logging.getLogger(__name__)

DEFAULT_PRELOAD = ("numpy", "torch", "onnxruntime")
#: Environment the zygote and the workers get unless the node's says otherwise. ONNX Runtime
#: (1.32) opens its telemetry database (``~/.cache/Microsoft/DeveloperTools/.onnxruntime/
#: onnxruntime.db``, 0600) read-write when imported: a root zygote held root's file open and
#: mapped, and every worker forked from it inherited both.
_QUIET_FRAMEWORKS: Mapping[str, str] = MappingProxyType({"ORT_DISABLE_TELEMETRY": "1"})


@dataclass(frozen=True)
class LocalExecutorSettings:
    #: Fork workers from a zygote with the frameworks imported (False: a fresh interpreter each).
    zygote: bool = True
    #: Where worker sockets and logs live; None = a temp dir removed on close().
    state_dir: Path | None = None
    #: Store socket passed to workers as TRIMS_SOCKET; None = trims.config.default_socket().
    store_socket: Path | None = None
    #: User the workers run as (name or uid), never root; None = ``trims`` if that user exists,
    #: else ``nobody``, when this process is root (function code never runs as root), and this
    #: process's own user otherwise.
    run_as: str | None = None
    #: Modules the zygote imports before forking (missing ones are skipped).
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    #: Interpreter for the zygote and spawned workers.
    python: str = sys.executable
    #: OTLP/HTTP endpoint the workers export their spans to (TRIMS_OTLP_ENDPOINT); None: the
    #: one this process's environment names (TRIMS_OTLP_ENDPOINT or
    #: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), passed on alone.
    otlp_endpoint: str | None = None
    #: Extra environment for every worker (the function's own env is added on top): the way
    #: to give workers a variable of this process's environment that is not allow-listed.
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Named interpreters functions may ask for (``environment`` in the spec), e.g.
    #: ``{"mxnet": "/opt/mxnet-venv/bin/python"}``; each needs trims installed.
    environments: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    #: Workers each zygote keeps forked ahead of need, already running as ``run_as`` and not
    #: yet bound to a function (Note [warm pool] in :mod:`trims.runtime.executors.zygote`); a
    #: start takes one instead of forking, and the zygote forks its replacement when idle.
    #: Default 1: a scale from zero then skips the fork and its copy-on-write faults (the
    #: gateway's instance start about 11 ms instead of about 24 with ``bench/peers.py``'s
    #: model), for one process per environment's zygote (about 7 MiB private: Note [warm
    #: pool]) and a place in the ``run_as`` user's process count; 0 turns it off (an idle node
    #: then holds no process it did not need), more serves bursts of starts.
    warm_pool: int = 1

    def __post_init__(self) -> None:
        if self.warm_pool < 0:
            raise ValidationError(
                f"warm_pool must be 0 (off) or a positive number of workers, not {self.warm_pool}",
                field="warm_pool",
            )

    def python_for(self, environment: str | None) -> str:
        """The interpreter for a spec's ``environment`` (None: :attr:`python`)."""
        if environment is None:
            return self.python
        try:
            return self.environments[environment]
        except KeyError:
            declared = ", ".join(sorted(self.environments)) or "none"
            raise ValidationError(
                f"environment {environment!r} is not declared on this gateway (declared: "
                f"{declared}); start the gateway with --environment {environment}=/path/to/"
                "bin/python, or drop the function's environment",
                field="environment",
            ) from None


class _Process(Protocol):
    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class _SpawnedProcess:
    """A ``python -m trims worker`` child; signals go to its whole process group."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.returncode

    async def wait(self) -> int:
        return await self._process.wait()

    def send_signal(self, sig: int) -> None:
        if self._process.returncode is None:
            if sig == signal.SIGKILL:
                # The worker cannot end its processes itself now: end them while it still
                # holds them (Note [an instance's processes end with it]).
                kill_descendants(self.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)


def _log_tail(path: Path, size: int = 8192) -> str:
    """The last ``size`` bytes of a worker's log (where it tells why it ended), or ""."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class LocalInstance(WorkerInstance):
    exit_reason: str | None
    #: A local worker binds its socket some 10-30 ms after the fork, and a failed connect to a
    #: Unix socket costs microseconds: retry every few ms rather than backing off to 250 ms
    #: (doubling from 2 ms made a worker that bound at 15 ms wait for the attempt at 30 ms).
    CONNECT_RETRY_S = (0.002, 0.004)

    def __init__(
        self, instance_id: str, spec: FunctionSpec, process: _Process, socket_path: Path,
        log_path: Path,
    ) -> None:  # fmt: skip
        super().__init__(instance_id, spec.name, "local")
        self.spec = spec
        self.process = process
        self.pid = process.pid
        self.socket_path = socket_path
        self.log_path = log_path
        self._watch = asyncio.get_running_loop().create_task(
            self._watch_exit(), name=f"watch-{instance_id}"
        )

    async def _watch_exit(self) -> None:
        code = await self.process.wait()
        self._end(self._describe(code))
        if code != 0:
            log.warning("instance %s of %s ended: %s", self.id, self.function, self.exit_reason)

    def _describe(self, code: int) -> str:
        detail = init_failure(_log_tail(self.log_path)) if code == EXIT_INIT_FAILED else ""
        return describe_returncode(
            code, memory_bytes=self.spec.resources.memory_bytes, detail=detail
        )

    def address(self) -> str:
        return f"unix:{self.socket_path}"

    def alive(self) -> bool:
        # The process's own status: it is known the moment the child exits, before the watch
        # task has run and recorded why.
        return self.process.returncode is None

    async def terminate(self, grace_s: float) -> None:
        """SIGTERM (drain), SIGKILL after ``grace_s``; returns once the process is gone."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self._watch), grace_s)
            except TimeoutError:
                log.warning("instance %s of %s did not drain in %.1f s; killing it",
                            self.id, self.function, grace_s)  # fmt: skip
                self.process.send_signal(signal.SIGKILL)
        await asyncio.shield(self._watch)
        await self.close_connection()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        if self.process.returncode == 0:
            # A clean exit leaves nothing to investigate; a crashed instance keeps its log.
            with contextlib.suppress(FileNotFoundError):
                self.log_path.unlink()


class LocalExecutor(ExecutorBase[LocalInstance]):
    name = "local"

    def __init__(self, settings: LocalExecutorSettings | None = None, **options: object) -> None:
        """``LocalExecutor(zygote=False)`` is short for passing LocalExecutorSettings(...)."""
        if settings is None:
            try:
                settings = LocalExecutorSettings(**options)  # type: ignore[arg-type]
            except TypeError as e:
                raise ValidationError(f"local executor: {e}") from e
        self.settings = settings
        #: The user workers run as (None: this process's own, non-root, user).
        self.run_as = effective_run_as(settings.run_as)
        self._user: User | None = None
        if self.run_as is not None and os.getuid() == 0:
            uid, gid = resolve_user(self.run_as)
            self._user = User(uid, gid)
            self._warn_unreadable_runtime(self._user)
        self._state_dir: Path | None = settings.state_dir
        self._owned_dir: OwnedDir | None = None
        #: One zygote per environment (None: the default interpreter), started on first use.
        self._zygotes: dict[str | None, ZygoteHandle] = {}
        self._zygote_lock = asyncio.Lock()
        self._zygote_failed: set[str | None] = set()
        super().__init__()

    def _warn_unreadable_runtime(self, user: User) -> None:
        try:
            unreadable = unreadable_runtime(user)
        except OSError as e:
            log.warning("cannot tell whether user %s can read the runtime's files: %s",
                        user.label, e)  # fmt: skip
            return
        if unreadable:
            log.warning(
                "user %s that function code runs as cannot read %s: workers have the modules "
                "the zygote preloaded, but function code importing any other module from there "
                "fails; install Python and trims where that user can read them, or give the "
                "directories above them the search bit (chmod o+x)",
                user.label, ", ".join(unreadable),
            )  # fmt: skip

    def check(self, spec: FunctionSpec) -> None:
        """At deploy: ValidationError if the user workers run as cannot read the function's
        code (checked as that user; without root, workers run as this process's user)."""
        self.settings.python_for(spec.environment)
        if self._user is not None:
            check_code_as(spec, self._user)

    @property
    def state_dir(self) -> Path:
        if self._state_dir is None:
            self._owned_dir = make_owned_dir("trims-local-")  # Note [stale state directories]
            self._state_dir = self._owned_dir.path
        if not self._state_dir.exists():
            self._state_dir.mkdir(parents=True, mode=0o755)
        if self._user is not None:
            os.chown(self._state_dir, self._user.uid, self._user.gid)
        return self._state_dir

    @property
    def zygote_pid(self) -> int | None:
        """The default environment's zygote's pid (None before the first start or with
        zygote=False)."""
        zygote = self._zygotes.get(None)
        return zygote.process.pid if zygote is not None else None

    def _base_env(self) -> dict[str, str]:
        """The zygote's and every worker's environment: written down, never this process's
        whole environment (Note [worker environment] in :mod:`trims.runtime.executors.base`)."""
        # Note [passive OpenMP threads]; settings.env may override either default.
        env = {**WORKER_ENV_DEFAULTS, **_QUIET_FRAMEWORKS, **inherited_env(os.environ)}
        env.update(self.settings.env)
        env["TRIMS_SOCKET"] = str(self.settings.store_socket or default_socket(os.environ))
        otlp = self.settings.otlp_endpoint or otlp_endpoint_from_env(dict(os.environ))
        if otlp is not None:
            env["TRIMS_OTLP_ENDPOINT"] = otlp
        return env

    async def prepare(self) -> None:
        """Start the default environment's zygote now rather than on the first cold start
        (no-op without zygote); other environments' start on their first instance."""
        await self._zygote_or_none(None)

    async def _get_zygote(self, environment: str | None) -> ZygoteHandle:
        async with self._zygote_lock:
            zygote = self._zygotes.get(environment)
            if zygote is None or not zygote.alive():
                if zygote is not None:
                    await zygote.close()
                zygote = await ZygoteHandle.start(
                    python=self.settings.python_for(environment), preload=self.settings.preload,
                    env=self._base_env(),
                )  # fmt: skip
                self._zygotes[environment] = zygote
                if self.settings.warm_pool:
                    env = self._base_env()
                    zygote.set_pool(
                        self.settings.warm_pool, run_as=self.run_as,
                        store_socket=str(self.settings.store_socket or "") or None,
                        tracing=otlp_endpoint_from_env(env) is not None,
                    )  # fmt: skip
                if environment is not None:
                    log.info("environment %s: zygote %d (%s) preloaded %s", environment,
                             zygote.process.pid, self.settings.python_for(environment),
                             ", ".join(zygote.preloaded) or "nothing")  # fmt: skip
            return zygote

    async def _zygote_or_none(self, environment: str | None) -> ZygoteHandle | None:
        """The environment's zygote, or None in spawn mode or when it cannot start (instances
        then spawn: slower cold starts, but the function still runs)."""
        if not self.settings.zygote or environment in self._zygote_failed:
            return None
        try:
            return await self._get_zygote(environment)
        except Unavailable as e:
            self._zygote_failed.add(environment)
            log.error("%s; starting instances as fresh interpreters instead", e.message)
            return None

    def _worker_argv(
        self, spec: FunctionSpec, instance_id: str, socket_path: Path, parent: int, standby: bool
    ) -> list[str]:
        argv = [
            "--spec-json", json.dumps(spec.to_dict()), "--listen", f"unix:{socket_path}",
            "--instance-id", instance_id, "--parent-pid", str(parent),
        ]  # fmt: skip
        if self.settings.store_socket is not None:
            argv += ["--store-socket", str(self.settings.store_socket)]
        if self.run_as is not None:
            argv += ["--run-as", self.run_as]
        if standby:
            argv.append("--standby")
        return argv

    async def start(self, spec: FunctionSpec, instance_id: str) -> Instance:
        return await self._start(spec, instance_id, standby=False)

    async def start_standby(self, spec: FunctionSpec, instance_id: str) -> Instance:
        """A standby worker (``trims worker --standby``; Note [standby instances] in
        :mod:`trims.runtime.gateway.pool`), forked like any other (from the warm pool when
        there is one)."""
        return await self._start(spec, instance_id, standby=True)

    async def _start(self, spec: FunctionSpec, instance_id: str, *, standby: bool) -> Instance:
        self._check_start(instance_id)
        if spec.handler is None:
            raise ValidationError(
                f"function {spec.name} names only an image; the local executor runs Python "
                "handlers: give it a handler or deploy it with the docker or kubernetes executor",
                field="handler",
            )
        state = self.state_dir
        socket_path = state / f"{instance_id}.sock"
        log_path = state / f"{instance_id}.log"
        env = self._base_env()
        env.update(spec.env)
        # The caller's current span (the gateway's "instance start") becomes the parent of the
        # worker's init and model-acquire spans.
        carrier = inject_context()
        for name in ("traceparent", "tracestate"):
            env.pop(name.upper(), None)
            if carrier.get(name):
                env[name.upper()] = carrier[name]
        cwd = spec.code_dir or str(state)
        process: _Process
        python = self.settings.python_for(spec.environment)
        zygote = await self._zygote_or_none(spec.environment)
        if zygote is not None:
            argv = self._worker_argv(spec, instance_id, socket_path, zygote.process.pid, standby)
            process = await zygote.fork(
                argv, env=env, cwd=cwd, log_path=str(log_path), store=bool(spec.models)
            )
        else:
            argv = self._worker_argv(spec, instance_id, socket_path, os.getpid(), standby)
            with log_path.open("ab") as logf:
                spawned = await asyncio.create_subprocess_exec(
                    python, "-m", "trims", "worker", *argv,
                    stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf, env=env, cwd=cwd,
                    start_new_session=True,
                )  # fmt: skip
            process = _SpawnedProcess(spawned)
        instance = self._track(LocalInstance(instance_id, spec, process, socket_path, log_path))
        log.debug("instance %s of %s started (pid %d)", instance_id, spec.name, process.pid)
        return instance

    async def stop(self, instance: Instance, grace_s: float = 10.0) -> None:
        """Idempotent: stopping an instance that already ended only cleans up after it."""
        local = self._instances.pop(instance.id, None)
        if local is None:
            if not isinstance(instance, LocalInstance):
                raise NotFound(f"instance {instance.id} is not managed by this local executor")
            local = instance
        await local.terminate(grace_s)

    async def _release(self) -> None:
        zygotes, self._zygotes = list(self._zygotes.values()), {}
        for zygote in zygotes:
            await zygote.close()
        if self._owned_dir is not None:
            self._owned_dir.remove()
