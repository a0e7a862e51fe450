"""Composable benchmarks (DLBricks): cut models into bricks, benchmark each unique brick once.

A *cut point* is a position in topological order where exactly one activation tensor crosses
from the layers before to the layers after, so the model is a chain of single-input,
single-output *segments*. A brick of granularity G is a run of consecutive segments holding at
most G layers (a segment longer than G is a brick by itself), and a segment that starts with a
Conv/Gemm starts a new brick when the current one already has one. Bricks with the same
:func:`~trims.evaluation.submodel.group_signature` (same ops, shapes and wiring) are benchmarked
once across the whole model set. A model's latency is reconstructed as the sum of its bricks'
latencies less the fixed per-run overhead each brick run paid and the whole model pays once,
less the layout round trips the bricks made and the model does not, each brick's time raised
to the time its weights take to stream from memory where the model's working set leaves them
there (:class:`Floors`).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trims.evaluation import ort_backend, submodel
from trims.evaluation.measure import Z95, Measurement
from trims.evaluation.rounds import Rounds, budgets, whole_key

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from trims.evaluation.generator import Bencher, Benchmark
    from trims.evaluation.ir import ModelIR
    from trims.evaluation.ort_backend import Conversions


#: a brick holds at most one run of these: a new one starts a new brick, so repeated
#: conv/FC stages (VGG's conv3_2..conv3_4) line up and deduplicate
_HEAVY = frozenset({"Conv", "Gemm", "MatMul"})
#: what ONNX Runtime's CPU graph optimizations fold into the heavy op before them (BN and
#: constant scale/shift into the weights, the activations and a residual add into the
#: convolution's epilogue, an Add after MatMul into a Gemm): a brick boundary between them
#: would time two kernels where the model runs one (nn-Meter's "kernel detection")
_FUSES_INTO_HEAVY = frozenset(
    {
        "BatchNormalization",
        "Mul",
        "Add",
        "Sum",
        "Relu",
        "Clip",
        "LeakyRelu",
        "Sigmoid",
        "HardSigmoid",
        "Tanh",
    }
)


@dataclass(frozen=True)
class Brick:
    """Consecutive layers of one model between two cut points."""

    model: str
    indices: tuple[int, ...]
    signature: str


def cut_points(ir: ModelIR) -> list[int]:
    """Layer indices k such that exactly one activation is live between layer k and k + 1,
    and layers k and k + 1 are not parts of one fused kernel (:func:`fused_kernels`)."""
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
    inside = {k for chain in fused_kernels(ir) for k in range(min(chain), max(chain))}
    return [k for k in range(n - 1) if live[k] == 1 and k not in inside]


def fused_kernels(ir: ModelIR) -> list[list[int]]:
    """Layers the framework runs as one kernel: a Conv/Gemm/MatMul and what it fuses after it."""
    from trims.evaluation.generator import fusion_chains

    return fusion_chains(ir, heads=_HEAVY, fusible=_FUSES_INTO_HEAVY)


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


def reconstruct(
    bricks: list[Brick],
    times_ms: Mapping[str, float],
    overhead_ms: float,
    layout_ms: float = 0.0,
    floor_ms: float = 0.0,
) -> float:
    """Estimated model latency: brick times less the fixed cost each brick run paid beyond the
    one the whole model pays, less the layout conversions the bricks did at their boundaries,
    plus what the weight-stream floors raised brick times by (:class:`Floors`)."""
    raw = sum(times_ms[b.signature] for b in bricks)
    return raw - (len(bricks) - 1) * overhead_ms - layout_ms + floor_ms


def extra_conversions(
    bricks: list[Brick], conversions: Mapping[str, Conversions]
) -> dict[str, float]:
    """Per tensor shape (:func:`reorder_key`), the layout round trips the bricks made beyond
    the whole model's: what the estimate takes away.

    The conversions every brick made, less the whole model's (all profiled on their first run,
    :func:`~trims.evaluation.ort_backend.profiled_runner`), counted per shape, half a round trip
    for each single ``ReorderInput`` or ``ReorderOutput``. A boundary where the brick before
    converts out of the blocked layout and the brick after converts back in is one round trip
    the model never makes; a conversion inside a brick (ShuffleNet's units convert around their
    depthwise convolution, on tensors of the brick's own input and output shape) is one the
    model makes too and cancels; where the model converts where its bricks do not (a
    DenseNet's concatenations), the count is negative and the estimate gains it. Nothing is
    known, and nothing is taken away, when the whole model or any brick was not profiled (a
    framework other than ONNX Runtime).
    """
    if not bricks:
        return {}
    whole = conversions.get(whole_key(bricks[0].model))
    if whole is None or any(b.signature not in conversions for b in bricks):
        return {}
    net: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for brick in bricks:
        net.update(conversions[brick.signature])
    net.subtract(whole)
    trips: dict[str, float] = {}
    for (_, shape), n in sorted(net.items()):
        if n and len(shape) == 4:
            key = reorder_key(shape)
            trips[key] = trips.get(key, 0.0) + n / 2
    return {key: n for key, n in trips.items() if n}


@dataclass(frozen=True)
class WeightStream:
    """A model's weight matrices read once each, back to back (:func:`weight_stream`)."""

    model: str
    #: streamed initializer -> its (rows, columns): the first dimension by the rest
    tensors: tuple[tuple[str, tuple[int, int]], ...]

    @property
    def key(self) -> str:
        """The study's and results database's name: the shapes streamed, not the model."""
        shapes = ";".join(f"{r}x{c}" for _, (r, c) in self.tensors)
        return "stream:" + hashlib.sha256(shapes.encode()).hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        return sum(4 * r * c for _, (r, c) in self.tensors)


def weight_stream(model: str, weights: Mapping[str, np.ndarray]) -> WeightStream | None:
    """The float matrices among ``model``'s out-of-band ``weights``
    (:func:`~trims.evaluation.submodel.weights`: biases and small tensors, a negligible share of
    the bytes, are left out) as one stream, or None if there are none."""
    import numpy as np

    tensors = tuple(
        (name, (int(array.shape[0]), int(array.size // array.shape[0])))
        for name, array in weights.items()
        if array.dtype == np.float32 and array.ndim >= 2
    )
    return WeightStream(model, tensors) if tensors else None


@dataclass(frozen=True)
class Floors:
    """How long a model's bricks take at least, reading their weights at the rate the whole
    model's working set streams at.

    Run back to back, a brick finds part of its weights still cached from its previous run;
    inside the model every other layer's weights and activations pass through the caches
    between two runs of it, so a model whose weights outgrow the caches reads each layer's from
    memory (AlexNet's classifier, 231 of its 233 MiB of weights: fc6, fc7 and fc8 at 14 GB/s
    in the model, up to 26 GB/s as bricks, on the machine it was found on). The stream benchmark
    (:func:`~trims.evaluation.ort_backend.stream_model`) times one pass over all the model's
    weight matrices in one run: ``t_s``, a run's fixed cost ``o`` included. A brick whose
    weights are a share ``p`` of the streamed bytes takes at least ``o + p (t_s - o)``: a
    roofline bound at the bandwidth measured for the model's own working set, in the model's
    own framework and threads. Convolutions, which reuse their weights, sit far above it; the
    fully connected layers of a batch-1 model sit on it.
    """

    #: the stream benchmark's key (:attr:`WeightStream.key`)
    key: str
    #: brick signature -> its weights' share of the streamed bytes (bricks with weights only)
    share: Mapping[str, float]

    def binding(self, results: Mapping[str, Measurement]) -> dict[str, float]:
        """The shares of the bricks whose floor is above their measured time."""
        stream = results.get(self.key)
        if stream is None:
            return {}
        o = results[EMPTY].trimmed_mean_ms
        one_pass = stream.trimmed_mean_ms - o
        return {
            sig: p
            for sig, p in self.share.items()
            if p * one_pass > results[sig].trimmed_mean_ms - o
        }


#: models whose weights' sizes are within this factor of each other share one stream
#: benchmark, the first one's (:func:`shared_stream`)
STREAM_SHARING = math.sqrt(2.0)


def shared_stream(stream: WeightStream, opened: Iterable[WeightStream]) -> WeightStream:
    """The stream benchmark that stands for ``stream``: the first of ``opened`` whose size is
    within :data:`STREAM_SHARING` of it, else ``stream`` itself.

    The rate a working set streams at moves slowly with its size (measured on the machine the
    floors were found on: 17.3 GB/s at 128 MiB, 14.7 at 256 and at 512), while a stream's runs
    cost its whole size each; families of models share one (the four VGGs, 507-548 MiB).
    """
    for other in opened:
        if max(stream.nbytes, other.nbytes) <= STREAM_SHARING * min(stream.nbytes, other.nbytes):
            return other
    return stream


def floors(
    ir: ModelIR, bricks: list[Brick], stream: WeightStream, measured: WeightStream | None = None
) -> Floors:
    """Each brick's weights (those of ``stream``, the model's own) as a share of the bytes
    ``measured`` (the benchmark that stands for it, :func:`shared_stream`; by default itself)
    reads: a brick's floor is that share of the measured pass."""
    measured = measured or stream
    nbytes = {name: 4 * r * c for name, (r, c) in stream.tensors}
    share: dict[str, float] = {}
    for brick in bricks:
        names = {name for i in brick.indices for name, _ in ir.layers[i].params}
        mine = sum(nbytes.get(name, 0) for name in names)
        if mine:
            share.setdefault(brick.signature, mine / measured.nbytes)
    return Floors(measured.key, share)


def reorder_key(shape: tuple[int, ...]) -> str:
    """The study's (and results database's) name for the conversion benchmark of ``shape``."""
    return "reorder:" + "x".join(str(d) for d in shape)


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


#: the study's key for the fixed-cost (empty model) benchmark
EMPTY = "empty"


@dataclass
class BrickEstimate:
    """One model's measured latency against its brick reconstruction, with uncertainty.

    ``*_se_ms`` are standard errors; intervals are 95% (normal quantile, :data:`Z95`). The
    error's interval comes from both sides' errors, which are independent (different runs),
    through the ratio's first-order (delta method) propagation.
    """

    name: str
    measured_ms: float
    estimated_ms: float
    bricks: int
    measured_se_ms: float = 0.0
    estimated_se_ms: float = 0.0
    #: sum of the bricks' measured times (occurrences counted), before any correction
    raw_ms: float = 0.0
    #: the fixed per-run cost subtracted: (bricks - 1) x the empty model's time
    overhead_ms: float = 0.0
    #: the boundary layout conversions subtracted
    layout_ms: float = 0.0
    #: what the weight-stream floors added (:class:`Floors`)
    floor_ms: float = 0.0
    #: both sides reached the precision asked before any time or run budget ran out
    precise: bool = True

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.estimated_ms - self.measured_ms) / self.measured_ms

    @property
    def error_ci_pct(self) -> tuple[float, float]:
        """95% confidence interval of :attr:`error_pct`."""
        ratio = self.estimated_ms / self.measured_ms
        rel = math.hypot(
            self.estimated_se_ms / self.estimated_ms if self.estimated_ms > 0 else 0.0,
            self.measured_se_ms / self.measured_ms,
        )
        half = Z95 * ratio * rel
        return (100.0 * (ratio - half - 1.0), 100.0 * (ratio + half - 1.0))

    @property
    def correction_pct(self) -> float:
        """How much of the raw brick sum the corrections took away, net, in percent of it
        (negative where the floors added more than the fixed costs and conversions took)."""
        net = self.overhead_ms + self.layout_ms - self.floor_ms
        return 100.0 * net / self.raw_ms if self.raw_ms else 0.0

    def verdict(self, limit_pct: float = 10.0) -> str:
        """``within`` / ``outside`` ``limit_pct`` with 95% confidence, else ``straddles``."""
        lo, hi = self.error_ci_pct
        if -limit_pct <= lo and hi <= limit_pct:
            return "within"
        if hi < -limit_pct or lo > limit_pct:
            return "outside"
        return "straddles"


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


def terms(
    bricks: list[Brick],
    conversions: Mapping[str, Conversions],
    floors: Floors | None = None,
    results: Mapping[str, Measurement] | None = None,
) -> dict[str, float]:
    """What a model's estimate is made of: ``E = sum_k c_k t_k`` over unique bricks,
    conversions, the weight stream and the empty model, with signed coefficients ``c_k``
    (:func:`~trims.evaluation.rounds.budgets` uses their size).

    A brick met ``c`` times counts ``c``; the fixed cost ``o`` is taken away ``n - 1`` times
    for ``n`` bricks; a conversion benchmark ``r_s`` made ``m_s`` extra round trips counts
    ``-m_s`` and gives back the ``m_s`` fixed costs its own runs paid. A brick held up by its
    floor (:meth:`Floors.binding`, from ``results``) counts as ``o + p (t_s - o)``: share
    ``p`` of the stream and ``1 - p`` of a fixed cost, nothing of its own time.
    """
    counts: defaultdict[str, float] = defaultdict(float)
    bound: dict[str, float] = {}
    stream = ""
    if floors is not None and results is not None:
        bound, stream = floors.binding(results), floors.key
    empty = 1.0 - len(bricks)
    for brick in bricks:
        p = bound.get(brick.signature)
        if p is None:
            counts[brick.signature] += 1
        else:
            counts[stream] += p
            empty += 1.0 - p
    for key, m in extra_conversions(bricks, conversions).items():
        counts[key] -= m
        empty += m
    counts[EMPTY] += empty
    return {key: c for key, c in counts.items() if abs(c) > 1e-12}


def estimate(
    name: str,
    bricks: list[Brick],
    conversions: Mapping[str, Conversions],
    results: Mapping[str, Measurement],
    whole: Measurement,
    precise: bool = True,
    floors: Floors | None = None,
) -> BrickEstimate:
    """The model's brick estimate with its standard error, against its measurement."""
    counts = terms(bricks, conversions, floors, results)
    times = {key: m.trimmed_mean_ms for key, m in results.items()}
    overhead = times[EMPTY]
    layout = sum(
        (times[key] - overhead) * -c for key, c in counts.items() if key.startswith("reorder:")
    )
    floor = 0.0
    bound = floors.binding(results) if floors is not None else {}
    if floors is not None and bound:
        one_pass = times[floors.key] - overhead
        floor = sum(
            overhead + bound[b.signature] * one_pass - times[b.signature]
            for b in bricks
            if b.signature in bound
        )
    variance = sum((c * results[key].std_error_ms) ** 2 for key, c in counts.items())
    return BrickEstimate(
        name=name,
        measured_ms=whole.trimmed_mean_ms,
        estimated_ms=reconstruct(bricks, times, overhead, layout, floor),
        bricks=len(bricks),
        measured_se_ms=whole.std_error_ms,
        estimated_se_ms=math.sqrt(variance),
        raw_ms=sum(times[b.signature] for b in bricks),
        overhead_ms=(len(bricks) - 1) * overhead,
        layout_ms=layout,
        floor_ms=floor,
        precise=precise,
    )


def study(
    irs: list[ModelIR],
    bencher: Bencher,
    granularities: list[int],
    progress: Callable[[list[ModelIR], str], Iterable[ModelIR]],
    target_rel: float = 0.01,
) -> list[BrickStudy]:
    """Measure every model whole and every unique brick once per granularity; compare.

    Each model's time, measured whole and estimated from bricks, is measured until its standard
    error is at most ``target_rel`` of it. A model's estimate (:func:`estimate`) is made of its
    unique bricks, the empty model (the fixed cost of a run, subtracted once per extra brick),
    the layout round trips its bricks made beyond the whole model's
    (:func:`extra_conversions`) and, with ONNX Runtime, its weight stream (:class:`Floors`),
    each a benchmark of its own; :func:`budgets` splits the model's precision among them, so
    the estimate meets the same ``target_rel`` as the whole measurement.

    Per model: the whole model and its new bricks (every granularity; each profiled on its
    first, warm-up run to learn its layout conversions), its weight stream and the new
    conversions are opened and piloted (``min_reps`` runs), then measured in interleaved rounds
    (:meth:`~trims.evaluation.rounds.Rounds.run`).
    Bricks equal across granularities and models are one benchmark and one database row; each
    granularity's benchmarking time counts every brick, conversion, weight-stream and
    empty-model benchmark it needs, from export to the last timed run.
    """
    from trims.evaluation import generator

    state = Rounds()
    conversions: dict[str, Conversions] = {}

    def open_profiled(key: str, bench: Benchmark) -> None:
        """A brick's or whole model's term, its first (warm-up) run profiled for its layout
        conversions."""
        if key in state.terms:
            return
        if bencher.framework != "onnxruntime":
            state.open(key, bench, bencher)
            return
        sampler, conversions[key] = bencher.open_profiled(bench)
        state.open(key, bench, bencher, sampler)

    state.open(EMPTY, generator.empty_benchmark(), bencher)
    per_g = {g: {ir.name: decompose(ir, g) for ir in irs} for g in granularities}
    floors_of: dict[int, dict[str, Floors]] = {g: {} for g in granularities}
    streams: list[WeightStream] = []
    whole_precise: dict[str, bool] = {}
    for ir in progress(irs, "models"):
        # loading the weights into memory is preparation both sides share, like loading the model
        weights = submodel.weights(ir) if bencher.framework == "onnxruntime" else None
        whole_name = whole_key(ir.name)
        open_profiled(whole_name, generator.model_benchmark(ir, weights))
        for g in granularities:
            for brick in per_g[g][ir.name]:
                open_profiled(brick.signature, _benchmark(ir, brick, weights))
        if weights is not None and (stream := weight_stream(ir.name, weights)) is not None:
            measured = shared_stream(stream, streams)
            if measured is stream:
                streams.append(stream)
                state.open(stream.key, _stream_benchmark(stream, weights), bencher)
            for g in granularities:
                floors_of[g][ir.name] = floors(ir, per_g[g][ir.name], stream, measured)
        for g in granularities:
            for key in extra_conversions(per_g[g][ir.name], conversions):
                state.open(key, _reorder_benchmark(key), bencher)

        def goals(ir: ModelIR = ir, whole: str = whole_name) -> dict[str, float]:
            current = {key: term.current() for key, term in state.terms.items()}
            asked = {whole: target_rel * current[whole].trimmed_mean_ms}
            for g in granularities:
                bricks, under = per_g[g][ir.name], floors_of[g].get(ir.name)
                counts = terms(bricks, conversions, under, current)
                value = estimate(ir.name, bricks, conversions, current, current[whole], True, under)
                for key, se in budgets(counts, value.estimated_ms, target_rel).items():
                    asked[key] = min(se, asked.get(key, math.inf))
            return asked

        state.run(goals)
        state.close()
        whole_precise[ir.name] = whole_name not in state.imprecise
    out: list[BrickStudy] = []
    results = state.results()
    for g in granularities:
        per_model = per_g[g]
        models = []
        bricks_only = {b.signature for bricks in per_model.values() for b in bricks}
        # every benchmark the estimates needed, whether or not it ended up in one (a stream
        # whose floors bind nowhere, a brick held up by its floor)
        needed = {EMPTY, *bricks_only, *(f.key for f in floors_of[g].values())}
        for ir in irs:
            under = floors_of[g].get(ir.name)
            counts = terms(per_model[ir.name], conversions, under, results)
            needed.update(counts)
            precise = whole_precise[ir.name] and not (set(counts) & state.imprecise)
            whole = results[whole_key(ir.name)]
            models.append(
                estimate(ir.name, per_model[ir.name], conversions, results, whole, precise, under)
            )
        out.append(
            BrickStudy(
                granularity=g,
                models=models,
                unique_bricks=len(bricks_only),
                total_bricks=sum(len(b) for b in per_model.values()),
                time_whole_s=sum(results[whole_key(ir.name)].elapsed_s for ir in irs),
                time_bricks_s=sum(results[k].elapsed_s for k in needed),
                unique_bricks_ms=sum(results[k].trimmed_mean_ms for k in bricks_only),
            )
        )
    return out


def _benchmark(ir: ModelIR, brick: Brick, weights: Mapping[str, np.ndarray] | None) -> Benchmark:
    from trims.evaluation import generator

    label = f"{ir.name}/brick@{brick.indices[0]}"
    external = frozenset(weights or ())
    return generator.Benchmark(
        "brick", brick.signature, label, lambda: export(ir, brick, external), weights
    )


def _stream_benchmark(stream: WeightStream, weights: Mapping[str, np.ndarray]) -> Benchmark:
    """``stream`` as a benchmark over the model's own arrays (two-dimensional views)."""
    from trims.evaluation import generator

    shapes = [shape for _, shape in stream.tensors]
    views = {
        f"w{i}": weights[name].reshape(shape) for i, (name, shape) in enumerate(stream.tensors)
    }
    label = f"{stream.model} weights streamed ({stream.nbytes / 2**20:.1f} MiB)"
    return generator.Benchmark(
        "stream", stream.key, label, lambda: ort_backend.stream_model(shapes), views
    )


def _reorder_benchmark(key: str) -> Benchmark:
    """The round-trip benchmark named ``key`` (:func:`reorder_key`)."""
    from trims.evaluation import generator

    shape = tuple(int(d) for d in key.removeprefix("reorder:").split("x"))
    return generator.Benchmark(
        "layout", key, f"NCHW -> NCHWc -> NCHW {key[8:]}", lambda: ort_backend.reorder_model(shape)
    )
