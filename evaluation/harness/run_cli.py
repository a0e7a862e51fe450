"""``trims evaluate run``: evaluate manifests under LoadGen and record every result.

``trims evaluate run NAME_OR_FILE... --scenario S --mode M --sut direct|gateway|pipeline`` plans one
evaluation per manifest and batch size (``--batch 1,4,16`` sweeps), checks every manifest
before anything runs (validation, framework constraint, sources' sha256, builder, dataset:
:func:`.manifest_run.check_manifest`), then runs them one after another. Each
finished evaluation is recorded at once in the results database, one transaction each, so an
interrupted run leaves exactly the finished ones. Progress goes to stderr (one line per
evaluation; a bar while LoadGen runs when stderr is a terminal), a table to stdout at the end,
and ``--json OUT`` writes the system and the evaluations (written atomically, also after an
interruption, with what was recorded).

Note [interrupted evaluations]: Ctrl-C raises KeyboardInterrupt in the main thread, which
LoadGen's run holds until it returns (its C++ test loop does not run Python signal handlers),
so the evaluation in progress stops at its LoadGen run's end and is never recorded. The command
then lists what was recorded and what was not and exits 130. A failing evaluation (a crashed
function, an unreachable gateway) is reported and the others still run; the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from trims.errors import TrimsError, ValidationError
from trims.tables import text_table

if TYPE_CHECKING:
    from trims.evaluation.db import EvaluationRecord
    from trims.evaluation.harness.loadgen import LoadGenSettings
    from trims.evaluation.harness.manifest import Manifest

__all__ = ["Job", "configure", "parse_batches", "resolve_manifests", "run_run"]

log = logging.getLogger(__name__)

SCENARIO_NAMES = ("single-stream", "multi-stream", "server", "offline")
MODE_NAMES = ("performance", "accuracy", "both")
SUT_NAMES = ("direct", "gateway", "pipeline")
EXECUTOR_NAMES = ("local", "docker")
#: --quick: LoadGen runs this short (ms) with this many queries at least; results may be INVALID
QUICK_DURATION_MS = 300
QUICK_QUERIES = 16


def configure(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="evaluate models under MLPerf LoadGen and record the results",
        description=(
            "Evaluate manifests (shipped names or files) in one LoadGen scenario on a system "
            "under test; every finished evaluation is recorded in the results database."
        ),
    )
    parser.add_argument(
        "manifests", nargs="+", metavar="MANIFEST_OR_NAME",
        help="a shipped manifest's name (trims evaluate manifests) or a manifest file",
    )  # fmt: skip
    parser.add_argument("--scenario", choices=SCENARIO_NAMES, default="single-stream")
    parser.add_argument(
        "--mode", choices=MODE_NAMES, default="performance",
        help="performance, accuracy, or both (two LoadGen runs; default performance)",
    )  # fmt: skip
    parser.add_argument(
        "--sut", choices=SUT_NAMES, default="direct",
        help="the system under test: direct (default), gateway (a function), or pipeline (the "
        "shipped pipeline serving the model, e.g. digits-mlp; per-stage latencies)",
    )  # fmt: skip
    parser.add_argument(
        "--executor", choices=EXECUTOR_NAMES, default="local",
        help="the executor the gateway runs the function on (gateway only; default local)",
    )  # fmt: skip
    parser.add_argument(
        "--batch", default="1", metavar="N[,N...]",
        help="samples per predict call; a list runs one evaluation per size (default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--threads", type=int, default=1,
        help="intra-op threads (direct) or the function's cores and threads (gateway)",
    )  # fmt: skip
    parser.add_argument(
        "--workers", type=int, default=1, help="threads calling the system under test at once"
    )
    parser.add_argument(
        "--gateway", metavar="URL",
        help="the gateway of --sut gateway and pipeline (default $TRIMS_GATEWAY_URL)",
    )  # fmt: skip
    parser.add_argument("--token", help="admin bearer token (default $TRIMS_TOKEN)")
    parser.add_argument(
        "--code-dir", type=Path,
        help="the ONNX handler folder gateway evaluations deploy (default examples/onnx_zoo)",
    )  # fmt: skip
    parser.add_argument("--socket", type=Path, help="the store socket (default the usual one)")
    parser.add_argument(
        "--work-dir", type=Path,
        help="where built models are written (default a temporary folder, removed)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the results as JSON")
    parser.add_argument(
        "--db",
        help="SQLite path or SQLAlchemy URL; default $TRIMS_RESULTS_DB, else "
        "~/.local/share/trims/results.sqlite",
    )
    parser.add_argument(
        "--mlperf-defaults", action="store_true",
        help="LoadGen's MLPerf settings (10 minute runs) instead of the short defaults",
    )  # fmt: skip
    parser.add_argument("--min-duration", type=float, metavar="S", help="seconds per run")
    parser.add_argument("--min-queries", type=int, metavar="N", help="queries per run")
    parser.add_argument("--server-qps", type=float, metavar="Q", help="Server target QPS")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"{QUICK_DURATION_MS} ms runs of {QUICK_QUERIES}+ queries: a smoke test",
    )  # fmt: skip
    parser.add_argument("--mxnet-python", help="the MXNet environment's python")
    parser.set_defaults(run=run_run)


@dataclass(frozen=True)
class Job:
    """One planned evaluation: a checked manifest and its batch size."""

    manifest: Manifest
    framework_version: str
    batch: int

    def label(self, scenario: str, sut: str) -> str:
        m = self.manifest
        return f"{m.name} {m.framework.name} {scenario} {sut} batch {self.batch}"


def parse_batches(text: str) -> list[int]:
    """``1,4,16`` -> [1, 4, 16]; ValidationError naming --batch otherwise."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise ValidationError(
            f"--batch {text!r}: give batch sizes >= 1 separated by commas, e.g. 1,4,16",
            field="batch",
        )
    return list(dict.fromkeys(sizes))


