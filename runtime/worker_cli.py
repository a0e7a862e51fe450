"""`trims worker`: run one function instance (what containers and the local executor run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from trims.errors import ValidationError

if TYPE_CHECKING:
    from trims.runtime.worker.runner import WorkerSettings


#: Environment variables that carry the trace of the instance's start (W3C trace context).
TRACE_ENV = ("TRACEPARENT", "TRACESTATE")


def configure(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", type=Path, help="function spec file (YAML or JSON)")
    src.add_argument("--spec-json", help="function spec as a JSON string")
    parser.add_argument(
        "--listen",
        required=True,
        help="where to serve the wire protocol: unix:PATH or tcp:HOST:PORT",
    )
    parser.add_argument(
        "--store-socket", type=Path, help="model store socket (default $TRIMS_SOCKET)"
    )
    parser.add_argument("--instance-id", help="instance id for logs and spans (default: random)")
    parser.add_argument("--run-as", help="user to drop to before loading function code")
    parser.add_argument(
        "--parent-pid", type=int, help="exit when this process (the executor) goes away"
    )
    parser.add_argument(
        "--log-level", default=None, help="log level (default $TRIMS_LOG_LEVEL or INFO)"
    )
    parser.add_argument(
        "--standby", action="store_true",
        help="prepare (models mapped, code imported) and run init only when a client sends "
        "ACTIVATE",
    )  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    from trims.runtime.functions.spec import load_spec_file, parse_spec
    from trims.runtime.worker.runner import WorkerSettings
    from trims.runtime.worker.sandbox import Confinement
    from trims.runtime.worker.server import ListenAddress
    from trims.telemetry import otlp_endpoint_from_env

    if args.spec is not None:
        spec = load_spec_file(args.spec)
    else:
        try:
            data = json.loads(args.spec_json)
        except ValueError as e:
            raise ValidationError(f"--spec-json is not valid JSON: {e}") from e
        spec = parse_spec(data)
    return WorkerSettings(
        spec=spec,
        listen=ListenAddress.parse(args.listen),
        instance_id=args.instance_id or f"{spec.name}-{uuid.uuid4().hex[:8]}",
        store_socket=args.store_socket,
        confinement=Confinement(
            memory_bytes=spec.resources.memory_bytes,
            threads=spec.scaling.concurrency,
            run_as=args.run_as,
            parent_pid=args.parent_pid,
        ),
        otlp_endpoint=otlp_endpoint_from_env(dict(os.environ)),
        start_trace={name.lower(): os.environ[name] for name in TRACE_ENV if os.environ.get(name)},
        standby=args.standby,
    )


def run(args: argparse.Namespace) -> int:
    from trims.runtime.worker.runner import run_worker

    if args.log_level:
        os.environ["TRIMS_LOG_LEVEL"] = args.log_level
    rc = run_worker(settings_from_args(args))
    # A hung sync handler thread would block interpreter shutdown: leave without joining it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
