"""The evaluation case study: shipped manifests x scenarios x systems under test, one command.

    python bench/case_study.py --json OUT.json            # the full study (~20 min on 2 cores)
    python bench/case_study.py --quick --json OUT.json    # 2 small models, short runs, QUICK
    python bench/case_study.py --plan                     # what would run, as JSON; runs nothing

Every model is a shipped manifest (``trims evaluate manifests``) evaluated with the harness's
own API (:func:`.manifest_run.run_manifest`) in SingleStream and Offline, and in
Server for ``--server-models``, on two systems under test: ``direct`` (the model in this
process) and ``gateway`` (deployed as a function on a ``trims gateway --no-auth`` subprocess
this script starts on 127.0.0.1, port 0, local executor, and invoked over the Open Inference
Protocol). Manifests with real weights and labels run in mode ``both`` (performance, then
accuracy over the whole dataset split); the others in ``performance``. Each run is recorded
with :func:`trims.evaluation.harness.results.record_evaluation` in the results database the
output names (``--db``; default ``OUT.sqlite`` beside ``--json``, else a temporary file), so
``trims evaluate compare --db ...`` draws the same tables.

LoadGen settings are short but VALID (``--min-duration-ms``, 1 s; ``--min-queries`` for
SingleStream, 64, what LoadGen's early stopping needs at the 90th percentile; Server needs 512
queries for the same reason at the 99th): Server's target QPS is half the direct
SingleStream rate (at most ``--server-max-qps``); Offline (batch ``--offline-batch``) lets the
harness measure each SUT's rate first (Note [offline calibration] in run.py). Each model runs on
the systems under test its framework has (``SUT_KINDS`` in manifest_run.py); a step the harness
refuses is listed under ``skipped`` with its reason, not hidden. MXNet models run on the gateway
in its ``mxnet`` environment (``--environment mxnet=PYTHON``, the MXNet venv the direct MXNet
system under test uses).

Harness overhead: for each ONNX Runtime model, the direct SingleStream p50 under LoadGen against
a bare timing loop over the same ``predict`` call (``bench/evaluation.py`` measures this pair
alternately, which is the better estimate on a loaded machine).

Writes ``OUT.json`` (``{"machine", "load_average": {"start", "end"}, "quick", "db",
"settings", "evaluations": [report_entry...], "harness": [{"model", "bare_p50_ms",
"loadgen_p50_ms", "ratio"}], "skipped": [{"model", "sut", "scenario", "reason"}],
"elapsed_s"}``) and ``OUT.md`` (the table), or prints both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import REPO, machine, start_gateway, write_report

ONNX_HANDLER = REPO / "examples" / "onnx_zoo"
#: The full study: real weights first (accuracy), then the performance-only models.
DEFAULT_MODELS = (
    "digits-mlp",
    "mnist-cnn-onnxruntime",
    "mnist-cnn-torch",
    "als-ml100k",
    "all-minilm-l6-v2",
    "onnx-squeezenet",
    "onnx-shufflenet",
    "onnx-alexnet",
    "onnx-inception_v1",
    "onnx-zfnet512",
    "onnx-resnet50",
    "onnx-densenet121",
    "torch-resnet18",
    "torch-resnet50",
    "torch-vgg11",
)
DEFAULT_SERVER_MODELS = ("digits-mlp", "mnist-cnn-onnxruntime", "mnist-cnn-torch", "als-ml100k")
QUICK_MODELS = ("digits-mlp", "mnist-cnn-onnxruntime")
SCENARIOS = ("single-stream", "offline", "server")
#: SingleStream's min query count: LoadGen's early stopping judges the 90th percentile and
#: calls a run of fewer than 64 queries INVALID however long it lasted; with 16 queries the
#: CNNs' runs (20-120 ms a query) were INVALID. 64 queries take at most 8 s for the slowest
#: model here, so each run lasts max(min duration, 64 queries) and is VALID.
SINGLE_STREAM_MIN_QUERIES = 64
SUTS = ("direct", "gateway")


def mxnet_models() -> list[str]:
    """Shipped MXNet manifests (they exist once the harness has an MXNet system under test)."""
    from trims.evaluation.harness.manifest import load_manifest, shipped_manifest_paths

    return [
        p.stem
        for p in shipped_manifest_paths()
        if load_manifest(p, check_dataset=False).framework.name == "mxnet"
    ]


def mxnet_environment() -> list[str]:
    """The gateway's ``--environment mxnet=PYTHON`` for the MXNet environment (the one the
    direct MXNet system under test uses), or nothing when there is none: the MXNet gateway
    steps are then skipped with the gateway's reason."""
    from trims.evaluation.mxnet_backend import find_python

    python = find_python()
    return ["--environment", f"mxnet={python}"] if Path(python).is_file() else []


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(model, scenario, sut) in run order: per model SingleStream first (it sizes the rest)."""
    models = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else (
        *DEFAULT_MODELS, *mxnet_models()))  # fmt: skip
    server = set(args.server_models.split(",")) if args.server_models else set(
        QUICK_MODELS if args.quick else DEFAULT_SERVER_MODELS)  # fmt: skip
    from trims.evaluation.harness.function import shipped_manifests
    from trims.evaluation.harness.manifest import load_manifest
    from trims.evaluation.harness.manifest_run import SUT_KINDS

    shipped = shipped_manifests()
    unknown = sorted(set(models) - set(shipped))
    if unknown:
        raise SystemExit(f"not shipped manifests: {', '.join(unknown)}")
    steps = []
    for model in models:
        framework = load_manifest(shipped[model], check_dataset=False).framework.name
        for scenario in SCENARIOS:
            if scenario == "server" and model not in server:
                continue
            for sut in (s for s in SUTS if s in SUT_KINDS.get(framework, SUTS)):
                steps.append({"model": model, "scenario": scenario, "sut": sut})
    return steps


def harness_overhead(manifest: Any, work_dir: Path, seconds: float) -> float:
    """The bare-loop p50 of the direct ONNX Runtime SUT over the manifest's samples."""
    from trims.evaluation.harness.manifest_run import manifest_model_file, manifest_samples
    from trims.evaluation.harness.run import bare_loop_p50_ms
    from trims.evaluation.harness.sut import DirectSUT

    path = manifest_model_file(manifest, work_dir)
    samples = manifest_samples(manifest)
    sut = DirectSUT.onnx(manifest.name, path, socket_path=work_dir / "no-store.sock")
    try:
        for x in samples.inputs[:8]:
            sut.predict([x])
        return bare_loop_p50_ms(sut, list(samples.inputs), seconds, min_calls=32)
    finally:
        sut.close()


