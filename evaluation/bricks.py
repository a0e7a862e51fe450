"""Composable benchmarks (DLBricks): cut models into bricks, benchmark each unique brick once.

A *cut point* is a position in topological order where exactly one activation tensor crosses
from the layers before to the layers after, so the model is a chain of single-input,
single-output *segments*. A brick of granularity G is a run of consecutive segments holding at
most G layers (a segment longer than G is a brick by itself), and a segment that starts with a
Conv/Gemm starts a new brick when the current one already has one. Bricks with the same
:func:`~trims.evaluation.submodel.group_signature` (same ops, shapes and wiring) are benchmarked
once across the whole model set. A model's latency is reconstructed as the sum of its bricks'
latencies less the fixed per-run overhead each brick run paid and the whole model pays once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trims.evaluation import submodel
from trims.evaluation.measure import Measurement

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from trims.evaluation.generator import Bencher, Benchmark
    from trims.evaluation.ir import ModelIR
    from trims.evaluation.measure import Sampler


#: a brick holds at most one run of these: a new one starts a new brick, so repeated
#: conv/FC stages (VGG's conv3_2..conv3_4) line up and deduplicate
_HEAVY = frozenset({"Conv", "Gemm", "MatMul"})


@dataclass(frozen=True)
class Brick:
    """Consecutive layers of one model between two cut points."""

    model: str
    indices: tuple[int, ...]
    signature: str


def cut_points(ir: ModelIR) -> list[int]:
    """Layer indices k such that exactly one activation is live between layer k and k + 1."""
    n = len(ir.layers)
    producer: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for value in ir.model.graph.input:
        producer[value.name] = -1
    for layer in ir.layers:
        for tensor in layer.inputs:
            last_use[tensor] = layer.index
        for tensor in layer.outputs:
            producer[tensor] = layer.index
    for value in ir.model.graph.output:
        last_use[value.name] = n
    live = [0] * (n + 1)
    for tensor, end in last_use.items():
        start = producer.get(tensor)
        if start is None:
            continue
        for k in range(max(start, 0), min(end, n)):
            live[k] += 1
    return [k for k in range(n - 1) if live[k] == 1]


def segments(ir: ModelIR) -> list[list[int]]:
    """The model as a chain of segments between consecutive cut points."""
    out: list[list[int]] = []
    start = 0
    for k in cut_points(ir):
        out.append(list(range(start, k + 1)))
        start = k + 1
    out.append(list(range(start, len(ir.layers))))
    return [s for s in out if s]


def decompose(ir: ModelIR, granularity: int) -> list[Brick]:
    """Group consecutive segments into bricks of at most ``granularity`` layers."""
    if granularity < 1:
        raise ValueError(f"brick granularity must be >= 1, got {granularity}")
    bricks: list[Brick] = []
    current: list[int] = []
    for seg in segments(ir):
        full = len(current) + len(seg) > granularity
        if current and (full or (_heavy(ir, current) and ir.layers[seg[0]].op_type in _HEAVY)):
            bricks.append(_brick(ir, current))
            current = []
        current = current + seg
    if current:
        bricks.append(_brick(ir, current))
    return bricks


def _heavy(ir: ModelIR, indices: list[int]) -> bool:
    return any(ir.layers[i].op_type in _HEAVY for i in indices)


def _brick(ir: ModelIR, indices: list[int]) -> Brick:
    return Brick(ir.name, tuple(indices), submodel.group_signature(ir, indices))


def export(ir: ModelIR, brick: Brick, external: Collection[str] = ()) -> onnx.ModelProto:
    """The brick as a runnable ONNX model (its one input and one output are graph I/O).

    Initializers named in ``external`` are left out of band (:func:`submodel.extract`).
    """
    name = f"{ir.name}_brick_{brick.indices[0]}"
    return submodel.extract(ir, list(brick.indices), name, external)


def unique_bricks(per_model: dict[str, list[Brick]]) -> dict[str, Brick]:
    """Signature -> first brick with it, over all models."""
    out: dict[str, Brick] = {}
    for bricks in per_model.values():
        for brick in bricks:
            out.setdefault(brick.signature, brick)
    return out


def reconstruct(bricks: list[Brick], times_ms: dict[str, float], overhead_ms: float) -> float:
    """Estimated model latency: brick times less their per-run overhead, plus one overhead."""
    return sum(max(times_ms[b.signature] - overhead_ms, 0.0) for b in bricks) + overhead_ms


def compose(ir: ModelIR, bricks: list[Brick]) -> onnx.ModelProto:
    """Reassemble exported bricks into one model by wiring each brick's output to the next."""
    from onnx import helper

    nodes: list[onnx.NodeProto] = []
    inits: dict[str, onnx.TensorProto] = {}
    for brick in bricks:
        part = export(ir, brick)
        nodes.extend(part.graph.node)
        for t in part.graph.initializer:
            inits.setdefault(t.name, t)
    graph = helper.make_graph(
        nodes,
        f"{ir.name}_composed",
        list(export(ir, bricks[0]).graph.input),
        list(ir.model.graph.output),
        initializer=list(inits.values()),
    )
    out = helper.make_model(graph, opset_imports=list(ir.model.opset_import))
    out.ir_version = ir.model.ir_version
    return out


