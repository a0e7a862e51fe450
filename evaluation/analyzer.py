"""Analyzer: measured latency against sequential and parallel lower bounds (Benanza).

Per model, per framework: the measured end-to-end latency (same framework and settings), the
sequential lower bound (sum over layers of the best time any variant achieved for that layer's
configuration, less the fixed per-run overhead), the parallel lower bound (the critical path of
the layer DAG under the same per-layer times), the gap and the layers that account for most of
the time. Fusion: measured cost of Conv+BN(+scale)+ReLU chains run as one sub-model (ONNX
Runtime fuses them) against the sum of their layers run one by one. The *fused* bounds replace
each chain's layers by the chain's fused time where that is lower: the bound for a framework
that fuses, which the plain (Benanza) bounds are not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from trims.evaluation import generator, submodel
from trims.evaluation.generator import Bencher
from trims.evaluation.ir import ModelIR

log = logging.getLogger(__name__)


def critical_path(
    weights: Sequence[float], preds: Sequence[Sequence[int]]
) -> tuple[float, list[int]]:
    """Longest weighted path through a DAG given in topological order: (length, nodes)."""
    best = [0.0] * len(weights)
    via = [-1] * len(weights)
    for node, w in enumerate(weights):
        start = 0.0
        for p in preds[node]:
            if p >= node:
                raise ValueError(f"node {node} has predecessor {p}: not in topological order")
            if best[p] > start:
                start, via[node] = best[p], p
        best[node] = start + w
    if not best:
        return 0.0, []
    end = max(range(len(best)), key=best.__getitem__)
    path = [end]
    while via[path[-1]] >= 0:
        path.append(via[path[-1]])
    return best[end], path[::-1]


@dataclass
class LayerTime:
    index: int
    name: str
    op_type: str
    best_ms: float
    variant: str


@dataclass
class ModelBound:
    name: str
    framework: str
    measured_ms: float
    measured_spread_ms: float
    sequential_lb_ms: float
    parallel_lb_ms: float
    fused_sequential_lb_ms: float
    fused_parallel_lb_ms: float
    layers: list[LayerTime] = field(default_factory=list)

    @property
    def gap_ms(self) -> float:
        return self.measured_ms - self.sequential_lb_ms

    def top_layers(self, n: int = 5) -> list[LayerTime]:
        return sorted(self.layers, key=lambda t: t.best_ms, reverse=True)[:n]


@dataclass
class FusionResult:
    signature: str
    label: str
    fused_ms: float
    unfused_ms: float

    @property
    def saving_ms(self) -> float:
        return self.unfused_ms - self.fused_ms


def layer_times(
    irs: list[ModelIR],
    benchers: list[Bencher],
    progress: Callable[[list[generator.Benchmark]], Iterable[generator.Benchmark]] = iter,
) -> dict[str, tuple[float, str]]:
    """Signature -> (best net time in ms over the variants, that variant)."""
    benches = generator.layer_benchmarks(irs)
    best: dict[str, tuple[float, str]] = {}
    for bencher in benchers:
        overhead = bencher.overhead_ms()
        for bench, result in zip(benches, bencher.run_many(benches, progress), strict=True):
            ms = max(result.measurement.trimmed_mean_ms - overhead, 0.0)
            if bench.signature not in best or ms < best[bench.signature][0]:
                best[bench.signature] = (ms, bencher.variant)
    return best


def bound(
    ir: ModelIR,
    measured: Bencher,
    best: dict[str, tuple[float, str]],
    fused: dict[str, float] | None = None,
) -> ModelBound:
    """Measure ``ir`` end to end with ``measured`` and compute its lower bounds.

    ``fused`` maps fusion-chain signatures to their fused time (see :func:`fusion`).
    """
    whole = measured.run(generator.model_benchmark(ir)).measurement
    times = [
        LayerTime(layer.index, layer.name, layer.op_type, *best[layer.signature])
        for layer in ir.layers
    ]
    weights = [t.best_ms for t in times]
    parallel, _ = critical_path(weights, ir.preds)
    fused_weights = list(weights)
    for chain in generator.fusion_chains(ir):
        chain_ms = (fused or {}).get(submodel.group_signature(ir, chain))
        if chain_ms is not None and chain_ms < sum(weights[i] for i in chain):
            fused_weights[chain[0]] = chain_ms
            for i in chain[1:]:
                fused_weights[i] = 0.0
    fused_parallel, _ = critical_path(fused_weights, ir.preds)
    return ModelBound(
        name=ir.name,
        framework=measured.framework,
        measured_ms=whole.trimmed_mean_ms,
        measured_spread_ms=whole.spread_ms,
        sequential_lb_ms=sum(weights),
        parallel_lb_ms=parallel,
        fused_sequential_lb_ms=sum(fused_weights),
        fused_parallel_lb_ms=fused_parallel,
        layers=times,
    )


def fusion(
    irs: list[ModelIR], bencher: Bencher, best: dict[str, tuple[float, str]]
) -> list[FusionResult]:
    """Fused chain time (one sub-model, ``bencher``'s variant) vs the sum of its layers' best."""
    overhead = bencher.overhead_ms()
    out: list[FusionResult] = []
    for bench, sigs in generator.chain_benchmarks(irs):
        fused = max(bencher.run(bench).measurement.trimmed_mean_ms - overhead, 0.0)
        out.append(FusionResult(bench.signature, bench.label, fused, sum(best[s][0] for s in sigs)))
    return sorted(out, key=lambda f: f.saving_ms, reverse=True)