class Study:
    """Runs the plan against one gateway and one database; collects what the JSON reports."""

    def __init__(self, args: argparse.Namespace, url: str, root: Path, db: str) -> None:
        from trims.evaluation.harness.loadgen import LoadGenSettings
        from trims.evaluation.harness.manifest_run import GatewayTarget

        self.args = args
        self.db = db
        self.work_dir = root / "models"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.chmod(0o755)  # the gateway's workers (nobody when root) read the models
        self.gateway = GatewayTarget(url=url, code_dir=ONNX_HANDLER)
        # SingleStream pre-generates min duration / expected latency queries: sub-50 us models
        # (digits-mlp, ALS) ran out of them before the min duration at LoadGen's short 0.05 ms.
        self.base = LoadGenSettings(
            min_duration_ms=args.min_duration_ms, min_query_count=args.min_queries,
            single_stream_expected_latency_ms=0.005,
        )  # fmt: skip
        self.single: dict[tuple[str, str], float] = {}
        self.evaluations: list[dict[str, Any]] = []
        self.harness: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []

    def settings(self, model: str, scenario: str, sut: str) -> tuple[Any, int]:
        """LoadGen settings and batch of one step, sized by the SingleStream rates measured."""
        if scenario == "server":
            # Both systems get the same arrival rate, half the slower one's SingleStream rate.
            rates = [r for k in ("direct", "gateway") if (r := self.single.get((model, k)))]
            rate = min(rates) if rates else 2.0
            qps = round(min(self.args.server_max_qps, 0.5 * rate), 1)
            return dataclasses.replace(self.base, min_query_count=None, server_target_qps=qps), 1
        if scenario == "offline":
            # The harness measures the Offline rate first (Note [offline calibration], run.py).
            return self.base, self.args.offline_batch
        return self.base, 1

    def step(self, manifest: Any, scenario: str, sut: str) -> None:
        from trims.errors import TrimsError
        from trims.evaluation.harness.manifest_run import run_manifest
        from trims.evaluation.harness.results import record_evaluation, report_entry

        mode = "both" if manifest.accuracy is not None else "performance"
        settings, batch = self.settings(manifest.name, scenario, sut)
        t0 = time.monotonic()
        try:
            result = run_manifest(
                manifest, sut, scenario, mode, settings, work_dir=self.work_dir,
                gateway=self.gateway, socket_path=self.work_dir / "no-store.sock",
                batch=batch, threads=self.args.threads,
            )  # fmt: skip
        except Exception as e:  # a step that fails is reported, the study goes on
            text = e.message if isinstance(e, TrimsError) else f"{type(e).__name__}: {e}"
            reason = text.splitlines()[0] if text else type(e).__name__
            print(f"  {manifest.name} {scenario} {sut}: skipped: {reason}", file=sys.stderr)
            self.skipped.append(
                {"model": manifest.name, "sut": sut, "scenario": scenario, "reason": reason}
            )
            return
        entry = report_entry(record_evaluation(self.db, result.to_evaluation(mode)))
        self.evaluations.append(entry)
        perf = result.run.performance
        if scenario == "single-stream" and perf is not None and perf.qps:
            self.single[manifest.name, sut] = perf.qps
        p50 = (entry["latency_ms"] or {}).get("p50")
        print(
            f"  {manifest.name} {scenario} {sut}: {'VALID' if entry['valid'] else 'INVALID'}, "
            f"p50 {_ms(p50)} ms, qps {_qps(entry['qps'])}, {time.monotonic() - t0:.1f}s",
            file=sys.stderr,
        )

    def prepare(self, manifest: Any) -> None:
        """Build a ``prepare:`` model now (0644: the gateway's workers run as nobody when the
        gateway runs as root, and read it)."""
        from trims.evaluation.harness.prepare import build

        builder = manifest.model.sources[0].builder
        if builder is not None and builder.startswith("prepare:"):
            build(builder, self.work_dir)

    def run(self, steps: list[dict[str, Any]]) -> None:
        from trims.evaluation.harness.function import shipped_manifests
        from trims.evaluation.harness.manifest import load_manifest

        shipped = shipped_manifests()
        models = list(dict.fromkeys(s["model"] for s in steps))
        for name in models:
            print(f"{name}:", file=sys.stderr, flush=True)
            manifest = load_manifest(shipped[name])
            self.prepare(manifest)
            for s in steps:
                if s["model"] == name:
                    self.step(manifest, s["scenario"], s["sut"])
            if manifest.framework.name != "onnxruntime":
                continue
            try:
                bare = harness_overhead(manifest, self.work_dir, self.args.min_duration_ms / 1000)
            except Exception as e:  # reported; the study goes on
                print(f"  bare loop of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            loadgen = next(
                (e["latency_ms"]["p50"] for e in self.evaluations
                 if e["model"] == name and e["sut"] == "direct"
                 and e["scenario"] == "single-stream" and e["latency_ms"]),
                None,
            )  # fmt: skip
            if loadgen is not None:
                ratio = loadgen / bare
                self.harness.append(
                    {"model": name, "bare_p50_ms": bare, "loadgen_p50_ms": loadgen, "ratio": ratio}
                )


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    load_start = os.getloadavg()
    host = machine()
    root = Path(tempfile.mkdtemp(prefix="trims-case-study-"))
    root.chmod(0o755)
    if args.db:
        db = args.db
    elif args.json is not None:
        db = str(args.json.with_suffix(".sqlite").resolve())
    else:
        db = str(root / "case-study.sqlite")
    steps = plan(args)
    gateway, url = start_gateway(
        root,
        "--preload",
        "numpy,onnxruntime,torch",
        "--store-socket",
        str(root / "no-store.sock"),
        *mxnet_environment(),
    )
    try:
        study = Study(args, url, root, db)
        study.run(steps)
    finally:
        gateway.stop()
    return {
        "machine": host,
        "load_average": {"start": load_start[0], "end": os.getloadavg()[0]},
        "quick": args.quick,
        "db": db,
        "settings": {
            "min_duration_ms": args.min_duration_ms,
            "min_query_count_single_stream": args.min_queries,
            "offline_batch": args.offline_batch,
            "server_max_qps": args.server_max_qps,
            "threads": args.threads,
            "executor": "local",
        },
        "evaluations": study.evaluations,
        "harness": study.harness,
        "skipped": study.skipped,
        "elapsed_s": time.monotonic() - started,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _qps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def tables(doc: dict[str, Any]) -> str:
    """One row per model and scenario: both SUTs side by side, the serving overhead, accuracy."""
    cells: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    frameworks: dict[str, str] = {}
    for e in doc["evaluations"]:
        cells.setdefault((e["model"], e["scenario"]), {})[e["sut"]] = e
        frameworks[e["model"]] = e["framework"]
    rows = []
    for (model, scenario), by_sut in cells.items():
        d, g = by_sut.get("direct"), by_sut.get("gateway")

        def p50(e: dict[str, Any] | None) -> float | None:
            return None if e is None or not e["latency_ms"] else e["latency_ms"]["p50"]

        # Offline's p50 is the one query's duration: its figure to compare is the throughput.
        pd, pg = p50(d), p50(g)
        overhead = None if pd is None or pg is None or scenario == "offline" else pg - pd
        acc = next((e["accuracy"] for e in (d, g) if e is not None and e["accuracy"]), None)
        accuracy = "-"
        if acc is not None:
            ref = "-" if acc["reference"] is None else f"{acc['reference']:.4f}"
            accuracy = f"{acc['metric']} {acc['value']:.4f} (ref {ref}, n={acc['samples']})"
        valid = "/".join("-" if e is None else ("V" if e["valid"] else "INV") for e in (d, g))
        rows.append([
            model, frameworks[model], scenario, _ms(p50(d)), _ms(p50(g)), _ms(overhead),
            _qps(None if d is None else d["qps"]), _qps(None if g is None else g["qps"]),
            valid, accuracy,
        ])  # fmt: skip
    table = markdown_table(
        ["model", "framework", "scenario", "direct p50 ms", "gateway p50 ms",
         "overhead p50 ms", "direct qps", "gateway qps", "valid d/g", "accuracy"],
        rows,
    )  # fmt: skip
    harness = markdown_table(
        ["model", "bare loop p50 ms", "LoadGen SingleStream p50 ms", "ratio"],
        [[h["model"], _ms(h["bare_p50_ms"]), _ms(h["loadgen_p50_ms"]), f"{h['ratio']:.3f}"]
         for h in doc["harness"]],
    )  # fmt: skip
    skipped = "".join(
        f"- {s['model']} {s['scenario']} {s['sut']}: {s['reason']}\n" for s in doc["skipped"]
    )
    label = "QUICK RUN (2 small models, short settings; not the case study)\n\n" if doc[
        "quick"] else ""  # fmt: skip
    models = len({e["model"] for e in doc["evaluations"]})
    return (
        f"{label}Machine: {doc['machine']}, load average {doc['load_average']['end']:.1f} at "
        f"the end; {models} models, {len(doc['evaluations'])} evaluations in "
        f"{doc['elapsed_s'] / 60:.1f} min; results database {doc['db']}\n\n{table}\n\n"
        f"Harness overhead (direct, ONNX Runtime):\n\n{harness}\n"
        + (f"\nSkipped:\n\n{skipped}" if skipped else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated shipped manifest names")
    parser.add_argument("--server-models", help="the models also run in the Server scenario")
    parser.add_argument("--quick", action="store_true", help="2 small models, short runs")
    parser.add_argument("--plan", action="store_true", help="print the plan as JSON and exit")
    parser.add_argument("--min-duration-ms", type=int, help="default 1000 (--quick: 300)")
    parser.add_argument(
        "--min-queries", type=int,
        help=f"SingleStream; default {SINGLE_STREAM_MIN_QUERIES} (--quick: 8)",
    )  # fmt: skip
    parser.add_argument("--offline-batch", type=int, default=8)
    parser.add_argument("--server-max-qps", type=float, help="default 100 (--quick: 400)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per model")
    parser.add_argument("--db", help="results database (SQLite path or PostgreSQL URL)")
    parser.add_argument("--json", type=Path, help="write JSON here and the table beside it")
    args = parser.parse_args(argv)
    if args.min_duration_ms is None:
        args.min_duration_ms = 300 if args.quick else 1000
    if args.min_queries is None:
        args.min_queries = 8 if args.quick else SINGLE_STREAM_MIN_QUERIES
    if args.server_max_qps is None:
        args.server_max_qps = 400.0 if args.quick else 100.0
    if args.plan:
        print(json.dumps({"quick": args.quick, "steps": plan(args)}, indent=2))
        return 0
    os.environ.pop("TRIMS_SOCKET", None)
    doc = run(args)
    write_report(args.json, doc, tables(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
