"""`trims gateway`: the HTTP gateway in front of function instances.

Prints ``trims gateway ready url=<URL> auth=on|off`` on stderr once it listens; SIGTERM drains
in-flight requests, stops every instance and exits 0.

Secure by default: without ``--tokens-file`` (or ``$TRIMS_GATEWAY_TOKENS``) the gateway uses
the admin token in ``<state dir>/auth/admin-token``, created on first start, and only callers
who present it may deploy or delete. On loopback, callers without a token may still invoke
and read (``--anonymous-scopes``); on any other address they may do nothing. ``--no-auth``
turns checking off, explicitly and with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trims.config import data_dir, default_socket, results_db
from trims.errors import ValidationError
from trims.runtime.settings import (
    LOCAL_ANONYMOUS_SCOPES,
    GatewaySettings,
    default_state_dir,
    is_loopback,
    load_tokens,
)

log = logging.getLogger(__name__)

READY = "trims gateway ready"


def _watermark(text: str) -> float | None:
    if text == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a share of the memory limit; give one like 0.9, or off"
        ) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="TCP port (0 picks a free one)")
    parser.add_argument(
        "--executor",
        default="local",
        help="executor for functions naming none (local, docker, ...)",
    )
    parser.add_argument(
        "--store-socket", type=Path, help="store socket for instances (default: $TRIMS_SOCKET)"
    )
    parser.add_argument(
        "--tokens-file",
        type=Path,
        help="bearer tokens, one 'SECRET SCOPE[,SCOPE] [NAME]' per line "
        "(also $TRIMS_GATEWAY_TOKENS); none = an admin token generated in the state directory",
    )
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="check no credentials: anyone who reaches the port may deploy code (trusted "
        "single-user machines only)",
    )
    parser.add_argument(
        "--anonymous-scopes",
        help="comma-separated scopes of requests without a token (read, invoke:*, "
        "invoke:NAME; '' for none). Default: read,invoke:* on loopback with the generated "
        "token, none otherwise",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="keep deployed specs here so a restart restores them; the generated admin token "
        "lives in its auth/ (default for the token: $XDG_STATE_HOME/trims/gateway, "
        "/var/lib/trims/gateway for root, else ~/.local/state/trims/gateway)",
    )
    parser.add_argument(
        "--code-root",
        type=Path,
        action="append",
        default=[],
        help="only deploy code_dirs under this directory (repeatable; default: any directory "
        "that is not a system or trims directory)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send its request head before it is disconnected",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may stall before the request is refused",
    )
    parser.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=256,
        help="open connections one local user (on loopback) or one client address (else) may "
        "hold; more are answered 503",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="open connections in all; more are answered 503",
    )
    parser.add_argument(
        "--reserved-connections",
        type=int,
        help="of --max-connections, how many only connections that have sent a complete "
        "request head may hold (default: a quarter); connections still sending theirs share "
        "the rest",
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests"
    )
    parser.add_argument(
        "--instance-limit", type=int, default=64, help="most instances one function may ask for"
    )
    parser.add_argument(
        "--max-instances-total",
        type=int,
        help="most instances across all functions; idle ones are stopped to make room",
    )
    parser.add_argument(
        "--memory-high-watermark",
        type=_watermark,
        default=0.9,
        metavar="SHARE|off",
        help="where a memory cgroup limits the gateway, the share of the limit that memory in "
        "use plus a new instance may reach; beyond, idle instances are stopped and requests "
        "no instance can serve get 503 (default 0.9; off: no memory cap)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        help="OTLP/HTTP traces endpoint (default: env); traced invocations go there too",
    )
    parser.add_argument(
        "--traces-kept",
        type=int,
        default=100,
        help="traces of traced invocations (trims-trace-level) kept for GET /v1/traces/{id}",
    )
    parser.add_argument(
        "--traces-kept-mib",
        type=int,
        default=256,
        help="MiB of span JSON those kept traces may hold; the oldest go first",
    )
    parser.add_argument("--no-zygote", action="store_true", help="local: spawn fresh interpreters")
    parser.add_argument(
        "--preload",
        help="local: comma-separated modules the zygote imports (default numpy,torch,onnxruntime)",
    )
    parser.add_argument(
        "--run-as", help="local: user (name or uid) the workers run as when started as root"
    )
    parser.add_argument(
        "--warm-pool",
        type=int,
        metavar="K",
        help="local: workers each zygote keeps forked ahead of need, as the run-as user, for "
        "faster scale-from-zero starts; 0 turns it off (default $TRIMS_WARM_POOL, else 1)",
    )
    parser.add_argument(
        "--environment",
        action="append",
        default=[],
        metavar="NAME=PYTHON",
        help="local: an interpreter functions may ask for by name (spec 'environment: NAME'), "
        "e.g. mxnet=/opt/mxnet-venv/bin/python; repeatable (default $TRIMS_ENVIRONMENTS, "
        "comma-separated)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument(
        "--no-fast-path",
        dest="fast_path",
        action="store_false",
        help="answer every request through aiohttp's web layer, plain invocations included "
        "(the fast path is also off with --access-log or when spans are exported)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="docker: this gateway's name on the host; a gateway started again under the same "
        "name removes the containers its crashed predecessor left (default $TRIMS_GATEWAY_NAME)",
    )
    parser.add_argument(
        "--results-db",
        help="results database the web UI (/ui/) reads: SQLite path or SQLAlchemy URL "
        "(default $TRIMS_RESULTS_DB, else ~/.local/share/trims/results.sqlite, as trims evaluate)",
    )
    parser.add_argument("--log-level", default="INFO")


def _anonymous_scopes(args: argparse.Namespace, tokens_given: bool) -> frozenset[str]:
    if args.anonymous_scopes is not None:
        return frozenset(s.strip() for s in args.anonymous_scopes.split(",") if s.strip())
    if tokens_given or not is_loopback(args.host):
        return frozenset()
    return LOCAL_ANONYMOUS_SCOPES


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> GatewaySettings:
    """The settings the arguments describe; no file is read or written but the tokens file.

    :func:`with_admin_token` adds the generated admin token where one is needed.
    """
    from trims.telemetry import otlp_endpoint_from_env

    tokens = load_tokens(args.tokens_file, env)
    if args.no_auth and (tokens or args.anonymous_scopes is not None):
        raise ValidationError(
            "--no-auth turns authentication off; drop --tokens-file, $TRIMS_GATEWAY_TOKENS "
            "and --anonymous-scopes, or drop --no-auth"
        )
    return GatewaySettings(
        host=args.host,
        port=args.port,
        executor=args.executor,
        store_socket=args.store_socket or default_socket(env),
        tokens=tokens,
        auth=not args.no_auth,
        anonymous_scopes=frozenset() if args.no_auth else _anonymous_scopes(args, bool(tokens)),
        code_roots=tuple(p.resolve() for p in args.code_root),
        store_dir=getattr(args, "store_dir", None) or data_dir(env),
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections_per_peer=args.max_connections_per_peer,
        max_connections=args.max_connections,
        reserved_connections=args.reserved_connections,
        state_dir=args.state_dir,
        drain_timeout_s=args.drain_timeout,
        instance_limit=args.instance_limit,
        max_instances_total=args.max_instances_total,
        memory_high_watermark=args.memory_high_watermark,
        otlp_endpoint=args.otlp_endpoint or otlp_endpoint_from_env(dict(env)),
        traces_kept=args.traces_kept,
        traces_kept_bytes=args.traces_kept_mib << 20,
        access_log=args.access_log,
        fast_path=args.fast_path,
        name=args.name or env.get("TRIMS_GATEWAY_NAME") or None,
        results_db=getattr(args, "results_db", None) or results_db(env),
    )


def with_admin_token(settings: GatewaySettings, env: Mapping[str, str]) -> GatewaySettings:
    """The settings with the generated admin token when auth is on and no token is configured.

    The token file is created on first start and reused after (see
    :mod:`trims.runtime.gateway.admin_token`); where it is gets logged, never the secret.
    """
    from trims.runtime.gateway.admin_token import admin_token_path, ensure_admin_token

    if not settings.auth:
        log.warning(
            "authentication is OFF (--no-auth): anyone who can connect to %s:%d may deploy "
            "code and run it on this host; use it on trusted single-user machines only",
            settings.host, settings.port,
        )  # fmt: skip
        return settings
    if settings.tokens:
        return settings
    state = settings.state_dir or default_state_dir(env)
    token = ensure_admin_token(state)
    path = admin_token_path(state)
    log.info(
        "admin token in %s: deploying needs 'Authorization: Bearer <its content>' (trims "
        "functions and trims up read it); callers without a token may: %s",
        path, ", ".join(sorted(settings.anonymous_scopes)) or "nothing",
    )  # fmt: skip
    return dataclasses.replace(settings, tokens=(token,), admin_token_file=path)


def executor_factory(settings: GatewaySettings, local_options: Mapping[str, Any]) -> Any:
    """name -> a new executor; local and docker get the store socket, local ``local_options``.

    The kubernetes executor reads its settings (``TRIMS_K8S_*``) itself: the socket path there
    is the node's, not this host's.
    """
    from trims.runtime.executors import create_executor

    def make(name: str) -> Any:
        if name == "local":
            return create_executor(
                name,
                store_socket=settings.store_socket,
                otlp_endpoint=settings.otlp_endpoint,
                **local_options,
            )
        if name == "docker":
            return create_executor(name, store_socket=settings.store_socket, owner=settings.name)
        return create_executor(name)

    return make


def parse_environments(items: Sequence[str]) -> dict[str, str]:
    """``NAME=PYTHON`` items -> {name: interpreter}; ValidationError says which item is wrong.

    The interpreter must be an absolute path to an executable file: the gateway runs function
    code with it, so it is never looked up on PATH.
    """
    from trims.runtime.functions.spec import environment_name

    environments: dict[str, str] = {}
    for item in items:
        name, sep, python = item.partition("=")
        name, python = name.strip(), python.strip()
        if not sep or not name or not python:
            raise ValidationError(
                f"--environment {item!r}: write NAME=PYTHON, e.g. mxnet=/opt/venv/bin/python"
            )
        environment_name(name)
        if not os.path.isabs(python) or not os.access(python, os.X_OK):
            raise ValidationError(
                f"--environment {name}: {python!r} is not an absolute path to an executable "
                "interpreter; give the full path of the environment's bin/python"
            )
        if name in environments:
            raise ValidationError(f"--environment {name} is given twice; give it once")
        _check_environment(name, python)
        environments[name] = python
    return environments


def _check_environment(name: str, python: str) -> None:
    """ValidationError unless ``python`` imports this trims' worker (checked once, at start,
    so a broken environment is named now rather than as a dead instance at the first call)."""
    import subprocess

    try:
        done = subprocess.run(
            [python, "-c", "import trims.runtime.worker_cli"], capture_output=True, text=True,
            timeout=120, check=False, stdin=subprocess.DEVNULL, cwd="/",
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValidationError(f"--environment {name}: {python} does not run: {e}") from e
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValidationError(
            f"--environment {name}: {python} cannot import trims ({last}); install this trims "
            f"into that environment ({python} -m pip install -e <trims checkout>)"
        )


def local_options(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The local executor's options from the command line (and ``$TRIMS_ENVIRONMENTS``)."""
    env = os.environ if env is None else env
    options: dict[str, Any] = {"zygote": not args.no_zygote}
    declared = args.environment or [
        item for item in env.get("TRIMS_ENVIRONMENTS", "").split(",") if item.strip()
    ]
    if declared:
        options["environments"] = parse_environments(declared)
    if args.preload is not None:
        options["preload"] = tuple(m for m in args.preload.split(",") if m)
    if args.run_as is not None:
        options["run_as"] = args.run_as
    pool = args.warm_pool if args.warm_pool is not None else env.get("TRIMS_WARM_POOL")
    if pool is not None and pool != "":
        try:
            options["warm_pool"] = int(pool)
        except ValueError:
            raise ValidationError(
                f"TRIMS_WARM_POOL={pool!r} is not a number; set it to 0 (off) or a count"
            ) from None
        if options["warm_pool"] < 0:
            raise ValidationError(f"--warm-pool {pool}: give 0 (off) or a positive count")
    return options


def check_port_free(host: str, port: int) -> None:
    """Unavailable (one line, what to do) when ``host:port`` cannot be bound, e.g. because
    another gateway listens there; checked before anything slow (zygote, daemon) starts."""
    import socket

    from trims.errors import Unavailable

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValidationError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                reason = (e.strerror or str(e)).lower()
                raise Unavailable(
                    f"cannot listen on {host}:{port}: {reason}; stop whatever listens there "
                    "(another trims gateway?) or pick another --port (0 picks a free one)"
                ) from None


def run(args: argparse.Namespace) -> int:
    import uvloop

    from trims.runtime.gateway.server import serve
    from trims.telemetry import setup_logging, setup_tracing

    check_port_free(args.host, args.port)
    setup_logging(args.log_level)
    settings = with_admin_token(settings_from_args(args, os.environ), os.environ)
    if settings.otlp_endpoint:
        setup_tracing("trims-gateway", settings.otlp_endpoint)
    local = local_options(args)

    def ready(url: str) -> None:
        auth = "on" if settings.auth_enabled else "off"
        print(f"{READY} url={url} auth={auth}", file=sys.stderr, flush=True)

    uvloop.run(serve(settings, executor_factory(settings, local), on_ready=ready))
    return 0
