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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trims.evaluation import generator, submodel
from trims.evaluation.generator import Bencher
from trims.evaluation.ir import ModelIR
from trims.evaluation.measure import Measurement
from trims.evaluation.rounds import whole_key

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
    #: the other bounds' standard errors (a parallel bound's: of the sum along its critical
    #: path, the path taken as found)
    parallel_lb_se_ms: float = 0.0
    fused_sequential_lb_se_ms: float = 0.0
    fused_parallel_lb_se_ms: float = 0.0

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
    #: the chain's measurement's standard error, the variant it ran under and the standard
    #: error of that variant's empty model, which ``fused_ms`` is net of
    fused_se_ms: float = 0.0
    variant: str = ""
    overhead_se_ms: float = 0.0
    #: the standard error of ``unfused_ms`` (:func:`_sum_se` over the chain's layers)
    unfused_se_ms: float = 0.0

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
        whole = whole_key(ir.name)
        state.open(whole, generator.model_benchmark(ir), benchers[0])
        counts = Counter(layer.signature for layer in ir.layers)
        for bencher in benchers:
            for signature in counts:
                state.open(_layer_key(bencher.variant, signature), benches[signature], bencher)

        def goals(
            ir: ModelIR = ir, whole: str = whole, counts: Counter[str] = counts
        ) -> dict[str, float]:
            now = {key: term.current() for key, term in state.terms.items()}
            asked = {whole: target_rel * now[whole].trimmed_mean_ms}
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
    wholes = {ir.name: state.result(whole_key(ir.name)) for ir in irs}
    out.imprecise |= {whole_key(ir.name) for ir in irs} & state.imprecise
    return out, wholes


#: one position's share of a bound: its term's key, the term's standard error, and the empty
#: model subtracted from it (a key naming that measurement and its standard error)
_Term = tuple[str, float, tuple[str, float]]


def bound(
    ir: ModelIR,
    framework: str,
    whole: Measurement,
    times: LayerTimes,
    fused: Mapping[str, FusionResult] | None = None,
) -> ModelBound:
    """The lower bounds of ``ir`` from ``times`` against its measurement ``whole``.

    ``fused`` maps fusion-chain signatures to their measurement (see :func:`fusion`); a chain
    faster than its layers one by one stands for them in the fused bounds. Each bound comes
    with its standard error (:func:`_sum_se`).
    """
    best = times.best
    layers = [
        LayerTime(layer.index, layer.name, layer.op_type, *best[layer.signature])
        for layer in ir.layers
    ]
    weights = [t.best_ms for t in layers]
    counts = Counter(layer.signature for layer in ir.layers)
    # what each position's time is made of: (term, its SE, the empty model subtracted from it)
    terms: list[_Term | None] = [_layer_term(times, layer.signature) for layer in ir.layers]
    parallel, path = critical_path(weights, ir.preds)
    fused_weights, fused_terms = list(weights), list(terms)
    for chain in generator.fusion_chains(ir):
        result = (fused or {}).get(submodel.group_signature(ir, chain))
        if result is not None and result.fused_ms < sum(weights[i] for i in chain):
            fused_weights[chain[0]] = result.fused_ms
            fused_terms[chain[0]] = (
                f"chain:{result.signature}",
                result.fused_se_ms,
                (result.variant, result.overhead_se_ms),
            )
            for i in chain[1:]:
                fused_weights[i] = 0.0
                fused_terms[i] = None
    fused_parallel, fused_path = critical_path(fused_weights, ir.preds)
    everything = range(len(ir.layers))
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
        sequential_lb_se_ms=_sum_se([terms[i] for i in everything]),
        precise=not ({whole_key(ir.name), "empty", *counts} & times.imprecise),
        parallel_lb_se_ms=_sum_se([terms[i] for i in path]),
        fused_sequential_lb_se_ms=_sum_se([fused_terms[i] for i in everything]),
        fused_parallel_lb_se_ms=_sum_se([fused_terms[i] for i in fused_path]),
    )


def _layer_term(times: LayerTimes, signature: str) -> _Term:
    """A layer's share of a bound: its best variant's measurement, net of that variant's empty
    model."""
    variant = times.best[signature][1]
    overhead = times.overhead.get(variant)
    return (
        signature,
        times.se_ms.get(signature, 0.0),
        (variant, overhead.std_error_ms if overhead is not None else 0.0),
    )


def _sum_se(terms: Iterable[_Term | None]) -> float:
    """Standard error of a sum of net times: a term counted ``c`` times contributes ``c`` times
    its error (the same measurement each time), and so does a variant's empty model subtracted
    ``n`` times (one measurement per variant: the fusion chains' bencher finds the one the
    layers used in the results database; were it another, this overstates the error); different
    measurements are independent, so their variances add."""
    counts: Counter[str] = Counter()
    term_se: dict[str, float] = {}
    overheads: Counter[str] = Counter()
    overhead_se: dict[str, float] = {}
    for term in terms:
        if term is None:
            continue
        key, se, (variant, variant_se) = term
        counts[key] += 1
        term_se[key] = se
        overheads[variant] += 1
        overhead_se[variant] = max(variant_se, overhead_se.get(variant, 0.0))
    variance = sum((c * term_se[k]) ** 2 for k, c in counts.items())
    variance += sum((n * overhead_se[v]) ** 2 for v, n in overheads.items())
    return math.sqrt(variance)


def fusion(irs: list[ModelIR], bencher: Bencher, times: LayerTimes) -> list[FusionResult]:
    """Fused chain time (one sub-model, ``bencher``'s variant) vs the sum of its layers' best."""
    best = times.best
    overhead = bencher.overhead()
    out: list[FusionResult] = []
    for bench, sigs in generator.chain_benchmarks(irs):
        measured = bencher.run(bench).measurement
        out.append(
            FusionResult(
                bench.signature,
                bench.label,
                max(measured.trimmed_mean_ms - overhead.trimmed_mean_ms, 0.0),
                sum(best[s][0] for s in sigs),
                fused_se_ms=measured.std_error_ms,
                variant=bencher.variant,
                overhead_se_ms=overhead.std_error_ms,
                unfused_se_ms=_sum_se(_layer_term(times, s) for s in sigs),
            )
        )
    return sorted(out, key=lambda f: f.saving_ms, reverse=True)
