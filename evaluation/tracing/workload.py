"""Workloads: one model in one framework, run once untraced or under a trace level.

A model is named as everywhere in evaluation (a zoo name, a PyTorch family model
``torch:resnet18``, the path of an ``.onnx`` file) or ``example:resnet50``, the ResNet-50 of
``examples/resnet50`` (its network module, with the seeded weights its ``prepare.py`` writes;
read from ``examples/resnet50/weights/resnet50.safetensors`` when that file exists, computed
the same way otherwise, so nothing is downloaded).

Frameworks: ``torch`` (the family and example models as their own ``nn.Module``; an ONNX model
through the evaluation's PyTorch interpreter, one eager op per node) and ``onnxruntime`` (the
prepared ONNX graph, ``ORT_ENABLE_ALL``) and ``mxnet`` (the prepared ONNX graph as ``mx.nd``
operators, run by a child process in the MXNet environment for the whole leveled run:
:mod:`trims.evaluation.tracing.mxnet_workload`).

One predict is three steps, each its own model-level span when traced: ``preprocess`` (the
input array to framework tensors), the inference, ``postprocess`` (the outputs back to NumPy).
The untraced run does exactly the same work without the clock reads.

Note [one profiling session per level]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:meth:`Workload.traced` opens the level's profiler once and runs many predicts inside it: ONNX
Runtime profiling is fixed when its session is created and ends for good at ``end_profiling``,
and starting ``torch.profiler`` costs milliseconds that belong to no predict. Every predict gets
its own model span, so each run's latency is read from its span, never from the session.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import NotFound, ValidationError
from trims.tracing.levels import Level
from trims.tracing.sources import Recording
from trims.tracing.spans import Span

if TYPE_CHECKING:
    import onnx

    from trims.evaluation.ir import ModelIR

log = logging.getLogger(__name__)

__all__ = ["EXAMPLE", "FRAMEWORKS", "TracedRuns", "Workload", "load", "parse_framework"]

#: frameworks ``trims trace`` accepts
FRAMEWORKS = ("torch", "onnxruntime", "mxnet")
#: the ResNet-50 of examples/resnet50
EXAMPLE = "example:resnet50"
_REPO = Path(__file__).resolve().parents[2]
_EXAMPLE_DIR = _REPO / "examples" / "resnet50"


def parse_framework(value: object) -> str:
    """The framework name, or ValidationError listing the allowed ones."""
    if isinstance(value, str) and value.strip().lower() in FRAMEWORKS:
        return value.strip().lower()
    raise ValidationError(
        f"framework: unknown framework {value!r}; use one of {', '.join(FRAMEWORKS)}",
        field="framework",
    )


def _thread_track(process: str) -> tuple[str, str]:
    return (process, f"thread {threading.get_native_id()}")


class TracedRuns:
    """Predicts inside one profiling session (Note [one profiling session per level]).

    :meth:`run` runs one predict and returns its model span; :attr:`recording` holds every
    model span and, once the session has closed, the source's spans, ``unavailable`` and
    ``error``.
    """

    def __init__(self, workload: Workload, process: str, label: str) -> None:
        self._workload = workload
        self._track = _thread_track(process)
        self._label = label
        self.recording = Recording()

    def run(self) -> Span:
        w = self._workload
        t0 = time.time_ns()
        x = w.preprocess()
        t1 = time.time_ns()
        y = w.infer(x)
        t2 = time.time_ns()
        w.postprocess(y)
        t3 = time.time_ns()
        predict = Span(
            name=f"predict {self._label}",
            level=Level.MODEL,
            start_ns=t0,
            end_ns=t3,
            track=self._track,
            attributes={"model": w.name, "framework": w.framework, "batch": w.batch},
        )
        for name, start, end in (("preprocess", t0, t1), ("postprocess", t2, t3)):
            self.recording.spans.append(
                Span(name, Level.MODEL, start, end, self._track, parent_id=predict.span_id)
            )
        self.recording.spans.append(predict)
        return predict

    def absorb(self, source: Recording) -> None:
        """Add what the profiler recorded (called once, when its session closes)."""
        self.recording.spans.extend(source.spans)
        self.recording.unavailable.update(source.unavailable)
        self.recording.error = source.error


class Workload(ABC):
    """One model in one framework with a fixed input of the model's shape and ``batch``."""

    framework: str

    def __init__(self, name: str, batch: int, threads: int) -> None:
        self.name = name
        self.batch = batch
        self.threads = threads
        self._ir: ModelIR | None = None

    @abstractmethod
    def preprocess(self) -> Any: ...

    @abstractmethod
    def infer(self, x: Any) -> Any: ...

    @abstractmethod
    def postprocess(self, y: Any) -> Any: ...

    @abstractmethod
    def onnx_model(self) -> onnx.ModelProto:
        """The prepared ONNX graph of this model (the source of its layer IR)."""

    @abstractmethod
    def _profiled(
        self, level: Level, runs: TracedRuns, process: str
    ) -> AbstractContextManager[None]:
        """Open the framework's profiler at ``level`` (> model) around the runs."""

    def run(self) -> float | None:
        """One predict, untraced: None (the caller times it), or the seconds it took as timed
        by a workload that runs in another process (a caller's clock would add the IPC)."""
        self.postprocess(self.infer(self.preprocess()))
        return None

    @contextmanager
    def traced(self, level: Level, *, process: str) -> Iterator[TracedRuns]:
        """Predicts at ``level`` (model or deeper); see :class:`TracedRuns`."""
        if level < Level.MODEL:
            raise ValidationError(f"a traced run needs level model or deeper, not {level.label}")
        runs = TracedRuns(self, process, self.name)
        if level is Level.MODEL:
            yield runs
            return
        with self._profiled(level, runs, process):
            yield runs

    def trace_once(self, level: Level, *, process: str) -> Recording:
        """One predict at ``level``: its model span(s) and the source's spans."""
        with self.traced(level, process=process) as runs:
            runs.run()
        return runs.recording

    def ir(self) -> ModelIR:
        """The layer IR (FLOPs, bytes, shapes per node) of :meth:`onnx_model`."""
        if self._ir is None:
            from trims.evaluation import ir

            self._ir = ir.build(self.onnx_model(), self.name, self.batch)
        return self._ir

    def close(self) -> None:  # noqa: B027  # optional: most workloads hold nothing to drop
        """Drop the framework objects (sessions, modules)."""