@dataclass
class BrickEstimate:
    """One model's measured latency against its brick reconstruction."""

    name: str
    measured_ms: float
    estimated_ms: float
    bricks: int

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.estimated_ms - self.measured_ms) / self.measured_ms


@dataclass
class BrickStudy:
    """Bricks at one granularity over a model set."""

    granularity: int
    models: list[BrickEstimate]
    unique_bricks: int
    total_bricks: int
    time_whole_s: float
    time_bricks_s: float
    #: one run of every unique brick, summed (ms)
    unique_bricks_ms: float

    @property
    def sharing(self) -> float:
        """One run of every model / one run of every unique brick.

        With the same runs and no setup on either side, this is the most the bricks can save
        in benchmarking time: the ceiling the model set's repetition allows.
        """
        whole = sum(m.measured_ms for m in self.models)
        return whole / self.unique_bricks_ms if self.unique_bricks_ms > 0 else math.inf


def tolerances(
    bricks: list[Brick], times_ms: dict[str, float], overhead_ms: float, target_rel: float
) -> dict[str, float]:
    """Per unique brick of one model, the standard error (ms) its measurement may keep.

    The model's estimate is ``E = sum_i c_i t_i - (n - 1) o`` over its ``u`` unique bricks
    ``i`` (``c_i`` occurrences each, ``n`` bricks in all, ``o`` the fixed per-run cost). The
    bricks are measured separately, so their errors are independent and
    ``SE(E)^2 = sum_i c_i^2 s_i^2``. Asking ``c_i s_i <= target_rel * E / sqrt(u)`` of every
    brick gives ``SE(E)^2 <= u (target_rel E)^2 / u``, i.e. ``SE(E) <= target_rel * E``: the
    same relative precision a whole-model measurement is asked for. In relative terms a brick
    with share ``p_i = c_i t_i / E`` of the model needs ``s_i / t_i <= target_rel / (p_i
    sqrt(u))``, so the smaller its share, the looser its precision and the sooner it stops.
    ``E`` is taken from ``times_ms`` (pilot runs of the bricks not yet measured): the
    reconstruction itself, not the whole-model measurement it is compared with.
    """
    counts = Counter(b.signature for b in bricks)
    share = target_rel * reconstruct(bricks, times_ms, overhead_ms) / math.sqrt(len(counts))
    return {sig: share / c for sig, c in counts.items()}


@dataclass
class _Tally:
    """What the study has measured so far, across models and granularities."""

    final: dict[str, Measurement] = field(default_factory=dict)
    #: the tightest standard error any model has asked of each brick so far
    asked: dict[str, float] = field(default_factory=dict)


