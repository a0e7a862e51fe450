"""`trims models`: add, list, inspect, load, pin, evict, verify and remove models in the node's
store.

Tables for people, ``--json`` for scripts; ``add``, ``load`` and ``verify`` draw progress
bars (stderr; one line per stage when it is not a terminal, see
:mod:`trims.runtime.progress`) from the daemon's progress frames. The common options
(``--socket``, ``--json``, ``--timeout``, ``--no-progress``) go before or after the action.
Admin actions go over the admin socket beside the store socket, so they work only for the
store's owner; ``ls`` and ``info`` use it when they can, to show every model with its source
and access list (``add --allow-uid`` and ``--allow-gid``).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trims.config import admin_socket_for, default_socket, format_size
from trims.errors import ValidationError
from trims.runtime.progress import ProgressBars
from trims.tables import text_table

TIERS = ("cpu", "gpu", "disk")


@dataclass(frozen=True)
class CliSettings:
    socket: Path
    json: bool
    timeout: float
    progress: bool


def _model_args(p: argparse.ArgumentParser, *, tier: str | None = None) -> None:
    p.add_argument("name", help="model name")
    p.add_argument("--version", help="model version (default: the latest)")
    if tier is not None:
        p.add_argument(
            "--tier", choices=TIERS, default=tier or None, help=f"tier (default: {tier or 'all'})"
        )


def _common_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    # After the action, an option left out must not overwrite the one given before it.
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--socket",
        type=Path,
        default=default(None),
        help="store socket (default: $TRIMS_SOCKET or the runtime dir)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="print JSON instead of tables"
    )
    parser.add_argument(
        "--timeout", type=float, default=default(60.0), help="seconds per reply (60)"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        default=default(False),
        help="draw no progress bars (and print no progress lines)",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    _common_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    _common_options(common, suppress=True)

    def action(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, parents=[common])

    p = action("add", "ingest a model file or URL (safetensors, torch, onnx, mxnet)")
    p.add_argument("name", help="model name")
    p.add_argument("source", help="local path, http(s):// or s3:// URL")
    p.add_argument("--version", help="version to register (default: 1)")
    p.add_argument("--format", dest="fmt", choices=("safetensors", "torch", "onnx", "mxnet"))
    p.add_argument("--sha256", help="expected sha256 of the source file")
    p.add_argument(
        "--allow-uid",
        action="append",
        default=[],
        metavar="USER",
        help="only this user (name or uid) may see and acquire it; repeatable",
    )
    p.add_argument(
        "--allow-gid",
        action="append",
        default=[],
        metavar="GROUP",
        help="members of this group (name or gid, supplementary groups count) too; repeatable",
    )
    action("ls", "list models")
    action("stats", "tier usage, budgets and live leases")
    _model_args(action("info", "one model's details and tensors"))
    p = action("rm", "remove a model: every version, or only the one --version names")
    p.add_argument("name", help="model name")
    p.add_argument("--version", help="remove only this version (default: every version)")
    p.add_argument("--force", action="store_true", help="remove even while leased")
    _model_args(action("load", "prefetch a model into a tier"), tier="cpu")
    _model_args(action("pin", "keep a model resident in a tier"), tier="cpu")
    _model_args(action("unpin", "let a model be evicted again"), tier="")
    _model_args(action("evict", "drop a model from a tier now"), tier="")
    p = action(
        "verify",
        "hash the disk copies again, whatever their stamp; a damaged copy is deleted (exit 1)",
    )
    p.add_argument("name", nargs="?", help="only this model (default: every model)")
    p.add_argument("--version", help="only this version of NAME")


def _resolve_id(kind: str, text: str) -> int:
    """A uid/gid from a number or a user/group name (looked up here, on the client)."""
    import grp
    import pwd

    from trims.errors import ValidationError

    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid if kind == "uid" else grp.getgrnam(text).gr_gid
    except KeyError:
        what = "user" if kind == "uid" else "group"
        raise ValidationError(
            f"--allow-{kind} {text!r}: no {what} of that name on this host; give a number or "
            f"an existing {what}"
        ) from None


def access_list(uids: Sequence[str], gids: Sequence[str]) -> dict[str, list[int]] | None:
    """The ``access`` argument of ``add`` from --allow-uid/--allow-gid; None when both empty."""
    if not uids and not gids:
        return None
    return {
        "uids": sorted({_resolve_id("uid", u) for u in uids}),
        "gids": sorted({_resolve_id("gid", g) for g in gids}),
    }


def _access_text(access: dict[str, Any] | None) -> str:
    if access is None:
        return "-"
    uids, gids = access.get("uids") or [], access.get("gids") or []
    if not uids and not gids:
        return "everyone"
    parts = [f"uid {u}" for u in uids] + [f"gid {g}" for g in gids]
    return ", ".join(parts)


def _models_table(models: list[dict[str, Any]]) -> str:
    if not models:
        return "no models in the store; add one with `trims models add NAME SOURCE`"
    rows = [
        [
            m["name"],
            m["version"],
            m.get("format", ""),
            format_size(int(m.get("total_bytes", 0))),
            ",".join(m.get("tiers", [])) or "-",
            ",".join(m.get("pins", [])) or "-",
            str(m.get("leases", 0)),
            m["digest"][:12],
        ]
        for m in models
    ]
    return text_table(
        ["NAME", "VERSION", "FORMAT", "SIZE", "TIERS", "PINNED", "LEASES", "DIGEST"], rows
    )


def _info_text(model: dict[str, Any]) -> str:
    lines = [
        f"{k + ':':<12} {v}"
        for k, v in (
            ("name", model["name"]),
            ("version", model["version"]),
            ("digest", model["digest"]),
            ("framework", model.get("framework", "")),
            ("format", model.get("format", "")),
            ("size", format_size(int(model.get("total_bytes", 0)))),
            ("tiers", ", ".join(model.get("tiers", [])) or "-"),
            ("pinned", ", ".join(model.get("pins", [])) or "-"),
            ("leases", model.get("leases", 0)),
            ("source", model.get("source", "-")),
            ("access", _access_text(model.get("access"))),
        )
    ]
    tensors = (model.get("manifest") or {}).get("tensors") or []
    if tensors:
        lines.append(f"tensors:     {len(tensors)}")
        rows = [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "()"] for t in tensors]
        table = text_table(["TENSOR", "DTYPE", "SHAPE"], rows)
        lines.extend("  " + line for line in table.splitlines())
    return "\n".join(lines)


def _stats_text(stats: dict[str, Any]) -> str:
    rows = [
        [
            tier,
            format_size(int(t.get("used", 0))),
            format_size(int(t.get("budget", 0))),
            str(t.get("models", 0)),
            str(t.get("loads", 0)),
            str(t.get("evictions", 0)),
        ]
        for tier, t in stats.get("tiers", {}).items()
        if t.get("available", True)
    ]
    table = text_table(["TIER", "USED", "BUDGET", "MODELS", "LOADS", "EVICTIONS"], rows)
    return f"{table}\nleases: {stats.get('leases', 0)}  clients: {stats.get('clients', 0)}"


def _verify_text(verified: dict[str, Any]) -> str:
    entries = verified["verified"]
    rows = [
        [
            ", ".join(e.get("models", [])),
            str(e.get("digest", ""))[:12],
            format_size(int(e.get("bytes", 0))),
            {"absent": "not on disk (verified when fetched again)"}.get(
                e.get("state", ""), str(e.get("state", ""))
            )
            + (f": {e['error']}" if e.get("error") else ""),
        ]
        for e in entries
    ]
    table = text_table(["MODELS", "DIGEST", "SIZE", "RESULT"], rows)
    damaged = sum(e.get("state") == "damaged" for e in entries)
    if damaged:
        table += (
            f"\n{damaged} damaged: deleted from the disk tier; a model with a source is fetched "
            "again on its next use, add the others again"
        )
    return table


def _emit(settings: CliSettings, value: Any, text: Callable[[Any], str]) -> None:
    print(json.dumps(value, indent=2, sort_keys=True) if settings.json else text(value))


def run(args: argparse.Namespace) -> int:
    from trims.runtime.client import StoreClient

    settings = CliSettings(
        socket=args.socket or default_socket(os.environ),
        json=args.json,
        timeout=args.timeout,
        progress=not args.no_progress,
    )
    bars = ProgressBars(settings.progress)
    # The store's owner sees every model with its source and access list (admin socket);
    # anyone else sees the models they may acquire.
    admin = os.access(admin_socket_for(settings.socket), os.R_OK | os.W_OK)
    with StoreClient(settings.socket, timeout=settings.timeout, client_name="trims models") as c:
        action = args.action
        try:
            if action == "add":
                model = c.add(
                    args.name,
                    args.source,
                    version=args.version,
                    fmt=args.fmt,
                    sha256=args.sha256,
                    access=access_list(args.allow_uid, args.allow_gid),
                    progress=bars,
                )
                bars.close()
                _emit(
                    settings, model, lambda m: f"added {m['name']}:{m['version']}\n{_info_text(m)}"
                )
            elif action == "ls":
                _emit(settings, c.list(admin=admin), _models_table)
            elif action == "stats":
                _emit(settings, c.stats(), _stats_text)
            elif action == "info":
                _emit(settings, c.info(args.name, args.version, admin=admin), _info_text)
            elif action == "rm":
                removed = c.remove(args.name, args.version, force=args.force)
                _emit(
                    settings, {"removed": removed}, lambda r: f"removed {', '.join(r['removed'])}"
                )
            elif action == "load":
                model = c.load(args.name, args.version, tier=args.tier, progress=bars)
                bars.close()
                _emit(
                    settings,
                    model,
                    lambda m: f"{m['name']}:{m['version']} in {', '.join(m['tiers'])}",
                )
            elif action in ("pin", "unpin"):
                op = c.pin if action == "pin" else c.unpin
                model = op(args.name, args.version, tier=args.tier)
                _emit(
                    settings,
                    model,
                    lambda m: (
                        f"{m['name']}:{m['version']} pinned in: {', '.join(m['pins']) or '-'}"
                    ),
                )
            elif action == "verify":
                if args.version is not None and args.name is None:
                    raise ValidationError("--version needs a model NAME")
                verified = {"verified": c.verify(args.name, args.version, progress=bars)}
                bars.close()
                _emit(settings, verified, _verify_text)
                if any(e.get("state") == "damaged" for e in verified["verified"]):
                    return 1
            elif action == "evict":
                evicted = c.evict(args.name, args.version, tier=args.tier)
                _emit(
                    settings,
                    {"evicted": evicted},
                    lambda r: f"evicted {args.name} from: {', '.join(r['evicted']) or 'nothing'}",
                )
        finally:
            bars.close()
    return 0
