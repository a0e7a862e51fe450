"""The ``evaluate`` benchmark function: LoadGen evaluations of shipped manifests, on the runtime.

Deploy ``examples/evaluate/function.yaml`` (``trims up --examples`` does) and invoke it with::

    trims functions invoke evaluate --data '{"models": ["digits-mlp"], "scenario": "offline",
                                             "mode": "both", "batch": 32}'

The answer is the JSON of ``trims evaluate run --json``: ``{"system": {...}, "evaluations":
[...]}``, one entry per model (:func:`trims.evaluation.harness.results.report_entry`), each
recorded in the results database before the answer is sent. Settings a request may give
(:data:`FIELDS`): ``models`` (required: names of shipped manifests, ``trims evaluate
manifests``), ``scenario`` (``single-stream``, ``multi-stream``, ``server``, ``offline``;
default ``single-stream``), ``mode`` (``performance``, ``accuracy``, ``both``; default
``performance``), ``sut`` (``direct``, the only one a function runs: the model in the
function's own process, mapped from the store when it holds the model), ``batch``, ``threads``
(intra-op threads), ``workers`` (threads calling the model) and ``settings`` (LoadGen's:
``min_duration_ms``, ``min_query_count``, seeds, Server QPS and latency bound, ...; the fields of
:class:`~trims.evaluation.harness.loadgen.LoadGenSettings` but ``mlperf_defaults``).

Every setting is type- and bound-checked (:data:`LIMITS`), every model name resolved to its
shipped manifest and its framework constraint checked, before any model loads; a bad request
costs nothing and writes nothing. Each LoadGen run stops issuing queries after
``max_duration_ms`` (at most :data:`LIMITS` ``max_duration_ms``, also the default), so no
request holds the instance for long: at most ``models`` x 2 runs x that bound, plus loading.

As with the other benchmark functions, a request names models, never paths, so a caller cannot
make the function read files of its choosing; where results are kept (``db``: a SQLite path or
a PostgreSQL URL), where built models go (``work_dir``), the store socket (``store_socket``) and
the executor recorded with each evaluation (``executor``) are the deployment's, from the
function's ``config``. Under docker and kubernetes the root filesystem is read-only: ``db``
and ``work_dir`` must be on a mounted volume, or ``db`` a PostgreSQL URL.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.errors import TrimsError, ValidationError
from trims.evaluation.harness.loadgen import SCENARIOS, LoadGenSettings
from trims.evaluation.harness.run import RUN_MODES
from trims.evaluation.requests import check_type, typed_fields

if TYPE_CHECKING:
    from trims.runtime.functions import Context, Request

__all__ = [
    "EXECUTORS",
    "FIELDS",
    "LIMITS",
    "SETTINGS_LIMITS",
    "EvaluateRequest",
    "checked",
    "handler",
    "shipped_manifests",
]

log = logging.getLogger(__name__)

#: request field -> the JSON types it may have
FIELDS: dict[str, tuple[type, ...]] = {
    "models": (list, str),
    "scenario": (str,),
    "mode": (str,),
    "sut": (str,),
    "batch": (int,),
    "threads": (int,),
    "workers": (int,),
    "settings": (dict,),
}
#: the most a request may ask of one instance: field -> bound
LIMITS: dict[str, int] = {"models": 8, "batch": 256, "threads": 16, "workers": 16}
#: LoadGen settings a request may give -> their bound (None: any value of the right type).
#: ``max_duration_ms`` also caps every run whose request leaves it out.
SETTINGS_LIMITS: dict[str, float | None] = {
    "min_duration_ms": 30_000,
    "max_duration_ms": 60_000,
    "min_query_count": 100_000,
    "max_query_count": 1_000_000,
    "performance_sample_count": 10_000,
    "mlperf_benchmark": None,
    "qsl_rng_seed": None,
    "sample_index_rng_seed": None,
    "schedule_rng_seed": None,
    "single_stream_target_latency_percentile": 1.0,
    "multi_stream_target_latency_percentile": 1.0,
    "server_target_latency_percentile": 1.0,
    "single_stream_expected_latency_ms": None,
    "multi_stream_expected_latency_ms": None,
    "multi_stream_samples_per_query": 1024,
    "server_target_qps": 10_000,
    "server_target_latency_ms": None,
    "offline_expected_qps": None,
}
#: the executors an evaluation may be recorded under (``config.executor``)
EXECUTORS = ("local", "docker", "kubernetes")


@dataclass(frozen=True)
class EvaluateRequest:
    """One checked request: the manifests by name and how to run each."""

    models: tuple[str, ...]
    scenario: str = "single-stream"
    mode: str = "performance"
    sut: str = "direct"
    batch: int = 1
    threads: int = 1
    workers: int = 1
    settings: LoadGenSettings = dataclasses.field(default_factory=LoadGenSettings)


def shipped_manifests() -> dict[str, Path]:
    """Shipped manifest name -> its file (the only models a request may name)."""
    from trims.evaluation.harness.manifest import shipped_manifest_paths

    return {path.stem: path for path in shipped_manifest_paths()}


def _loadgen_settings(given: Mapping[str, Any]) -> LoadGenSettings:
    fields = {f.name: f for f in dataclasses.fields(LoadGenSettings)}
    unknown = sorted(set(given) - set(SETTINGS_LIMITS))
    if unknown:
        raise ValidationError(
            f"unknown LoadGen settings {unknown}; a request may give {sorted(SETTINGS_LIMITS)} "
            "(the MLPerf defaults run for 10 minutes: use trims evaluate run --mlperf-defaults)",
            field="settings",
        )
    values: dict[str, Any] = {}
    for key, value in given.items():
        field = f"settings.{key}"
        types: tuple[type, ...] = (str,) if key == "mlperf_benchmark" else (int,)
        if "float" in str(fields[key].type):
            types = (int, float)
        check_type(field, value, types)
        bound = SETTINGS_LIMITS[key]
        if isinstance(value, int | float) and (value < 0 or (bound is not None and value > bound)):
            raise ValidationError(
                f"setting {field!r} must be between 0 and {bound:g} for the evaluate function, "
                f"got {value!r}"
                if bound is not None
                else f"setting {field!r} must be >= 0, got {value!r}",
                field=field,
            )
        values[key] = value
    values.setdefault("max_duration_ms", int(SETTINGS_LIMITS["max_duration_ms"] or 0))
    return LoadGenSettings(**values)


def checked(body: object) -> EvaluateRequest:
    """The request, type- and bound-checked; ValidationError saying what to fix."""
    if not isinstance(body, dict) or "models" not in body:
        raise ValidationError(
            'send a JSON object {"models": ["digits-mlp"], "scenario": '
            f'"{"|".join(SCENARIOS)}", "mode": "{"|".join(RUN_MODES)}", "batch": B, '
            '"threads": T, "settings": {"min_duration_ms": 2000}}'
        )
    out = typed_fields(body, FIELDS)
    for key, value in out.items():
        if key in LIMITS and key != "models" and not 1 <= value <= LIMITS[key]:
            raise ValidationError(
                f"setting {key!r} must be between 1 and {LIMITS[key]} for the evaluate function, "
                f"got {value!r}",
                field=key,
            )
    models = out.pop("models")
    names = [models] if isinstance(models, str) else models
    shipped = shipped_manifests()
    refused = [n for n in names if not isinstance(n, str) or n not in shipped]
    if refused or not names:
        raise ValidationError(
            f"models {refused or names} are not shipped manifests; a request names models "
            f"(one of {', '.join(sorted(shipped))}; see trims evaluate manifests), not paths",
            field="models",
        )
    if len(names) > LIMITS["models"]:
        raise ValidationError(
            f"setting 'models' names at most {LIMITS['models']} models for the evaluate "
            f"function, got {len(names)}; send several requests",
            field="models",
        )
    if out.get("scenario", "single-stream") not in SCENARIOS:
        raise ValidationError(
            f"unknown scenario {out['scenario']!r}; choose one of {', '.join(SCENARIOS)}",
            field="scenario",
        )
    if out.get("mode", "performance") not in RUN_MODES:
        raise ValidationError(
            f"unknown mode {out['mode']!r}; choose one of {', '.join(RUN_MODES)}", field="mode"
        )
    if out.get("sut", "direct") != "direct":
        raise ValidationError(
            f"sut {out['sut']!r}: the evaluate function runs the direct system under test (the "
            "model in its own process); evaluate gateway or pipeline systems with trims evaluate "
            "run --sut, which deploys them",
            field="sut",
        )
    settings = _loadgen_settings(out.pop("settings", {}))
    return EvaluateRequest(models=tuple(dict.fromkeys(names)), settings=settings, **out)


def _config_path(ctx: Context, key: str, default: Path) -> str:
    value = ctx.config.get(key)
    return str(value) if value else str(default)


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    from trims.config import data_dir, results_db
    from trims.evaluation.harness.manifest import load_manifest
    from trims.evaluation.harness.manifest_run import check_manifest, run_manifest
    from trims.evaluation.harness.results import describe_system, record_evaluation, report_entry

    req = checked(request.json())
    executor = str(ctx.config.get("executor") or "local")
    if executor not in EXECUTORS:
        raise ValidationError(
            f"config.executor {executor!r} of the evaluate function is not one of "
            f"{', '.join(EXECUTORS)}; fix the function's spec",
            field="config.executor",
        )
    shipped = shipped_manifests()
    manifests = [load_manifest(shipped[name]) for name in req.models]
    # Every check before the first model loads: a request refused here wrote nothing.
    versions = [check_manifest(manifest, req.sut) for manifest in manifests]
    db = str(ctx.config.get("db") or results_db(os.environ))
    work_dir = Path(_config_path(ctx, "work_dir", data_dir(os.environ).parent / "evaluate-models"))
    ctx.logger.info(
        "evaluation of %s (%s, %s, batch %d) requested; results go to %s",
        ", ".join(req.models), req.scenario, req.mode, req.batch, db.split("@")[-1],
    )  # fmt: skip
    recorded: list[dict[str, Any]] = []
    for manifest, version in zip(manifests, versions, strict=True):
        try:
            result = run_manifest(
                manifest, req.sut, req.scenario, req.mode, req.settings,
                work_dir=work_dir, socket_path=ctx.config.get("store_socket") or None,
                batch=req.batch, workers=req.workers, threads=req.threads,
                mxnet_python=ctx.config.get("mxnet_python"), framework_version=version,
            )  # fmt: skip
            row = result.to_evaluation(req.mode, executor)
            recorded.append(report_entry(record_evaluation(db, row)))
        except TrimsError as e:
            # Note [one evaluation, one transaction] (db.py): what completed stays recorded, the
            # failed model wrote nothing, and the caller learns which ids were recorded.
            ids = ", ".join(str(r["id"]) for r in recorded) or "none"
            raise type(e)(
                f"evaluating {manifest.name}: {e.message} (recorded before it: ids {ids})",
                **e.details,
            ) from e
    return {"system": describe_system(), "evaluations": recorded}
