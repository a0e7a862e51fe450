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
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from trims.evaluation import generator, submodel
from trims.evaluation.generator import Bencher
from trims.evaluation.ir import ModelIR
from trims.evaluation.measure import Measurement

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
    measured_se_ms: float = 0.0
    sequential_lb_se_ms: float = 0.0
    #: both sides reached the precision asked before a time or run budget ran out
    precise: bool = True

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


@dataclass
class LayerTimes:
    """Per layer configuration (signature), the best net time any variant achieved.

    ``se_ms`` is the standard error of that variant's measurement and ``overhead`` each
    variant's empty-model (fixed cost) measurement, subtracted from every layer it measured;
    ``imprecise`` names what ran out of budget before the precision asked: layer signatures,
    ``empty`` (an empty model) and ``model:<name>`` (a whole model).
    """

    best: dict[str, tuple[float, str]]
    se_ms: dict[str, float] = field(default_factory=dict)
    overhead: dict[str, Measurement] = field(default_factory=dict)
    imprecise: set[str] = field(default_factory=set)

    def offer(self, signature: str, variant: str, measured: Measurement) -> None:
        """Keep ``variant``'s net time for ``signature`` if it is the best so far."""
        ms = max(measured.trimmed_mean_ms - self.overhead[variant].trimmed_mean_ms, 0.0)
        if signature not in self.best or ms < self.best[signature][0]:
            self.best[signature] = (ms, variant)
            self.se_ms[signature] = measured.std_error_ms


def layer_times(
    irs: list[ModelIR],
    benchers: list[Bencher],
    progress: Callable[[list[generator.Benchmark]], Iterable[generator.Benchmark]] = iter,
) -> LayerTimes:
    """Every layer benchmark by each bencher with its stability rule and time budget; the
    best net time per signature (MXNet, whose benchmarks run in batches in their own process)."""
    benches = generator.layer_benchmarks(irs)
    out = LayerTimes({})
    for bencher in benchers:
        out.overhead[bencher.variant] = bencher.overhead()
        for bench, result in zip(benches, bencher.run_many(benches, progress), strict=True):
            out.offer(bench.signature, bencher.variant, result.measurement)
    return out


def _layer_key(variant: str, signature: str) -> str:
    return f"{variant}|{signature}"


def precise_times(
    irs: list[ModelIR],
    benchers: list[Bencher],
    target_rel: float,
    progress: Callable[[list[ModelIR], str], Iterable[ModelIR]] = lambda items, _desc: items,
) -> tuple[LayerTimes, dict[str, Measurement]]:
    """Layer times and whole models measured to the precision the bounds need.

    Each model's time measured whole (by ``benchers[0]``) and its sequential bound under each
    variant, ``sum_layers (t_layer - t_empty)``, to a standard error of at most ``target_rel``
    of it: the bound's budget is split among its terms (:func:`rounds.budgets`: every unique
    layer with its occurrences, the empty model once per layer), and per model the whole model,
    its new layers and the empty models are piloted, then measured in interleaved rounds
    (:class:`rounds.Rounds`). A layer shared with a later model that asks more of it is
    measured again. Returns the layer times and the whole models' measurements by name.
    """
    from trims.evaluation.rounds import Rounds, budgets

    state = Rounds()
    benches = {b.signature: b for b in generator.layer_benchmarks(irs)}
    for bencher in benchers:
        state.open(_layer_key(bencher.variant, "empty"), generator.empty_benchmark(), bencher)
    for ir in progress(irs, "models"):
        whole_key = f"model:{ir.name}"
        state.open(whole_key, generator.model_benchmark(ir), benchers[0])
        counts = Counter(layer.signature for layer in ir.layers)
        for bencher in benchers:
            for signature in counts:
                state.open(_layer_key(bencher.variant, signature), benches[signature], bencher)

        def goals(
            ir: ModelIR = ir, whole_key: str = whole_key, counts: Counter[str] = counts
        ) -> dict[str, float]:
            now = {key: term.current() for key, term in state.terms.items()}
            asked = {whole_key: target_rel * now[whole_key].trimmed_mean_ms}
            for bencher in benchers:
                empty_key = _layer_key(bencher.variant, "empty")
                fixed = now[empty_key].trimmed_mean_ms
                terms = {_layer_key(bencher.variant, s): c for s, c in counts.items()}
                value = sum(max(now[k].trimmed_mean_ms - fixed, 0.0) * c for k, c in terms.items())
                terms[empty_key] = len(ir.layers)
                for key, se in budgets(terms, value, target_rel).items():
                    asked[key] = min(se, asked.get(key, math.inf))
            return asked

        state.run(goals)
        state.close()
    # "empty" stands for the empty model of any variant: every model's bound subtracts it
    out = LayerTimes({}, imprecise={k.split("|", 1)[1] for k in state.imprecise if "|" in k})
    for bencher in benchers:
        out.overhead[bencher.variant] = state.result(_layer_key(bencher.variant, "empty"))
        for signature in benches:
            out.offer(
                signature, bencher.variant, state.result(_layer_key(bencher.variant, signature))
            )
    wholes = {ir.name: state.result(f"model:{ir.name}") for ir in irs}
    out.imprecise |= {k for k in state.imprecise if k.startswith("model:")}
    return out, wholes


def bound(
    ir: ModelIR,
    framework: str,
    whole: Measurement,
    times: LayerTimes,
    fused: dict[str, float] | None = None,
) -> ModelBound:
    """The lower bounds of ``ir`` from ``times`` against its measurement ``whole``.

    ``fused`` maps fusion-chain signatures to their fused time (see :func:`fusion`). The
    sequential bound's standard error counts every layer's (once per occurrence) and each
    variant's empty model once per layer it was subtracted from.
    """
    best = times.best
    layers = [
        LayerTime(layer.index, layer.name, layer.op_type, *best[layer.signature])
        for layer in ir.layers
    ]
    weights = [t.best_ms for t in layers]
    counts = Counter(layer.signature for layer in ir.layers)
    per_variant = Counter(best[layer.signature][1] for layer in ir.layers)
    variance = sum((c * times.se_ms.get(s, 0.0)) ** 2 for s, c in counts.items())
    variance += sum(
        (n * times.overhead[v].std_error_ms) ** 2
        for v, n in per_variant.items()
        if v in times.overhead
    )
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
        framework=framework,
        measured_ms=whole.trimmed_mean_ms,
        measured_spread_ms=whole.spread_ms,
        sequential_lb_ms=sum(weights),
        parallel_lb_ms=parallel,
        fused_sequential_lb_ms=sum(fused_weights),
        fused_parallel_lb_ms=fused_parallel,
        layers=layers,
        measured_se_ms=whole.std_error_ms,
        sequential_lb_se_ms=math.sqrt(variance),
        precise=not ({f"model:{ir.name}", "empty", *counts} & times.imprecise),
    )


def fusion(irs: list[ModelIR], bencher: Bencher, times: LayerTimes) -> list[FusionResult]:
    """Fused chain time (one sub-model, ``bencher``'s variant) vs the sum of its layers' best."""
    best = times.best
    overhead = bencher.overhead_ms()
    out: list[FusionResult] = []
    for bench, sigs in generator.chain_benchmarks(irs):
        fused = max(bencher.run(bench).measurement.trimmed_mean_ms - overhead, 0.0)
        out.append(FusionResult(bench.signature, bench.label, fused, sum(best[s][0] for s in sigs)))
    return sorted(out, key=lambda f: f.saving_ms, reverse=True)