def _prepared(name: str, model: onnx.ModelProto, batch: int) -> onnx.ModelProto:
    from trims.evaluation import graph

    return graph.prepare(model, name, batch)


def _example_module() -> Any:
    """The example's ResNet50 in eval mode with the weights its prepare.py writes."""
    import torch

    path = _EXAMPLE_DIR / "network.py"
    if not path.is_file():
        raise NotFound(
            f"{EXAMPLE}: {path} is missing; run trims trace from a source checkout, or name "
            "torch:resnet50 (the same architecture) instead"
        )
    spec = importlib.util.spec_from_file_location("trims_example_resnet50_network", path)
    assert spec is not None and spec.loader is not None
    network: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(network)
    weights = _EXAMPLE_DIR / "weights" / "resnet50.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = network.random_state_dict(0)
    module = network.ResNet50()
    module.load_state_dict(state)
    log.debug(
        "example %s built (weights from %s)", EXAMPLE, weights if weights.is_file() else "seed 0"
    )
    return module.eval().to(torch.float32)


def _onnx_source(name: str, batch: int) -> onnx.ModelProto:
    """The ONNX form of any model name, before preparation."""
    from trims.evaluation import families, graph

    if name == EXAMPLE:
        return families.export_module(_example_module(), name, batch)
    if families.is_family(name):
        return families.export(name, batch)
    return graph.load(name)[1]


def _model_name(source: str) -> str:
    from trims.evaluation import families, zoo

    if source == EXAMPLE or families.is_family(source) or source in zoo.zoo_names():
        return source
    return Path(source).stem


