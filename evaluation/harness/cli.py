"""`trims evaluate`: the evaluation platform's command, one subcommand per module.

Each subcommand module exposes ``configure(subparsers)``, which adds its parser with
``set_defaults(run=FUNCTION)``; :data:`SUBCOMMANDS` lists those modules, imported when
``trims evaluate`` runs (they must import nothing heavy at module level). This module owns the
parser skeleton and ``manifests`` (list and validate the evaluation manifests).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trims.errors import TrimsError, ValidationError

__all__ = ["SUBCOMMANDS", "configure", "configure_manifests", "run", "run_manifests"]

log = logging.getLogger(__name__)

#: modules whose ``configure(subparsers)`` adds a subcommand, in the order of ``--help``
SUBCOMMANDS: tuple[str, ...] = (
    "trims.evaluation.harness.cli",
    "trims.evaluation.harness.results_cli",
    "trims.evaluation.harness.run_cli",
)


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the subcommands of every module in :data:`SUBCOMMANDS`."""
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for name in SUBCOMMANDS:
        if name == __name__:
            configure_manifests(subparsers)
        else:
            importlib.import_module(name).configure(subparsers)


def run(args: argparse.Namespace) -> int:
    handler: Callable[[argparse.Namespace], int] = args.run
    return int(handler(args) or 0)


def configure_manifests(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "manifests",
        help="list and validate evaluation manifests",
        description="List the shipped evaluation manifests (or the given files) as a table.",
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, metavar="PATH",
        help="manifest files or folders (default: the shipped manifests)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print a JSON list instead")
    parser.add_argument(
        "--validate", action="store_true",
        help="also check datasets, source files and checksums; exit 1 listing every error",
    )  # fmt: skip
    parser.set_defaults(run=run_manifests)


def run_manifests(args: argparse.Namespace) -> int:
    from trims.evaluation.harness.manifest import (
        Manifest,
        load_manifest,
        shipped_manifest_paths,
    )

    paths = _expand(args.paths) if args.paths else shipped_manifest_paths()
    manifests: list[Manifest] = []
    errors: list[str] = []
    for path in paths:
        try:
            manifest = load_manifest(path, check_dataset=args.validate)
            if args.validate:
                manifest.verify_sources()
        except TrimsError as e:
            errors.append(e.message)
            continue
        manifests.append(manifest)
    if args.validate or errors:
        for message in errors:
            print(message, file=sys.stderr)
        if errors:
            print(f"{len(errors)} of {len(paths)} manifests are invalid", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps([_summary(m) for m in manifests], indent=2))
    elif args.validate:
        print(f"{len(manifests)} manifests valid")
    else:
        _table(manifests)
    return 0


def _expand(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")))
        else:
            out.append(path)
    if not out:
        raise ValidationError(f"no manifest files in {', '.join(map(str, paths))}")
    return out


def _summary(manifest: Any) -> dict[str, Any]:
    accuracy = manifest.accuracy
    return {
        "name": manifest.name,
        "version": manifest.version,
        "task": manifest.task,
        "framework": manifest.framework.name,
        "weights": manifest.model.weights,
        "accuracy": None
        if accuracy is None
        else {"metric": accuracy.metric, "reference": accuracy.reference},
    }


def _table(manifests: list[Any]) -> None:
    from trims.tables import text_table

    header = ("name", "version", "task", "framework", "weights", "dataset", "accuracy")
    rows = []
    for m in manifests:
        acc = m.accuracy
        metric = "-" if acc is None else f"{acc.metric}{acc.k or ''} {acc.reference:.4f}"
        dataset = f"{m.dataset.name}/{m.dataset.split}"
        rows.append((m.name, m.version, m.task, m.framework.name, m.model.weights, dataset,
                     metric))  # fmt: skip
    print(text_table(header, rows))
