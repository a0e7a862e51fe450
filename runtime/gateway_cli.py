"""`trims gateway`: the HTTP gateway in front of function instances.

Prints ``trims gateway ready url=<URL>`` on stderr once it listens; SIGTERM drains in-flight
requests, stops every instance and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trims.config import default_socket
from trims.runtime.settings import GatewaySettings, load_tokens

READY = "trims gateway ready"


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
        "(also $TRIMS_GATEWAY_TOKENS); none = no authentication",
    )
    parser.add_argument(
        "--state-dir", type=Path, help="keep deployed specs here so a restart restores them"
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
    parser.add_argument("--otlp-endpoint", help="OTLP/HTTP traces endpoint (default: env)")
    parser.add_argument("--no-zygote", action="store_true", help="local: spawn fresh interpreters")
    parser.add_argument(
        "--preload",
        help="local: comma-separated modules the zygote imports (default numpy,torch,onnxruntime)",
    )
    parser.add_argument(
        "--run-as", help="local: user (name or uid) the workers run as when started as root"
    )
    parser.add_argument("--access-log", action="store_true", help="log every request")
    parser.add_argument(
        "--name",
        default=None,
        help="docker: this gateway's name on the host; a gateway started again under the same "
        "name removes the containers its crashed predecessor left (default $TRIMS_GATEWAY_NAME)",
    )
    parser.add_argument("--log-level", default="INFO")


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> GatewaySettings:
    from trims.telemetry import otlp_endpoint_from_env

    return GatewaySettings(
        host=args.host,
        port=args.port,
        executor=args.executor,
        store_socket=args.store_socket or default_socket(env),
        tokens=load_tokens(args.tokens_file, env),
        state_dir=args.state_dir,
        drain_timeout_s=args.drain_timeout,
        instance_limit=args.instance_limit,
        max_instances_total=args.max_instances_total,
        otlp_endpoint=args.otlp_endpoint or otlp_endpoint_from_env(dict(env)),
        access_log=args.access_log,
        name=args.name or env.get("TRIMS_GATEWAY_NAME") or None,
    )


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


def local_options(args: argparse.Namespace) -> dict[str, Any]:
    """The local executor's options from the command line."""
    options: dict[str, Any] = {"zygote": not args.no_zygote}
    if args.preload is not None:
        options["preload"] = tuple(m for m in args.preload.split(",") if m)
    if args.run_as is not None:
        options["run_as"] = args.run_as
    return options


def run(args: argparse.Namespace) -> int:
    import uvloop

    from trims.runtime.gateway.server import serve
    from trims.telemetry import setup_logging, setup_tracing

    setup_logging(args.log_level)
    settings = settings_from_args(args, os.environ)
    if settings.otlp_endpoint:
        setup_tracing("trims-gateway", settings.otlp_endpoint)
    local = local_options(args)

    def ready(url: str) -> None:
        auth = "on" if settings.auth_enabled else "off"
        print(f"{READY} url={url} auth={auth}", file=sys.stderr, flush=True)

    uvloop.run(serve(settings, executor_factory(settings, local), on_ready=ready))
    return 0
