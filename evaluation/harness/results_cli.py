"""``trims evaluate ls | show | import | compare``: the evaluation results database from the
command line.

Each subcommand is a ``configure_X(parser)`` / ``run_X(args) -> int`` pair; :func:`configure`
adds them to the ``trims evaluate`` subparsers (each sets ``args.run``). The database is
``--db URL`` if given, else ``$TRIMS_RESULTS_DB``, else ``~/.local/share/trims/results.sqlite``
(:func:`trims.config.results_db`, the default ``trims analyze`` and ``trims trace`` use), read
once when the command runs. ``ls``, ``show`` and ``compare`` open it read-only: they never
create or migrate a database.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trims.errors import ValidationError

__all__ = [
    "configure",
    "configure_compare",
    "configure_import",
    "configure_ls",
    "configure_show",
    "run_compare",
    "run_import",
    "run_ls",
    "run_show",
]

_RELATIVE = re.compile(r"^(\d+)([dhm])$")
_UNIT_S = {"d": 86400, "h": 3600, "m": 60}


def _add_db(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--db",
        help=f"{what}: SQLite path or SQLAlchemy URL (postgresql+psycopg://USER@HOST/DB); "
        "default $TRIMS_RESULTS_DB, else ~/.local/share/trims/results.sqlite",
    )


def _db(args: argparse.Namespace) -> str:
    from trims.evaluation.harness.results import default_db_url

    return str(args.db) if args.db else default_db_url(os.environ)


def parse_since(text: str, now: float) -> float:
    """A Unix time from an ISO date or time (local time unless it says otherwise) or an age
    such as ``7d``, ``12h``, ``30m`` before ``now``."""
    match = _RELATIVE.match(text.strip())
    if match:
        return now - int(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        return dt.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValidationError(
            f"--since {text!r}: give a date (2025-01-31), a time (2025-01-31T14:00) or an age "
            "(7d, 12h, 30m)"
        ) from None


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="only this manifest name")
    parser.add_argument("--framework", help="only this framework (torch, onnxruntime, mxnet)")
    parser.add_argument("--scenario", help="only this scenario (single-stream, offline, ...)")
    parser.add_argument("--sut", help="only this system under test (direct, gateway, pipeline)")
    parser.add_argument("--system", help="only systems whose system_id starts with this")
    parser.add_argument("--since", help="only evaluations since a date, a time or an age (7d)")


def _filter(args: argparse.Namespace) -> Any:
    import time

    from trims.evaluation.harness.results import EvaluationFilter

    return EvaluationFilter(
        model=args.model,
        framework=args.framework,
        scenario=args.scenario,
        sut=args.sut,
        system=args.system,
        since=None if args.since is None else parse_since(args.since, time.time()),
    )


def configure_ls(parser: argparse.ArgumentParser) -> None:
    _add_filters(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_db(parser, "the database to list")


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ls_table(records: list[Any]) -> str:
    from trims.tables import text_table

    rows = []
    for r in records:
        e = r.evaluation
        acc = e.accuracy
        rows.append(
            [
                r.id,
                r.run_id[:8],
                f"{e.manifest_name}:{e.manifest_version}",
                f"{e.framework} {e.framework_version}",
                e.scenario,
                e.sut,
                e.mode,
                e.batch,
                {True: "yes", False: "NO", None: "-"}[e.valid],
                _cell(e.qps, ".1f"),
                _cell(None if e.latency is None else e.latency.p50, ".3f"),
                _cell(None if e.latency is None else e.latency.p99, ".3f"),
                "-" if acc is None else f"{acc.metric} {acc.value:.4f}",
                r.system_id,
                dt.datetime.fromtimestamp(r.created_at).strftime("%Y-%m-%d %H:%M"),
            ]
        )
    headers = ["id", "run", "model", "framework", "scenario", "sut", "mode", "batch", "valid",
               "qps", "p50 ms", "p99 ms", "accuracy", "system", "time"]  # fmt: skip
    return text_table(headers, rows, align="l" + "r" * len(headers), rule=True, float_format=".2f")


def run_ls(args: argparse.Namespace) -> int:
    from trims.evaluation.harness.results import list_evaluations, report_entry

    db = _db(args)
    records = list_evaluations(db, _filter(args))
    if args.json:
        print(json.dumps({"evaluations": [report_entry(r) for r in records]}, indent=2))
    elif not records:
        print(f"no evaluations in {db} match")
    else:
        print(_ls_table(records))
    return 0


def configure_show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", help="the evaluation's id, or 4+ characters of its run id")
    parser.add_argument("--json", action="store_true", help="print all fields as JSON")
    _add_db(parser, "the database to read")


def _show_text(record: Any) -> str:
    e = record.evaluation
    lines = [
        f"evaluation {record.id} (run {record.run_id})",
        f"  model        {e.manifest_name} {e.manifest_version}  manifest sha256 "
        f"{e.manifest_digest}",
        f"  model digest {e.model_digest or '-'}",
        f"  framework    {e.framework} {e.framework_version}",
        f"  run          {e.scenario}, {e.mode}, sut {e.sut}, executor {e.executor}, "
        f"batch {e.batch}, threads {e.threads}",
        f"  valid        {'-' if e.valid is None else e.valid}",
        f"  qps          {_cell(e.qps, '.3f')}",
    ]
    if e.latency is not None:
        lat = e.latency
        lines.append(
            f"  latency ms   p50 {lat.p50:.3f}  p90 {lat.p90:.3f}  p99 {lat.p99:.3f}  "
            f"mean {lat.mean:.3f}"
        )
    if e.accuracy is not None:
        acc = e.accuracy
        ref = "-" if acc.reference is None else f"{acc.reference:.4f}"
        lines.append(
            f"  accuracy     {acc.metric} {acc.value:.4f} (reference {ref}) on {acc.samples} "
            f"samples of {acc.dataset}"
        )
    created = dt.datetime.fromtimestamp(record.created_at).isoformat(timespec="seconds")
    lines += [
        f"  revision     {record.revision}{' (dirty)' if record.dirty else ''}",
        f"  recorded     {created}",
        f"  system       {record.system_id}",
        *("    " + line for line in json.dumps(record.system, indent=2).splitlines()),
        "  loadgen settings",
        *("    " + line for line in json.dumps(e.settings, indent=2).splitlines()),
        "  loadgen summary (verbatim)",
        e.summary,
    ]
    return "\n".join(lines)


def run_show(args: argparse.Namespace) -> int:
    from trims.evaluation.harness.results import get_evaluation

    record = get_evaluation(_db(args), args.id)
    if args.json:
        print(json.dumps(record.to_dict(), indent=2))
    else:
        print(_show_text(record))
    return 0


def configure_import(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="the database to copy from: a SQLite file or an SQLAlchemy URL"
    )
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    _add_db(parser, "the database to import into")


def run_import(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from trims.evaluation.harness.results import import_database

    report = import_database(args.source, _db(args))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(
            f"imported {report.added} evaluations ({report.skipped} already present) and "
            f"{report.traces_added} traces ({report.traces_skipped} already present) "
            f"from {report.source} into {report.target}"
        )
    return 0


def configure_compare(parser: argparse.ArgumentParser) -> None:
    _add_filters(parser)
    parser.add_argument(
        "--metric",
        default="p50",
        help="what each cell shows: p50, p90, p99, mean (latency, ms), qps or accuracy "
        "(default p50)",
    )
    parser.add_argument("--plots", type=Path, help="write one PNG bar chart per table here")
    parser.add_argument("--json", action="store_true", help="print the tables as JSON")
    _add_db(parser, "the database to compare from")


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _plot(comparison: Any, path: Path) -> Path:
    """Grouped bars: one group per row, one bar per column."""
    from trims.evaluation.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(comparison.rows) + 2), 4.5))
    width = 0.8 / max(1, len(comparison.columns))
    for k, column in enumerate(comparison.columns):
        heights = [row[k] if row[k] is not None else 0.0 for row in comparison.values]
        xs = [i + (k - (len(comparison.columns) - 1) / 2) * width for i in range(len(heights))]
        ax.bar(xs, heights, width, label=column)
    ax.set_xticks(list(range(len(comparison.rows))), comparison.rows, rotation=30, ha="right")
    ax.set_ylabel(f"{comparison.metric} ({comparison.unit})")
    ax.set_title(comparison.title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_compare(args: argparse.Namespace) -> int:
    from trims.evaluation.harness.results import compare, list_evaluations
    from trims.tables import text_table

    db = _db(args)
    comparisons = compare(list_evaluations(db, _filter(args)), args.metric)
    if args.json:
        print(json.dumps({"comparisons": [c.to_dict() for c in comparisons]}, indent=2))
    elif not any(c.rows for c in comparisons):
        print(f"no evaluations in {db} have {args.metric} to compare")
    else:
        for c in comparisons:
            if not c.rows:
                continue
            print(f"{c.title}: {c.metric} ({c.unit})")
            header = [c.row_header, *c.columns]
            rows = [[label, *values] for label, values in zip(c.rows, c.values, strict=True)]
            print(text_table(header, rows, align="l" + "r" * len(header), rule=True,
                             float_format=".2f") + "\n")  # fmt: skip
    if args.plots is not None:
        args.plots.mkdir(parents=True, exist_ok=True)
        for c in comparisons:
            if c.rows:
                path = _plot(c, args.plots / f"compare-{_slug(c.title)}.png")
                print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0


#: subcommand -> (configure, run, one-line help)
SUBCOMMANDS: dict[
    str,
    tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str],
] = {
    "ls": (configure_ls, run_ls, "list stored evaluations as a table (or JSON)"),
    "show": (configure_show, run_show, "one evaluation, all fields, LoadGen summary verbatim"),
    "import": (
        configure_import,
        run_import,
        "merge evaluations and traces from another results database (skipping run ids present)",
    ),
    "compare": (
        configure_compare,
        run_compare,
        "tables and plots: models x scenarios, frameworks and systems side by side",
    ),
}


def configure(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ls``, ``show``, ``import`` and ``compare`` to ``trims evaluate``; each sets
    ``args.run``."""
    for name, (configure_one, run_one, help_) in SUBCOMMANDS.items():
        parser = subparsers.add_parser(name, help=help_, description=help_)
        configure_one(parser)
        parser.set_defaults(run=run_one)