def resolve_manifests(refs: list[str]) -> list[Path]:
    """Manifest files of ``refs``: a shipped manifest's name, or a file path."""
    from trims.evaluation.harness.manifest import shipped_manifest_paths

    shipped = {p.stem: p for p in shipped_manifest_paths()}
    out = []
    for ref in refs:
        if ref in shipped:
            out.append(shipped[ref])
        elif Path(ref).suffix in (".yaml", ".yml") or os.sep in ref or Path(ref).exists():
            out.append(Path(ref))
        else:
            raise ValidationError(
                f"{ref!r} is neither a shipped manifest nor a file; shipped: "
                f"{', '.join(sorted(shipped))}",
                field="manifests",
            )
    return out


def _settings(args: argparse.Namespace) -> LoadGenSettings:
    from trims.evaluation.harness.loadgen import LoadGenSettings

    duration = QUICK_DURATION_MS if args.quick else None
    queries = QUICK_QUERIES if args.quick else None
    if args.min_duration is not None:
        if args.min_duration <= 0:
            raise ValidationError("--min-duration must be > 0 seconds", field="min_duration")
        duration = int(args.min_duration * 1000)
    if args.min_queries is not None:
        if args.min_queries < 1:
            raise ValidationError("--min-queries must be >= 1", field="min_queries")
        queries = args.min_queries
    if args.server_qps is not None and args.server_qps <= 0:
        raise ValidationError("--server-qps must be > 0", field="server_qps")
    return LoadGenSettings(
        mlperf_defaults=args.mlperf_defaults,
        min_duration_ms=duration,
        min_query_count=queries,
        server_target_qps=args.server_qps,
    )


def _plan(args: argparse.Namespace) -> list[Job]:
    """Every evaluation, after every check: all problems in one ValidationError."""
    from trims.evaluation.harness.manifest import load_manifest
    from trims.evaluation.harness.manifest_run import check_manifest

    batches = parse_batches(args.batch)
    if args.threads < 1 or args.workers < 1:
        raise ValidationError("--threads and --workers must be >= 1")
    if args.sut == "direct" and args.executor != "local":
        raise ValidationError(
            f"--executor {args.executor} places the gateway's function; use it with --sut gateway",
            field="executor",
        )
    problems: list[str] = []
    jobs: list[Job] = []
    for path in resolve_manifests(args.manifests):
        try:
            manifest = load_manifest(path)
            version = check_manifest(manifest, args.sut)
        except TrimsError as e:
            problems.append(e.message)
            continue
        jobs.extend(Job(manifest, version, b) for b in batches)
    if problems:
        raise ValidationError(
            "\n".join(problems) + f"\nnothing was run: {len(problems)} manifest(s) are invalid"
        )
    return jobs