def study(
    irs: list[ModelIR],
    bencher: Bencher,
    granularities: list[int],
    progress: Callable[[list[ModelIR], str], Iterable[ModelIR]],
    target_rel: float = 0.02,
) -> list[BrickStudy]:
    """Measure every model whole and every unique brick once per granularity; compare.

    Each whole model is measured until the standard error of its time is below ``target_rel``
    of it. Bricks: every new brick of a model gets a session, its warm-up and ``min_reps``
    pilot runs; then each continues until its error is within its share of the model's budget
    (:func:`tolerances`), so the reconstruction meets the same ``target_rel``. A brick shared
    with a later model that asks for more precision than it was measured to is measured again
    (both costs counted). Both sides share the settings' ``min_reps``, warm-up and time cap.

    Measurement is interleaved: a model is measured whole, then its bricks not yet measured
    (for every granularity), then the next model, so a slow drift in the machine's background
    load cannot separate "whole" from "bricks". Bricks equal across granularities are one
    database row; each granularity's benchmarking time counts every brick it needs, from
    export to the last timed run, and the fixed-cost (empty model) benchmark.
    """
    from trims.evaluation import generator
    from trims.evaluation.measure import Precision

    empty = bencher.overhead()
    overhead = empty.trimmed_mean_ms
    per_g = {g: {ir.name: decompose(ir, g) for ir in irs} for g in granularities}
    measured: dict[str, float] = {}
    tally = _Tally()
    cost: dict[int, dict[str, float]] = {g: {} for g in granularities}
    time_whole = 0.0
    for ir in progress(irs, "models"):
        # loading the weights into memory is preparation both sides share, like loading the model
        weights = submodel.weights(ir) if bencher.framework == "onnxruntime" else None
        whole_bench = generator.model_benchmark(ir, weights)
        whole = bencher.cached(whole_bench)
        if whole is None:
            whole = bencher.open(whole_bench).run(Precision(rel=target_rel).met)
            bencher.store(whole_bench, whole)
        measured[ir.name] = whole.trimmed_mean_ms
        time_whole += whole.elapsed_s
        for g in granularities:
            _measure_bricks(ir, weights, per_g[g][ir.name], bencher, tally, overhead, target_rel)
            for brick in per_g[g][ir.name]:
                cost[g][brick.signature] = tally.final[brick.signature].elapsed_s
    times = {sig: m.trimmed_mean_ms for sig, m in tally.final.items()}
    out: list[BrickStudy] = []
    for g in granularities:
        per_model = per_g[g]
        models = [
            BrickEstimate(
                ir.name,
                measured[ir.name],
                reconstruct(per_model[ir.name], times, overhead),
                len(per_model[ir.name]),
            )
            for ir in irs
        ]
        out.append(
            BrickStudy(
                granularity=g,
                models=models,
                unique_bricks=len(cost[g]),
                total_bricks=sum(len(b) for b in per_model.values()),
                time_whole_s=time_whole,
                time_bricks_s=empty.elapsed_s + sum(cost[g].values()),
                unique_bricks_ms=sum(times[sig] for sig in cost[g]),
            )
        )
    return out


def _measure_bricks(
    ir: ModelIR,
    weights: Mapping[str, np.ndarray] | None,
    bricks: list[Brick],
    bencher: Bencher,
    tally: _Tally,
    overhead_ms: float,
    target_rel: float,
) -> None:
    """Pilot the model's new bricks, then take each to the precision the model needs."""
    from trims.evaluation.measure import Precision

    first: dict[str, Brick] = {}
    for brick in bricks:
        first.setdefault(brick.signature, brick)
    pending: dict[str, tuple[Benchmark, Sampler]] = {}
    times: dict[str, float] = {}
    for sig, brick in first.items():
        if sig not in tally.final:
            bench = _benchmark(ir, brick, weights)
            cached = bencher.cached(bench)
            if cached is None:
                sampler = bencher.open(bench)
                pending[sig] = (bench, sampler)
                cached = sampler.run(lambda _: True)
            tally.final[sig] = cached
        times[sig] = tally.final[sig].trimmed_mean_ms
    for sig, tol in tolerances(bricks, times, overhead_ms, target_rel).items():
        done = tally.final[sig]
        if sig in pending:
            bench, sampler = pending.pop(sig)
        elif done.std_error_ms > tol and tol < tally.asked.get(sig, math.inf):
            bench = _benchmark(ir, first[sig], weights)
            sampler = bencher.open(bench)
            sampler.setup_s += done.elapsed_s
        else:
            continue
        tally.asked[sig] = min(tol, tally.asked.get(sig, math.inf))
        result = sampler.run(Precision(abs_ms=tol).met)
        bencher.store(bench, result)
        tally.final[sig] = result


def _benchmark(ir: ModelIR, brick: Brick, weights: Mapping[str, np.ndarray] | None) -> Benchmark:
    from trims.evaluation import generator

    label = f"{ir.name}/brick@{brick.indices[0]}"
    external = frozenset(weights or ())
    return generator.Benchmark(
        "brick", brick.signature, label, lambda: export(ir, brick, external), weights
    )
