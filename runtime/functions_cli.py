"""`trims functions`: deploy, list, get, remove and invoke functions on a running gateway.

Talks to the gateway's HTTP API (``--url``, default ``$TRIMS_GATEWAY_URL`` or
http://127.0.0.1:8080) with the bearer token from ``--token``, else ``$TRIMS_TOKEN``, else the
admin token file a gateway of the same user generated (in ``--state-dir``, default the
gateway's default state directory). Without any, requests go without a token. These options,
and ``--json`` (``ls`` and ``get`` print JSON instead of a table), go before or after the
action. ``trims pipelines`` reuses them (:func:`add_gateway_args`, :func:`client_from_args`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trims.errors import (
    Timeout,
    TrimsError,
    Unavailable,
    UpstreamError,
    ValidationError,
    error_from_dict,
)
from trims.runtime.credentials import find_token

DEFAULT_URL = "http://127.0.0.1:8080"


def add_gateway_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--url, --token, --state-dir and --json on ``parser``; returns the parent parser that
    accepts them after an action too (pass it as ``parents=[...]`` to each action)."""
    _gateway_options(parser, suppress=False)
    common = argparse.ArgumentParser(add_help=False)
    _gateway_options(common, suppress=True)
    return common


def _gateway_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # After the action, an option left out must not overwrite the one given before it.
    none: Any = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "--url", default=none, help=f"gateway URL (default $TRIMS_GATEWAY_URL or {DEFAULT_URL})"
    )
    parser.add_argument(
        "--token",
        default=none,
        help="bearer token (default $TRIMS_TOKEN, else the gateway's generated admin token file)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=none,
        help="the gateway's --state-dir, to find its admin token (default: the gateway's default)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS if suppress else False,
        help="print JSON instead of a table (ls, get)",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    common = add_gateway_args(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, parents=[common])

    deploy = action("deploy", "deploy or update a function from a YAML/JSON spec")
    deploy.add_argument("file", type=Path)
    action("ls", "list functions and their instances")
    action("get", "show a function's spec and instances").add_argument("name")
    action("rm", "delete a function (its instances drain)").add_argument("name")
    invoke = action("invoke", "invoke a function and print its response body")
    invoke.add_argument("name")
    invoke.add_argument(
        "--data", "-d", default="", help="request body; @FILE reads a file, @- stdin"
    )
    invoke.add_argument("--content-type", default=None, help="Content-Type of the body")
    invoke.add_argument("--async", dest="is_async", action="store_true", help="print the id (202)")


class GatewayClient:
    """A minimal synchronous client of the gateway API (stdlib only)."""

    def __init__(self, url: str, token: str | None, timeout_s: float = 300.0) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValidationError(
                f"gateway URL {url!r} is not an http(s) URL; pass --url (or set "
                f"$TRIMS_GATEWAY_URL) like {DEFAULT_URL}"
            )
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
        except TimeoutError as e:
            raise Timeout(
                f"the gateway at {self.url} did not answer {method} {path} within "
                f"{self.timeout_s:g} s"
            ) from e
        except (OSError, http.client.HTTPException) as e:
            raise Unavailable(
                f"the connection to the gateway at {self.url} failed ({type(e).__name__}: {e}); "
                "is --url a trims gateway?"
            ) from e

    def json(self, method: str, path: str, doc: Any = None) -> Any:
        body = None if doc is None else json.dumps(doc).encode()
        status, _, data = self.request(method, path, body, "application/json" if body else None)
        if status >= 400:
            raise gateway_error(status, data)
        try:
            return json.loads(data)
        except ValueError:
            raise UpstreamError(
                f"{self.url}{path} answered {status} with a body that is not JSON; is --url a "
                "trims gateway?"
            ) from None


def gateway_error(status: int, data: bytes) -> TrimsError:
    """The trims error a gateway's error answer names (its message when it names none)."""
    try:
        err = json.loads(data)["error"]
        if isinstance(err, str):
            return TrimsError(err)
        return error_from_dict(err)
    except (ValueError, KeyError, TypeError, AttributeError):
        return TrimsError(f"gateway answered {status}: {data[:200].decode(errors='replace')}")


def read_data(value: str) -> bytes:
    """A request body from ``--data``: the text itself, ``@FILE`` a file's bytes, ``@-`` stdin."""
    if value == "@-":
        return sys.stdin.buffer.read()
    if value.startswith("@"):
        path = Path(value[1:])
        try:
            return path.read_bytes()
        except OSError as e:
            reason = (e.strerror or str(e)).lower()
            raise ValidationError(
                f"--data {value}: cannot read {path}: {reason}; give an existing file after @, "
                "@- for stdin, or the body itself"
            ) from None
    return value.encode()


def print_body(body: bytes) -> None:
    """An answer's body on stdout as it came, ending in a newline."""
    sys.stdout.buffer.write(body)
    if body and not body.endswith(b"\n"):
        sys.stdout.buffer.write(b"\n")
    sys.stdout.flush()


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def _print_table(functions: list[dict[str, Any]]) -> None:
    from trims.tables import text_table

    rows = []
    for f in functions:
        spec, status = f["spec"], f["status"]
        states = [i["state"] for i in status["instances"]]
        handler = spec.get("handler") or spec.get("image", "")
        rows.append([spec["name"], states.count("ready"), states.count("starting"),
                     status["queued"], status["inflight"], handler])  # fmt: skip
    header = ["NAME", "READY", "STARTING", "QUEUED", "INFLIGHT", "HANDLER"]
    print(text_table(header, rows, align="lrrrr"))


def _print_function(doc: dict[str, Any]) -> None:
    spec, status = doc["spec"], doc["status"]
    models = ", ".join(
        m.get("name", "?") + (f":{m['version']}" if m.get("version") else "")
        for m in spec.get("models") or []
    )
    for key, value in (
        ("name", spec["name"]),
        ("handler", spec.get("handler") or "-"),
        ("image", spec.get("image") or "-"),
        ("executor", spec.get("executor") or "-"),
        ("models", models or "-"),
        ("queued", status.get("queued", 0)),
        ("inflight", status.get("inflight", 0)),
    ):
        print(f"{key + ':':<10} {value}")
    instances = status.get("instances") or []
    print(f"instances: {len(instances)}")
    for i in instances:
        print(f"  {i.get('id', '?'):<20} {i.get('state', '?')}")
    print("(--json shows the whole spec)")


def client_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> GatewayClient:
    """The gateway client the options of :func:`add_gateway_args` describe."""
    url = args.url or env.get("TRIMS_GATEWAY_URL") or DEFAULT_URL
    return GatewayClient(url, find_token(args.token, args.state_dir, env))


def run(args: argparse.Namespace) -> int:
    client = client_from_args(args, os.environ)
    if args.action == "deploy":
        from trims.runtime.functions.spec import load_spec_file

        spec = load_spec_file(args.file)
        client.json("PUT", f"/v1/functions/{spec.name}", spec.to_dict())
        print(f"function {spec.name} deployed: POST {client.url}/v1/functions/{spec.name}/invoke")
    elif args.action == "ls":
        functions = client.json("GET", "/v1/functions")["functions"]
        if args.json:
            print_json(functions)
        else:
            _print_table(functions)
    elif args.action == "get":
        doc = client.json("GET", f"/v1/functions/{args.name}")
        if args.json:
            print_json(doc)
        else:
            _print_function(doc)
    elif args.action == "rm":
        client.json("DELETE", f"/v1/functions/{args.name}")
        print(f"function {args.name} deleted")
    else:
        path = f"/v1/functions/{args.name}/invoke" + ("?async=true" if args.is_async else "")
        status, _, body = client.request("POST", path, read_data(args.data), args.content_type)
        if status >= 400:
            raise gateway_error(status, body)
        print_body(body)
    return 0
