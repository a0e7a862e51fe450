"""Evaluation harness overhead and the runtime's serving overhead, under the real MLPerf LoadGen.

    python bench/evaluation.py --models mlp,squeezenet --json OUT.json

Two questions, for each model (``mlp``: a 16-256-256-10 ONNX MLP with seeded weights;
``squeezenet``: the zoo's SqueezeNet 1.0, materialized from the onnx wheel):

- Harness overhead: the SingleStream p50 of the ``direct`` system under test (the model in this
  process, ONNX Runtime, one intra-op thread) under LoadGen, against a bare timing loop over the
  same ``predict`` call in the same process (target: within 5%). The pair alternates
  ``--repeat`` times and medians are compared.
- Serving overhead: the same model deployed as a function on a ``trims gateway`` subprocess
  (local executor, no store: the worker loads the file) and invoked over the Open Inference
  Protocol with the binary tensor extension, against ``direct``, in each scenario: p50
  gateway minus p50 direct (target for SingleStream: at most 3 ms). Server runs both at half
  the slower one's SingleStream rate; Offline (batch ``--offline-batch``) expects each one's
  SingleStream rate times the batch, and its figure to compare is the throughput.

LoadGen runs with the harness's short settings (``--min-duration-ms``, ``--min-queries``: by
default 64 queries, 662 for MultiStream and 512 for Server, what LoadGen's early stopping needs).
Writes ``OUT.json`` (``{"machine", "settings", "harness": [{"model", "bare_p50_ms",
"loadgen_p50_ms", "ratio"}], "serving": [{"model", "scenario", "direct", "gateway",
"overhead_p50_ms"}]}``, each SUT entry ``{"valid", "qps", "p50_ms", "p90_ms", "p99_ms"}``) and
``OUT.md`` (the tables), or prints both.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import REPO, machine, start_gateway, write_report

ONNX_HANDLER = REPO / "examples" / "onnx_zoo"
SCENARIOS = ("single-stream", "multi-stream", "server", "offline")


def write_mlp(path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    sizes = [16, 256, 256, 10]
    nodes, inits, prev = [], [], "x"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        inits.append(numpy_helper.from_array(rng.standard_normal((a, b)).astype("f4"), f"w{i}"))
        inits.append(numpy_helper.from_array(rng.standard_normal(b).astype("f4"), f"b{i}"))
        nodes.append(helper.make_node("Gemm", [prev, f"w{i}", f"b{i}"], [f"g{i}"]))
        prev = f"g{i}"
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [prev], [f"r{i}"]))
            prev = f"r{i}"
    nodes.append(helper.make_node("Softmax", [prev], ["probs"], axis=1))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", sizes[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def prepare_model(name: str, root: Path) -> tuple[Path, list[Any]]:
    """The model file and 32 random samples of its input (without the batch axis)."""
    import numpy as np

    rng = np.random.default_rng(1)
    path = root / f"{name}.onnx"
    if name == "mlp":
        write_mlp(path)
        return path, [rng.standard_normal(16).astype("f4") for _ in range(32)]
    import onnx

    from trims.evaluation.zoo import materialize

    onnx.save(materialize(name), str(path))
    return path, [rng.random((3, 224, 224), dtype="f4") for _ in range(32)]


def entry(result: Any) -> dict[str, Any]:
    return {
        "valid": result.valid,
        "qps": result.qps,
        "p50_ms": result.latency_ms.get("p50"),
        "p90_ms": result.latency_ms.get("p90"),
        "p99_ms": result.latency_ms.get("p99"),
    }


def harness_overhead(direct: Any, data: Any, args: argparse.Namespace) -> dict[str, Any]:
    from trims.evaluation.harness.loadgen import LoadGenSettings
    from trims.evaluation.harness.run import bare_loop_p50_ms, run_scenario

    settings = LoadGenSettings(
        min_duration_ms=args.min_duration_ms, min_query_count=args.min_queries
    )
    for _ in range(16):
        direct.predict([data.inputs[0]])
    bare, looped = [], []
    for _ in range(args.repeat):
        bare.append(bare_loop_p50_ms(direct, list(data.inputs), args.min_duration_ms / 1000))
        result = run_scenario(direct, data, "single-stream", "performance", settings).performance
        looped.append(result.latency_ms["p50"])
    b, lg = statistics.median(bare), statistics.median(looped)
    print(f"{data.name}: bare p50 {b:.3f} ms, LoadGen p50 {lg:.3f} ms", file=sys.stderr)
    return {"model": data.name, "bare_p50_ms": b, "loadgen_p50_ms": lg, "ratio": lg / b}


def serving_overhead(
    direct: Any, remote: Any, data: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each scenario on both SUTs. Server runs both at half the slower one's SingleStream rate
    (same load, comparable latencies); Offline expects each one's SingleStream rate times the
    batch (it must not finish before its min duration)."""
    from dataclasses import replace

    from trims.evaluation.harness.loadgen import LoadGenSettings
    from trims.evaluation.harness.run import run_scenario

    base = LoadGenSettings(min_duration_ms=args.min_duration_ms, min_query_count=args.min_queries)
    suts = {"direct": direct, "gateway": remote}
    single: dict[str, float] = {}
    rows = []
    for scenario in SCENARIOS:
        got = {}
        for label, sut in suts.items():
            settings = base
            batch = 1
            if scenario == "server":
                settings = replace(base, server_target_qps=round(0.5 * min(single.values()), 1))
            elif scenario == "offline":
                batch = args.offline_batch
                settings = replace(base, offline_expected_qps=round(batch * single[label], 1))
            run = run_scenario(sut, data, scenario, "performance", settings, batch=batch, warmup=8)
            assert run.performance is not None
            got[label] = entry(run.performance)
            if scenario == "single-stream":
                single[label] = run.performance.qps or 1.0
        d, g = got["direct"]["p50_ms"], got["gateway"]["p50_ms"]
        overhead = g - d if d is not None and g is not None else None
        rows.append({"model": data.name, "scenario": scenario, **got, "overhead_p50_ms": overhead})
        print(f"{data.name} {scenario}: {got}", file=sys.stderr)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trims.evaluation.harness.run import SampleSet
    from trims.evaluation.harness.sut import DirectSUT, GatewaySUT, onnx_function_spec

    root = Path(tempfile.mkdtemp(prefix="trims-bench-eval-"))
    root.chmod(0o755)  # the gateway's workers (nobody when root) read the model files
    harness: list[dict[str, Any]] = []
    serving: list[dict[str, Any]] = []
    gateway, url = start_gateway(root, "--preload", "numpy,onnxruntime")
    try:
        for name in args.models.split(","):
            path, samples = prepare_model(name, root)
            data = SampleSet(samples, name=name)
            direct = DirectSUT.onnx(name, path, socket_path=root / "no-store.sock")
            try:
                harness.append(harness_overhead(direct, data, args))
                spec = onnx_function_spec(f"bench-{name}", path, code_dir=ONNX_HANDLER)
                remote = GatewaySUT.deploy(url, spec)
                try:
                    serving.extend(serving_overhead(direct, remote, data, args))
                finally:
                    remote.close()
            finally:
                direct.close()
    finally:
        gateway.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "machine": machine(),
        "settings": {
            "min_duration_ms": args.min_duration_ms,
            "min_query_count": args.min_queries,
            "repeat": args.repeat,
            "offline_batch": args.offline_batch,
        },
        "harness": harness,
        "serving": serving,
    }


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _qps(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def tables(doc: dict[str, Any]) -> str:
    harness = markdown_table(
        ["model", "bare loop p50 (ms)", "LoadGen SingleStream p50 (ms)", "ratio (target <= 1.05)"],
        [
            [h["model"], _ms(h["bare_p50_ms"]), _ms(h["loadgen_p50_ms"]), f"{h['ratio']:.3f}"]
            for h in doc["harness"]
        ],
    )
    serving = markdown_table(
        ["model", "scenario", "direct p50 (ms)", "gateway p50 (ms)", "overhead p50 (ms)",
         "direct qps", "gateway qps", "valid (direct/gateway)"],
        [
            [s["model"], s["scenario"], _ms(s["direct"]["p50_ms"]), _ms(s["gateway"]["p50_ms"]),
             _ms(s["overhead_p50_ms"]), _qps(s["direct"]["qps"]), _qps(s["gateway"]["qps"]),
             f"{s['direct']['valid']}/{s['gateway']['valid']}"]
            for s in doc["serving"]
        ],
    )  # fmt: skip
    return f"Machine: {doc['machine']}\n\n{harness}\n\n{serving}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="mlp,squeezenet", help="comma-separated: mlp and/or zoo names"
    )
    parser.add_argument("--min-duration-ms", type=int, default=3000)
    parser.add_argument(
        "--min-queries",
        type=int,
        help="default: the harness's short defaults (64; 662 MultiStream, 512 Server)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="bare/LoadGen pairs (harness)")
    parser.add_argument("--offline-batch", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write JSON here and the tables beside it")
    args = parser.parse_args()
    os.environ.pop("TRIMS_SOCKET", None)
    doc = run(args)
    write_report(args.json, doc, tables(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
