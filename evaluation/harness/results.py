"""Evaluation results: record one, list and show them, merge another machine's database.

The rows live in :mod:`trims.evaluation.db` (schema, migrations, SQLite/PostgreSQL); this module
fills in what every evaluation records besides its measurements: the system description
(:func:`describe_system`), the project's revision (:func:`project_revision`), a run id and the
time. :func:`record_evaluation` is the one writer (one transaction, Note [one evaluation, one
transaction] in db.py); :func:`import_database` merges evaluations and traces from another
database, skipping run ids already present.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from trims import __version__
from trims.errors import ValidationError
from trims.evaluation.db import (
    AccuracyResult,
    Evaluation,
    EvaluationFilter,
    EvaluationRecord,
    Latency,
    ResultsDB,
    TraceRecord,
    cpu_model,
)

log = logging.getLogger(__name__)

__all__ = [
    "METRICS",
    "AccuracyResult",
    "Comparison",
    "Evaluation",
    "EvaluationFilter",
    "EvaluationRecord",
    "ImportReport",
    "Latency",
    "compare",
    "default_db_url",
    "describe_system",
    "get_evaluation",
    "import_database",
    "list_evaluations",
    "manifest_digest",
    "project_revision",
    "record_evaluation",
    "report_entry",
]

#: Distributions whose versions a system description lists (those installed).
FRAMEWORK_DISTRIBUTIONS = (
    "torch",
    "onnxruntime",
    "onnx",
    "mxnet",
    "numpy",
    "mlcommons-loadgen",
    "trims",
)


def default_db_url(environ: Mapping[str, str]) -> str:
    """The database ``trims analyze``, ``trims trace``, ``trims evaluate`` and the web UI share
    without ``--db``: :func:`trims.config.results_db` (``$TRIMS_RESULTS_DB``, else
    ``~/.local/share/trims/results.sqlite``)."""
    from trims.config import results_db

    return results_db(environ)


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of a manifest's canonical JSON (sorted keys, no spaces, UTF-8)."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _memory_bytes() -> int:
    return int(psutil.virtual_memory().total)


def _os_name() -> str:
    try:
        return platform.freedesktop_os_release()["PRETTY_NAME"]
    except (OSError, KeyError):
        return platform.platform()


def _gpus() -> list[dict[str, str]]:
    """GPUs from ``nvidia-smi`` where it exists: name, driver, memory; [] otherwise."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("nvidia-smi failed (%s): the system description lists no GPU", e)
        return []
    gpus = []
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 3:
            gpus.append({"name": fields[0], "driver": fields[1], "memory": fields[2]})
    return gpus


def _framework_versions() -> dict[str, str]:
    versions = {}
    for dist in FRAMEWORK_DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


@functools.cache
def _system() -> str:
    hardware: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "arch": platform.machine(),
        "memory_bytes": _memory_bytes(),
        "gpus": _gpus(),
    }
    memory = hardware["memory_bytes"]
    # The key names the hardware (memory to the GiB), not the software stack: the same machine
    # after a Python upgrade is the same system, whose stacks are then compared.
    identity = {
        "cpu": hardware["cpu"],
        "cores": hardware["cores"],
        "arch": hardware["arch"],
        "memory_gib": round(memory / 2**30),
        "gpus": [g["name"] for g in hardware["gpus"]],
    }
    description = {
        "system_id": manifest_digest(identity)[:12],
        **hardware,
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "frameworks": _framework_versions(),
    }
    return json.dumps(description)


def describe_system() -> dict[str, Any]:
    """This machine: system_id (a 12-hex key of the hardware), cpu, cores, arch, memory_bytes,
    gpus (name, driver, memory; from nvidia-smi), kernel, os, python, frameworks (versions)."""
    description: dict[str, Any] = json.loads(_system())
    return description