class TorchWorkload(Workload):
    """A PyTorch module (family or example model) or an ONNX graph through the interpreter."""

    framework = "torch"

    def __init__(self, source: str, batch: int, threads: int) -> None:
        import torch

        from trims.evaluation import families

        super().__init__(_model_name(source), batch, threads)
        torch.set_num_threads(threads)
        self._source = source
        self._onnx: onnx.ModelProto | None = None
        self._forward: Callable[[Any], Any]
        if source == EXAMPLE or families.is_family(source):
            module = _example_module() if source == EXAMPLE else families.build(source)
            self._forward = module
            shape: tuple[int, ...] = (batch, 3, 224, 224)
            self._input_name = "data"
        else:
            from trims.evaluation.ort_backend import random_inputs
            from trims.evaluation.torch_backend import interpreter

            model = self.onnx_model()
            feeds = random_inputs(model)
            if len(feeds) != 1:
                raise ValidationError(
                    f"model {self.name!r} has {len(feeds)} inputs; trims trace feeds one"
                )
            ((self._input_name, sample),) = feeds.items()
            shape = sample.shape
            run = interpreter(model, self.name)
            outputs = [o.name for o in model.graph.output]
            self._forward = lambda x: [run({self._input_name: x})[o] for o in outputs]
        self._input = np.random.default_rng(0).standard_normal(shape).astype(np.float32)

    def preprocess(self) -> Any:
        import torch

        return torch.from_numpy(self._input)

    def infer(self, x: Any) -> Any:
        import torch

        with torch.inference_mode():
            return self._forward(x)

    def postprocess(self, y: Any) -> Any:
        if isinstance(y, list):
            return [t.numpy() for t in y]
        return y.numpy()

    def onnx_model(self) -> onnx.ModelProto:
        if self._onnx is None:
            self._onnx = _prepared(self.name, _onnx_source(self._source, self.batch), self.batch)
        return self._onnx

    @contextmanager
    def _profiled(self, level: Level, runs: TracedRuns, process: str) -> Iterator[None]:
        from trims.tracing.sources import torch as torch_source

        with torch_source.profile(level, process=process) as recording:
            yield
        runs.absorb(recording)


class OrtWorkload(Workload):
    """The prepared ONNX graph in ONNX Runtime (CPU, ``ORT_ENABLE_ALL``, one inter-op thread)."""

    framework = "onnxruntime"

    def __init__(self, source: str, batch: int, threads: int) -> None:
        from trims.evaluation.ort_backend import random_inputs

        super().__init__(_model_name(source), batch, threads)
        self._model = _prepared(self.name, _onnx_source(source, batch), batch)
        self._feeds = random_inputs(self._model)
        self._session = self._new_session(None)
        self._active = self._session

    def _options(self) -> Any:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        return opts

    def _new_session(self, options: Any) -> Any:
        import onnxruntime as ort

        try:
            return ort.InferenceSession(
                self._model.SerializeToString(),
                options or self._options(),
                providers=["CPUExecutionProvider"],
            )
        except Exception as e:
            raise ValidationError(f"model {self.name!r} does not load in ONNX Runtime: {e}") from e

    def preprocess(self) -> Any:
        return dict(self._feeds)

    def infer(self, x: Any) -> Any:
        return self._active.run(None, x)

    def postprocess(self, y: Any) -> Any:
        return [np.asarray(o) for o in y]

    def onnx_model(self) -> onnx.ModelProto:
        return self._model

    @contextmanager
    def _profiled(self, level: Level, runs: TracedRuns, process: str) -> Iterator[None]:
        from trims.tracing.sources import onnxruntime as ort_source

        profiling = self._new_session(ort_source.session_options(level, base=self._options()))
        self._active = profiling
        try:
            yield
        finally:
            self._active = self._session
            runs.absorb(ort_source.collect(profiling, process=process))

    def close(self) -> None:
        self._session = self._active = None


def load(
    source: str,
    framework: str,
    *,
    batch: int = 1,
    threads: int = 1,
    mxnet_python: str | None = None,
) -> Workload:
    """The workload for ``source`` in ``framework`` (see the module docstring).

    ``mxnet_python``: the MXNet environment's interpreter (default: ``$TRIMS_MXNET_PYTHON``,
    then the evaluation's MXNet virtualenv); Unavailable, naming it, when MXNet is not there.
    """
    framework = parse_framework(framework)
    if not 1 <= batch <= 1024:
        raise ValidationError(f"batch must be between 1 and 1024, got {batch!r}")
    if framework == "torch":
        return TorchWorkload(source, batch, threads)
    if framework == "onnxruntime":
        return OrtWorkload(source, batch, threads)
    from trims.evaluation.tracing.mxnet_workload import MxnetWorkload

    return MxnetWorkload(source, batch, threads, mxnet_python)
