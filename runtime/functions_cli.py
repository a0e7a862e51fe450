"""`trims functions`: deploy, list, get, remove and invoke functions on a running gateway.

Talks to the gateway's HTTP API (``--url``, default ``$TRIMS_GATEWAY_URL`` or
http://127.0.0.1:8080) with the bearer token from ``--token``, else ``$TRIMS_TOKEN``, else the
admin token file a gateway of the same user generated (in ``--state-dir``, default the
gateway's default state directory). Without any, requests go without a token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trims.errors import TrimsError, Unavailable, ValidationError, error_from_dict

DEFAULT_URL = "http://127.0.0.1:8080"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help=f"gateway URL (default $TRIMS_GATEWAY_URL or {DEFAULT_URL})")
    parser.add_argument(
        "--token",
        help="bearer token (default $TRIMS_TOKEN, else the gateway's generated admin token file)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="the gateway's --state-dir, to find its admin token (default: the gateway's default)",
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    deploy = sub.add_parser("deploy", help="deploy or update a function from a YAML/JSON spec")
    deploy.add_argument("file", type=Path)
    sub.add_parser("ls", help="list functions and their instances")
    get = sub.add_parser("get", help="show a function's spec and instances")
    get.add_argument("name")
    rm = sub.add_parser("rm", help="delete a function (its instances drain)")
    rm.add_argument("name")
    invoke = sub.add_parser("invoke", help="invoke a function and print its response body")
    invoke.add_argument("name")
    invoke.add_argument(
        "--data", "-d", default="", help="request body; @FILE reads a file, @- stdin"
    )
    invoke.add_argument("--content-type", default=None, help="Content-Type of the body")
    invoke.add_argument("--async", dest="is_async", action="store_true", help="print the id (202)")


class GatewayClient:
    """A minimal synchronous client of the gateway API (stdlib only)."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if content_type:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()
        except urllib.error.URLError as e:
            raise Unavailable(
                f"cannot reach the gateway at {self.url}: {e.reason}; is `trims up` running?"
            ) from e

    def json(self, method: str, path: str, doc: Any = None) -> Any:
        body = None if doc is None else json.dumps(doc).encode()
        status, _, data = self.request(method, path, body, "application/json" if body else None)
        if status >= 400:
            raise _error(status, data)
        return json.loads(data)


def _error(status: int, data: bytes) -> TrimsError:
    try:
        err = json.loads(data)["error"]
        return error_from_dict(err)
    except (ValueError, KeyError, TypeError):
        return TrimsError(f"gateway answered {status}: {data[:200].decode(errors='replace')}")


def _read_data(value: str) -> bytes:
    if value == "@-":
        return sys.stdin.buffer.read()
    if value.startswith("@"):
        return Path(value[1:]).read_bytes()
    return value.encode()


def _print_table(functions: list[dict[str, Any]]) -> None:
    print(f"{'NAME':<24} {'READY':>5} {'STARTING':>8} {'QUEUED':>6} {'INFLIGHT':>8}  HANDLER")
    for f in functions:
        spec, status = f["spec"], f["status"]
        states = [i["state"] for i in status["instances"]]
        print(
            f"{spec['name']:<24} {states.count('ready'):>5} {states.count('starting'):>8} "
            f"{status['queued']:>6} {status['inflight']:>8}  "
            f"{spec.get('handler') or spec.get('image', '')}"
        )


def find_token(token: str | None, state_dir: Path | None, env: Mapping[str, str]) -> str | None:
    """``token``, else ``$TRIMS_TOKEN``, else the admin token file of ``state_dir`` (or of the
    default state directory); None when there is none. ValidationError (one line) when the
    file exists but cannot be used."""
    from trims.runtime.gateway.admin_token import admin_token_path, read_token_file
    from trims.runtime.settings import default_state_dir

    if token:
        return token
    if env.get("TRIMS_TOKEN"):
        return env["TRIMS_TOKEN"]
    path = admin_token_path(state_dir or default_state_dir(env))
    if not os.path.lexists(path):
        return None
    try:
        return read_token_file(path)
    except ValidationError as e:
        raise ValidationError(f"{e.message}; or pass --token / set $TRIMS_TOKEN") from None


def run(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get("TRIMS_GATEWAY_URL") or DEFAULT_URL
    client = GatewayClient(url, find_token(args.token, args.state_dir, os.environ))
    if args.action == "deploy":
        from trims.runtime.functions.spec import load_spec_file

        spec = load_spec_file(args.file)
        client.json("PUT", f"/v1/functions/{spec.name}", spec.to_dict())
        print(f"function {spec.name} deployed: POST {client.url}/v1/functions/{spec.name}/invoke")
    elif args.action == "ls":
        _print_table(client.json("GET", "/v1/functions")["functions"])
    elif args.action == "get":
        print(json.dumps(client.json("GET", f"/v1/functions/{args.name}"), indent=2))
    elif args.action == "rm":
        client.json("DELETE", f"/v1/functions/{args.name}")
        print(f"function {args.name} deleted")
    else:
        path = f"/v1/functions/{args.name}/invoke" + ("?async=true" if args.is_async else "")
        status, _, body = client.request("POST", path, _read_data(args.data), args.content_type)
        if status >= 400:
            raise _error(status, body)
        sys.stdout.buffer.write(body)
        if body and not body.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()
    return 0
