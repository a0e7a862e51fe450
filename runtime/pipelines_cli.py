"""`trims pipelines`: deploy, list, get, remove and invoke pipelines on a running gateway.

A pipeline chains deployed functions into a DAG (see :mod:`trims.runtime.gateway.pipelines`
for the spec). The gateway options (``--url``, ``--token``, ``--state-dir``, ``--json``) are
those of ``trims functions`` and work the same way, before or after the action. ``invoke
--timings`` prints each step's time (the answer's ``Server-Timing``) on stderr; ``invoke
--outputs`` prints every step's output as one JSON document.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from trims.errors import ValidationError
from trims.runtime.functions_cli import (
    GatewayClient,
    add_gateway_args,
    client_from_args,
    gateway_error,
    print_body,
    print_json,
    read_data,
)


def configure(parser: argparse.ArgumentParser) -> None:
    common = add_gateway_args(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, parents=[common])

    action("deploy", "deploy or update a pipeline from a YAML/JSON spec").add_argument(
        "file", type=Path
    )
    action("ls", "list pipelines")
    action("get", "show a pipeline's steps").add_argument("name")
    action("rm", "delete a pipeline (its functions stay)").add_argument("name")
    invoke = action("invoke", "run a pipeline and print its answer")
    invoke.add_argument("name")
    invoke.add_argument(
        "--data", "-d", default="", help="request body; @FILE reads a file, @- stdin"
    )
    invoke.add_argument("--content-type", default=None, help="Content-Type of the body")
    invoke.add_argument(
        "--async", dest="is_async", action="store_true", help="print the invocation id (202)"
    )
    invoke.add_argument(
        "--outputs", action="store_true", help="print every step's output as one JSON document"
    )
    invoke.add_argument(
        "--timings", action="store_true", help="print each step's time on stderr (Server-Timing)"
    )


def load_pipeline_file(path: Path) -> dict[str, Any]:
    """A pipeline spec document from a YAML or JSON file (checked by the gateway)."""
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        reason = (e.strerror or str(e)).lower()
        raise ValidationError(f"cannot read pipeline spec {path}: {reason}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValidationError(f"{path} is not valid YAML or JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        raise ValidationError(
            f"{path}: a pipeline spec is an object with 'name' and 'steps', e.g. "
            '{"name": "p", "steps": [{"name": "a", "function": "echo"}]}'
        )
    return doc


def _steps_text(step: dict[str, Any]) -> str:
    after = step.get("after") or []
    return f"{step['name']} ({step['function']})" + (f" after {', '.join(after)}" if after else "")


def _print_table(pipelines: list[dict[str, Any]]) -> None:
    if not pipelines:
        print("no pipelines; deploy one with `trims pipelines deploy FILE`")
        return
    from trims.tables import text_table

    rows = [
        [p["name"], len(p["steps"]), ", ".join(dict.fromkeys(s["function"] for s in p["steps"]))]
        for p in pipelines
    ]
    print(text_table(["NAME", "STEPS", "FUNCTIONS"], rows, align="lr"))


def _print_pipeline(doc: dict[str, Any]) -> None:
    print(f"name:  {doc['name']}")
    print(f"steps: {len(doc['steps'])}")
    for step in doc["steps"]:
        print(f"  {_steps_text(step)}")


def print_timings(server_timing: str | None) -> None:
    """``decode;dur=1.204, total;dur=5.310`` as one ``step  ms`` line each, on stderr."""
    if not server_timing:
        return
    for entry in server_timing.split(","):
        name, _, params = entry.strip().partition(";")
        duration = params.partition("dur=")[2]
        print(f"{name:<24} {duration:>10} ms", file=sys.stderr)


def _invoke(client: GatewayClient, args: argparse.Namespace) -> None:
    query = []
    if args.is_async:
        query.append("async=true")
    if args.outputs:
        query.append("outputs=true")
    path = f"/v1/pipelines/{args.name}/invoke" + (f"?{'&'.join(query)}" if query else "")
    status, headers, body = client.request("POST", path, read_data(args.data), args.content_type)
    if status >= 400:
        raise gateway_error(status, body)
    if args.timings:
        timing = next((v for k, v in headers.items() if k.lower() == "server-timing"), None)
        print_timings(timing)
    print_body(body)


def run(args: argparse.Namespace) -> int:
    client = client_from_args(args, os.environ)
    if args.action == "deploy":
        doc = load_pipeline_file(args.file)
        client.json("PUT", f"/v1/pipelines/{doc['name']}", doc)
        print(
            f"pipeline {doc['name']} deployed: POST {client.url}/v1/pipelines/{doc['name']}/invoke"
        )
    elif args.action == "ls":
        pipelines = client.json("GET", "/v1/pipelines")["pipelines"]
        if args.json:
            print_json(pipelines)
        else:
            _print_table(pipelines)
    elif args.action == "get":
        doc = client.json("GET", f"/v1/pipelines/{args.name}")
        if args.json:
            print_json(doc)
        else:
            _print_pipeline(doc)
    elif args.action == "rm":
        client.json("DELETE", f"/v1/pipelines/{args.name}")
        print(f"pipeline {args.name} deleted")
    else:
        _invoke(client, args)
    return 0
