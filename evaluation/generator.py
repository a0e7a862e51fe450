"""Benchmark generator: unique layer configurations -> runnable micro-benchmarks, and a bencher.

A micro-benchmark is a one-node ONNX model cut from the prepared model (same attributes, shapes
and weights). The :class:`Bencher` runs benchmarks in one framework + variant, stores results in
the :class:`~trims.evaluation.db.ResultsDB` and skips what is already measured unless forced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trims.errors import ValidationError
from trims.evaluation import ort_backend, submodel
from trims.evaluation.db import ResultKey, ResultsDB, system_id
from trims.evaluation.measure import Measurement, MeasureSettings, Sampler, stable

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from trims.evaluation.ir import ModelIR

log = logging.getLogger(__name__)

FRAMEWORKS = ("onnxruntime", "pytorch", "mxnet")

#: the "fused vs unfused" pattern: a Conv followed by these single-consumer ops
_FUSIBLE = ("BatchNormalization", "Mul", "Add", "Sum", "Relu")
#: benchmarks per MXNet runner process
_MX_BATCH = 200
#: ops that may join a second branch (the residual add ONNX Runtime fuses into the Conv)
_JOINS = ("Add", "Sum")


@dataclass
class Benchmark:
    """One runnable benchmark: a layer, a brick, a fusion chain or a whole model."""

    kind: str
    signature: str
    label: str
    build: Callable[[], onnx.ModelProto]
    #: data of the initializers ``build`` leaves out of band (ONNX Runtime only)
    weights: Mapping[str, np.ndarray] | None = None


def layer_benchmarks(irs: Iterable[ModelIR]) -> list[Benchmark]:
    """One benchmark per unique layer configuration across ``irs`` (first occurrence wins)."""
    seen: dict[str, Benchmark] = {}
    for ir in irs:
        for layer in ir.layers:
            if layer.signature in seen:
                continue
            seen[layer.signature] = Benchmark(
                kind="layer",
                signature=layer.signature,
                label=f"{ir.name}/{layer.name} {layer.op_type}",
                build=_extractor(ir, [layer.index], f"{ir.name}_{layer.index}"),
            )
    return list(seen.values())


def _extractor(ir: ModelIR, indices: list[int], name: str) -> Callable[[], onnx.ModelProto]:
    return lambda: submodel.extract(ir, indices, name)


def fusion_chains(
    ir: ModelIR, heads: Collection[str] = ("Conv",), fusible: Collection[str] = _FUSIBLE
) -> list[list[int]]:
    """``heads`` layers (Conv) followed by a chain of single-consumer ``fusible`` layers
    (BN/scale/residual-add/ReLU).

    Only chains of two or more layers count, and no layer belongs to two chains (a residual
    add joins the chain of whichever branch reaches it first in topological order).
    """
    chains: list[list[int]] = []
    claimed: set[int] = set()
    for layer in ir.layers:
        if layer.op_type not in heads:
            continue
        chain = [layer.index]
        current = layer.index
        while len(ir.succs[current]) == 1:
            nxt = ir.succs[current][0]
            op = ir.layers[nxt].op_type
            if op not in fusible or nxt in claimed:
                break
            if len(ir.preds[nxt]) != 1 and op not in _JOINS:
                break
            chain.append(nxt)
            current = nxt
        if len(chain) >= 2:
            chains.append(chain)
            claimed.update(chain)
    return chains


def chain_benchmarks(irs: Iterable[ModelIR]) -> list[tuple[Benchmark, list[str]]]:
    """Unique fusion chains as benchmarks, with the layer signatures each chain is made of."""
    seen: dict[str, tuple[Benchmark, list[str]]] = {}
    for ir in irs:
        for chain in fusion_chains(ir):
            sig = submodel.group_signature(ir, chain)
            if sig in seen:
                continue
            ops = "+".join(ir.layers[i].op_type for i in chain)
            bench = Benchmark(
                kind="chain",
                signature=sig,
                label=f"{ir.name}/{ir.layers[chain[0]].name} {ops}",
                build=_extractor(ir, chain, f"{ir.name}_chain_{chain[0]}"),
            )
            seen[sig] = (bench, [ir.layers[i].signature for i in chain])
    return list(seen.values())


@dataclass
class BenchResult:
    """A measurement and whether it was taken now (False: read from the database)."""

    measurement: Measurement
    fresh: bool


class Bencher:
    """Run benchmarks for one framework and variant, through the results database."""

    def __init__(
        self,
        db: ResultsDB,
        framework: str,
        variant: str,
        batch: int,
        settings: MeasureSettings,
        force: bool = False,
        mxnet_python: str | None = None,
    ) -> None:
        if framework not in FRAMEWORKS:
            raise ValidationError(f"unknown framework {framework!r}; choose from {FRAMEWORKS}")
        self.db = db
        self.framework = framework
        self.variant = variant
        self.batch = batch
        self.settings = settings
        self.force = force
        self.system = system_id()
        self._threads = int(
            dict(p.split("=", 1) for p in variant.split(",") if "=" in p).get("threads", "1")
        )
        self._mx_python = ""
        if framework == "onnxruntime":
            self._ort_variant = ort_backend.OrtVariant.parse(variant)
            self.version = ort_backend.framework_version()
        elif framework == "pytorch":
            from trims.evaluation import torch_backend

            self.version = torch_backend.framework_version()
        else:
            from trims.evaluation import mxnet_backend

            self._mx_python = mxnet_backend.find_python(mxnet_python)
            self.version = mxnet_backend.framework_version(self._mx_python)

    def key(self, kind: str, signature: str) -> ResultKey:
        return ResultKey(
            system=self.system,
            framework=self.framework,
            framework_version=self.version,
            kind=kind,
            signature=signature,
            batch=self.batch,
            variant=self.variant,
        )

    def _runner(
        self, model: onnx.ModelProto, name: str, weights: Mapping[str, np.ndarray] | None
    ) -> Callable[[], object]:
        if self.framework == "onnxruntime":
            return ort_backend.runner(model, self._ort_variant, name, weights)
        if weights is not None:
            raise ValidationError(
                f"benchmark {name!r} keeps its weights out of band, which only onnxruntime takes"
            )
        from trims.evaluation import torch_backend

        return torch_backend.runner(model, self._threads, name)

    def run_many(
        self,
        benches: list[Benchmark],
        progress: Callable[[list[Benchmark]], Iterable[Benchmark]] = iter,
    ) -> list[BenchResult]:
        """Run several benchmarks; MXNet gets the unmeasured ones in batches, one process each."""
        if self.framework != "mxnet":
            return [self.run(b) for b in progress(benches)]
        from trims.evaluation import mxnet_backend

        results: dict[int, BenchResult] = {}
        pending: list[int] = []
        for i, bench in enumerate(benches):
            cached = None if self.force else self.db.get(self.key(bench.kind, bench.signature))
            if cached is None:
                pending.append(i)
            else:
                results[i] = BenchResult(cached, fresh=False)
        chunks = [pending[k : k + _MX_BATCH] for k in range(0, len(pending), _MX_BATCH)]
        for chunk in chunks:
            specs = [mxnet_backend.spec(benches[i].build(), benches[i].label) for i in chunk]
            measured = mxnet_backend.run_specs(self._mx_python, specs, self.settings, self._threads)
            for i, m in zip(chunk, measured, strict=True):
                self.db.put(self.key(benches[i].kind, benches[i].signature), m, benches[i].label)
                results[i] = BenchResult(m, fresh=True)
        return [results[i] for i in range(len(benches))]

    def run(self, bench: Benchmark) -> BenchResult:
        """Measure ``bench`` with the settings' stability rule, or reuse the stored result.

        ``elapsed_s`` is the benchmarking cost on the measurement clock: building the ONNX
        model (a brick's export), creating the session, warm-up and the timed runs.
        """
        if self.framework == "mxnet":
            return self.run_many([bench])[0]
        cached = self.cached(bench)
        if cached is not None:
            return BenchResult(cached, fresh=False)
        s = self.settings
        result = self.open(bench).run(lambda xs: stable(xs, s.rel_tol, s.abs_tol_ms / 1e3))
        self.store(bench, result)
        return BenchResult(result, fresh=True)

    def cached(self, bench: Benchmark) -> Measurement | None:
        """The stored result for ``bench``, or None if there is none or re-measuring is forced."""
        return None if self.force else self.db.get(self.key(bench.kind, bench.signature))

    def open(self, bench: Benchmark) -> Sampler:
        """Build ``bench``, create its session and warm it up; the setup cost counts as elapsed."""
        if self.framework == "mxnet":
            raise ValidationError(
                f"benchmark {bench.label!r}: MXNet runs benchmarks in batches in its own "
                "process and cannot keep one open; use onnxruntime or pytorch"
            )
        clock = self.settings.timer()
        start = clock()
        fn = self._runner(bench.build(), bench.label, bench.weights)
        return Sampler(fn, self.settings, setup_s=clock() - start)

    def open_profiled(self, bench: Benchmark) -> tuple[Sampler, ort_backend.Conversions]:
        """:meth:`open` for ONNX Runtime, plus the layout conversions one run makes
        (:func:`~trims.evaluation.ort_backend.profiled_runner`: its profiled first run is the
        first warm-up run)."""
        if self.framework != "onnxruntime":
            raise ValidationError(f"layout conversions are ONNX Runtime's, not {self.framework}'s")
        clock = self.settings.timer()
        start = clock()
        fn, layout = ort_backend.profiled_runner(
            bench.build(), self._ort_variant, bench.label, bench.weights
        )
        return Sampler(fn, self.settings, setup_s=clock() - start), layout

    def store(self, bench: Benchmark, result: Measurement) -> None:
        """Record a measurement taken through :meth:`open`."""
        self.db.put(self.key(bench.kind, bench.signature), result, bench.label)
        log.debug("%s %s measured: %.3f ms", bench.kind, bench.label, result.trimmed_mean_ms)

    def overhead(self) -> Measurement:
        """Fixed cost of one run of an empty model; subtracted from layer and brick times."""
        bench = empty_benchmark()
        return self.run(bench).measurement

    def overhead_ms(self) -> float:
        return self.overhead().trimmed_mean_ms


def empty_benchmark() -> Benchmark:
    """The empty model (:func:`~trims.evaluation.ort_backend.empty_model`): the fixed cost of
    one run, which layer and brick benchmarks pay and subtract."""
    return Benchmark("overhead", "empty", "empty model", ort_backend.empty_model)


def model_benchmark(ir: ModelIR, weights: Mapping[str, np.ndarray] | None = None) -> Benchmark:
    """The whole prepared model as a benchmark.

    With ``weights`` (:func:`~trims.evaluation.submodel.weights`) the model is exported the way
    a brick is, its large initializers out of band, so whole models and bricks pay the same
    kind of setup.
    """
    everything = list(range(len(ir.layers)))
    sig = submodel.group_signature(ir, everything)
    if weights is None:
        return Benchmark("model", sig, ir.name, lambda: ir.model)
    return Benchmark(
        "model", sig, ir.name, lambda: submodel.extract(ir, everything, ir.name, weights), weights
    )