def project_revision() -> tuple[str, bool]:
    """(``git rev-parse HEAD``, dirty) when trims runs from a git checkout, else
    (the package version, False)."""
    root = Path(__file__).resolve().parents[2]
    git = shutil.which("git")
    if git is not None and (root / ".git").exists():
        try:
            head = subprocess.run(
                [git, "-C", str(root), "rev-parse", "HEAD"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout.strip()  # fmt: skip
            status = subprocess.run(
                [git, "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout  # fmt: skip
            return head, bool(status.strip())
        except (OSError, subprocess.SubprocessError) as e:
            log.info("git cannot read %s (%s): recording the package version instead", root, e)
    return __version__, False


@contextlib.contextmanager
def _opened(db: ResultsDB | str, *, readonly: bool) -> Iterator[tuple[ResultsDB, bool]]:
    """The database and whether we opened it; one we opened is closed on exit."""
    if isinstance(db, ResultsDB):
        yield db, False
        return
    store = ResultsDB(db, readonly=readonly)
    try:
        yield store, True
    finally:
        store.close()


def record_evaluation(
    db: ResultsDB | str,
    evaluation: Evaluation,
    *,
    traces: Iterable[TraceRecord] = (),
    system: Mapping[str, Any] | None = None,
    revision: tuple[str, bool] | None = None,
) -> EvaluationRecord:
    """Store ``evaluation`` (and ``traces`` recorded with it) in one transaction.

    Fills in a new run id, the time, the system description (:func:`describe_system` unless
    given) and the project revision (:func:`project_revision` unless given). Returns the
    stored record with its id. On any error nothing is stored.
    """
    description = dict(describe_system() if system is None else system)
    rev, dirty = project_revision() if revision is None else revision
    record = EvaluationRecord(
        evaluation=evaluation,
        run_id=str(uuid.uuid4()),
        created_at=time.time(),
        system_id=str(description.get("system_id", "")),
        system=description,
        revision=rev,
        dirty=dirty,
    )
    with _opened(db, readonly=False) as (store, owned):
        row_id = store.put_evaluation(record, traces)
        log.info("evaluation %s of %s (%s, %s) recorded in %s as id %d", record.run_id,
                 evaluation.manifest_name, evaluation.scenario, evaluation.sut,
                 store.url if owned else "the results database", row_id)  # fmt: skip
    return replace(record, id=row_id)


def list_evaluations(
    db: ResultsDB | str, where: EvaluationFilter | None = None
) -> list[EvaluationRecord]:
    """Stored evaluations matching ``where``, oldest first; a URL is opened read-only."""
    with _opened(db, readonly=True) as (store, _):
        return store.evaluations(where)


def get_evaluation(db: ResultsDB | str, ref: int | str) -> EvaluationRecord:
    """One evaluation by id or run id prefix; NotFound naming the database otherwise."""
    with _opened(db, readonly=True) as (store, _):
        return store.get_evaluation(ref)


@dataclass(frozen=True)
class ImportReport:
    """What an import did: evaluations and traces added and skipped (already present)."""

    source: str
    target: str
    source_schema: int
    added: int
    skipped: int
    traces_added: int
    traces_skipped: int


def import_database(source: str, target: str) -> ImportReport:
    """Copy evaluations and traces from ``source`` into ``target``, in one transaction.

    The source is opened read-only (never migrated; refused if a newer trims wrote it); the
    target is created or migrated to this schema. Run ids and trace ids already in the target
    are skipped, so importing the same database twice adds nothing the second time.
    """
    src = ResultsDB(source, readonly=True)
    try:
        records, traces, source_schema = src.evaluations(), src.traces(), src.version
    finally:
        src.close()
    dst = ResultsDB(target)
    try:
        added, skipped, t_added, t_skipped = dst.merge(records, traces)
    finally:
        dst.close()
    log.info("imported %d evaluations (%d already present) and %d traces (%d already present) "
             "from %s into %s", added, skipped, t_added, t_skipped, source, target)  # fmt: skip
    return ImportReport(source, target, source_schema, added, skipped, t_added, t_skipped)


def report_entry(record: EvaluationRecord) -> dict[str, Any]:
    """The ``--json`` form of one evaluation: model, version, framework, scenario, sut, mode,
    valid, qps, latency_ms {p50, p90, p99, mean}, accuracy {metric, value, reference, dataset,
    samples} or null, stages (a pipeline's per-stage latency percentiles, ms) or null, and where
    it came from (id, run_id, system_id, executor, batch, threads, created_at, revision)."""
    e = record.evaluation
    return {
        "id": record.id,
        "run_id": record.run_id,
        "model": e.manifest_name,
        "version": e.manifest_version,
        "framework": e.framework,
        "framework_version": e.framework_version,
        "scenario": e.scenario,
        "sut": e.sut,
        "mode": e.mode,
        "executor": e.executor,
        "batch": e.batch,
        "threads": e.threads,
        "valid": e.valid,
        "qps": e.qps,
        "latency_ms": None if e.latency is None else asdict(e.latency),
        "accuracy": None if e.accuracy is None else asdict(e.accuracy),
        # per-stage latency percentiles of a pipeline run (Note [stages in the settings JSON]
        # in manifest_run.py); None for other systems under test
        "stages": e.settings.get("stages"),
        "system_id": record.system_id,
        "created_at": record.created_at,
        "revision": record.revision,
        "dirty": record.dirty,
    }


#: metric name -> (what it reads from an evaluation, its unit)
METRICS: dict[str, tuple[Callable[[Evaluation], float | None], str]] = {
    "p50": (lambda e: None if e.latency is None else e.latency.p50, "ms"),
    "p90": (lambda e: None if e.latency is None else e.latency.p90, "ms"),
    "p99": (lambda e: None if e.latency is None else e.latency.p99, "ms"),
    "mean": (lambda e: None if e.latency is None else e.latency.mean, "ms"),
    "qps": (lambda e: e.qps, "queries/s"),
    "accuracy": (lambda e: None if e.accuracy is None else e.accuracy.value, "fraction"),
}


@dataclass(frozen=True)
class Comparison:
    """One side-by-side table: ``values[i][j]`` is ``metric`` of row i under column j (None
    where nothing was measured)."""

    title: str
    metric: str
    unit: str
    row_header: str
    rows: list[str]
    columns: list[str]
    values: list[list[float | None]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _model(e: Evaluation) -> str:
    batch = f" b{e.batch}" if e.batch != 1 else ""
    return f"{e.manifest_name}:{e.manifest_version}{batch}"


_Label = Callable[[EvaluationRecord], str]
#: title -> (row header, row label, column label)
_VIEWS: dict[str, tuple[str, _Label, _Label]] = {
    "models x scenarios": (
        "model framework sut",
        lambda r: f"{_model(r.evaluation)} {r.evaluation.framework} {r.evaluation.sut}",
        lambda r: r.evaluation.scenario,
    ),
    "frameworks side by side": (
        "model scenario sut",
        lambda r: f"{_model(r.evaluation)} {r.evaluation.scenario} {r.evaluation.sut}",
        lambda r: r.evaluation.framework,
    ),
    "systems side by side": (
        "model framework scenario sut",
        lambda r: (
            f"{_model(r.evaluation)} {r.evaluation.framework} {r.evaluation.scenario} "
            f"{r.evaluation.sut}"
        ),
        lambda r: r.system_id,
    ),
}


def compare(records: Iterable[EvaluationRecord], metric: str = "p50") -> list[Comparison]:
    """Models x scenarios, frameworks side by side and systems side by side, each cell the
    newest evaluation that measured ``metric`` (one of :data:`METRICS`)."""
    if metric not in METRICS:
        raise ValidationError(f"metric {metric!r} is not one of {', '.join(METRICS)}")
    read, unit = METRICS[metric]
    ordered = sorted(records, key=lambda r: (r.created_at, r.id or 0))
    tables = []
    for title, (row_header, row_of, column_of) in _VIEWS.items():
        cells: dict[tuple[str, str], float] = {}
        for record in ordered:
            value = read(record.evaluation)
            if value is not None:
                cells[row_of(record), column_of(record)] = value
        rows = sorted({r for r, _ in cells})
        columns = sorted({c for _, c in cells})
        values = [[cells.get((r, c)) for c in columns] for r in rows]
        tables.append(Comparison(title, metric, unit, row_header, rows, columns, values))
    return tables