class _Progress:
    """Progress on stderr: a line per evaluation; a bar while one runs on a terminal."""

    def __init__(self, stream: TextIO, total: int, expected_s: float) -> None:
        self.stream = stream
        self.total = total
        self.expected_s = expected_s
        self.tty = stream.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self, text: str) -> None:
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()

    def start(self, index: int, label: str) -> None:
        self.line(f"[{index}/{self.total}] {label}: running")
        if self.tty:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._bar, args=(index, label), name="evaluate-progress", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _bar(self, index: int, label: str) -> None:
        start = time.monotonic()
        width = 30
        while not self._stop.wait(0.2):
            elapsed = time.monotonic() - start
            done = min(width, int(width * elapsed / max(self.expected_s, 0.1)))
            bar = "#" * done + "." * (width - done)
            self.stream.write(f"\r\x1b[K[{index}/{self.total}] {label} [{bar}] {elapsed:.1f} s")
            self.stream.flush()


def _outcome(record: EvaluationRecord) -> str:
    e = record.evaluation
    parts = ["VALID" if e.valid else "INVALID"]
    if e.qps is not None:
        parts.append(f"{e.qps:.1f} qps")
    if e.latency is not None:
        parts.append(f"p50 {e.latency.p50:.3f} ms")
    if e.accuracy is not None:
        parts.append(f"{e.accuracy.metric} {e.accuracy.value:.4f}")
    return ", ".join(parts)


def _json_entry(record: EvaluationRecord) -> dict[str, Any]:
    from trims.evaluation.harness.results import report_entry

    entry = report_entry(record)
    latency = entry["latency_ms"]
    return {
        "model": entry["model"],
        "version": entry["version"],
        "framework": entry["framework"],
        "scenario": entry["scenario"],
        "sut": entry["sut"],
        "mode": entry["mode"],
        "valid": entry["valid"],
        "qps": entry["qps"],
        "latency_ms": None if latency is None else {k: latency[k] for k in ("p50", "p90", "p99")},
        "accuracy": entry["accuracy"],
        **({"stages": entry["stages"]} if entry["stages"] else {}),
    }


def _write_json(path: Path, records: list[EvaluationRecord]) -> None:
    from trims.config import write_atomic
    from trims.evaluation.harness.results import describe_system

    body = {"system": describe_system(), "evaluations": [_json_entry(r) for r in records]}
    write_atomic(path, json.dumps(body, indent=2) + "\n")


def _table(records: list[EvaluationRecord], out: TextIO) -> None:
    header = ("id", "model", "framework", "scenario", "sut", "batch", "valid", "qps",
              "p50 ms", "p90 ms", "p99 ms", "accuracy (ref)")  # fmt: skip
    rows = []
    for r in records:
        e = r.evaluation
        lat, acc = e.latency, e.accuracy
        valid = "-" if e.valid is None else ("VALID" if e.valid else "INVALID")
        qps = "-" if e.qps is None else f"{e.qps:.1f}"
        lats = ["-"] * 3 if lat is None else [f"{v:.3f}" for v in (lat.p50, lat.p90, lat.p99)]
        accuracy = "-"
        if acc is not None:
            ref = "-" if acc.reference is None else f"{acc.reference:.4f}"
            accuracy = f"{acc.value:.4f} ({ref})"
        row = (str(r.id), e.manifest_name, e.framework, e.scenario, e.sut, str(e.batch), valid,
               qps, *lats, accuracy)  # fmt: skip
        rows.append(row)
    out.write(text_table(header, rows) + "\n")


def run_run(args: argparse.Namespace) -> int:
    from trims.evaluation.db import ResultsDB
    from trims.evaluation.harness.manifest_run import GatewayTarget, run_manifest
    from trims.evaluation.harness.results import (
        default_db_url,
        describe_system,
        project_revision,
        record_evaluation,
    )

    env = os.environ
    settings = _settings(args)
    jobs = _plan(args)
    gateway = None
    if args.sut in ("gateway", "pipeline"):
        from trims.runtime.credentials import find_token

        url = args.gateway or env.get("TRIMS_GATEWAY_URL")
        if not url:
            raise ValidationError(
                f"--sut {args.sut} needs the gateway: pass --gateway URL or set $TRIMS_GATEWAY_URL",
                field="gateway",
            )
        code_dir = args.code_dir or Path(__file__).resolve().parents[2] / "examples" / "onnx_zoo"
        gateway = GatewayTarget(
            url, code_dir, find_token(args.token, None, env), executor=args.executor
        )
    system, revision = describe_system(), project_revision()
    db = ResultsDB(str(args.db) if args.db else default_db_url(env))
    runs = 2 if args.mode == "both" else 1
    expected = runs * ((settings.min_duration_ms or 2000) / 1000.0)
    progress = _Progress(sys.stderr, len(jobs), expected)
    recorded: list[EvaluationRecord] = []
    labels: list[str] = []
    failed: list[str] = []
    index = 0
    try:
        with tempfile.TemporaryDirectory(prefix="trims-evaluate-") as tmp:
            work_dir = args.work_dir or Path(tmp)
            if args.work_dir is None and args.sut != "direct":
                # the gateway's workers (nobody when it runs as root) read the built models
                Path(tmp).chmod(0o755)
            for index, job in enumerate(jobs, 1):
                label = job.label(args.scenario, args.sut)
                progress.start(index, label)
                try:
                    result = run_manifest(
                        job.manifest, args.sut, args.scenario, args.mode, settings,
                        work_dir=work_dir, gateway=gateway, socket_path=args.socket,
                        batch=job.batch, workers=args.workers, threads=args.threads,
                        mxnet_python=args.mxnet_python, framework_version=job.framework_version,
                    )  # fmt: skip
                    record = record_evaluation(
                        db,
                        result.to_evaluation(args.mode, args.executor),
                        system=system,
                        revision=revision,
                    )
                except Exception as e:
                    progress.stop()
                    failed.append(label)
                    if isinstance(e, TrimsError):
                        why = e.message
                    else:
                        log.debug("evaluation %s failed", label, exc_info=True)
                        why = f"{type(e).__name__}: {e}"
                    progress.line(f"[{index}/{len(jobs)}] {label}: failed, not recorded: {why}")
                    continue
                progress.stop()
                recorded.append(record)
                labels.append(label)
                progress.line(
                    f"[{index}/{len(jobs)}] {label}: {_outcome(record)}; recorded as id {record.id}"
                )
    except KeyboardInterrupt:
        progress.stop()
        _finish(args, recorded, db)
        done = [f"{label} (id {r.id})" for label, r in zip(labels, recorded, strict=True)]
        lost = [
            f"{j.label(args.scenario, args.sut)} (interrupted)" for j in jobs[index - 1 : index]
        ]
        lost += [f"{j.label(args.scenario, args.sut)} (not started)" for j in jobs[index:]]
        lost += [f"{label} (failed)" for label in failed]
        sys.stderr.write(
            f"interrupted: {len(recorded)} evaluation(s) recorded: {'; '.join(done) or 'none'}\n"
            f"not recorded: {'; '.join(lost) or 'none'}\n"
        )
        return 130
    _finish(args, recorded, db)
    if failed:
        sys.stderr.write(
            f"{len(failed)} of {len(jobs)} evaluation(s) failed and were not recorded: "
            f"{'; '.join(failed)}\n"
        )
        return 1
    return 0


def _finish(args: argparse.Namespace, recorded: list[EvaluationRecord], db: Any) -> None:
    db.close()
    if recorded:
        _table(recorded, sys.stdout)
        sys.stdout.flush()
    if args.json is not None:
        _write_json(args.json, recorded)
