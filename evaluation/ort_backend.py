"""ONNX Runtime backend: turn an ONNX model into a zero-argument callable that runs it once.

Inputs are bound once with IOBinding (random data of the right shape, or arrays the caller
gives), so a timed call is the session run only: no input conversion and no output copy into
NumPy.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trims.errors import ValidationError

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort

log = logging.getLogger(__name__)

OPT_LEVELS = ("disable", "basic", "extended", "all")


@dataclass(frozen=True)
class OrtVariant:
    """One ONNX Runtime configuration (an "algorithm choice" in the Benanza sense)."""

    opt_level: str = "all"
    threads: int = 1

    @property
    def key(self) -> str:
        return f"opt={self.opt_level},threads={self.threads}"

    @classmethod
    def parse(cls, key: str) -> OrtVariant:
        """Inverse of :attr:`key`, e.g. ``opt=extended,threads=2``."""
        fields = dict(part.split("=", 1) for part in key.split(",") if "=" in part)
        level = fields.get("opt", "all")
        if level not in OPT_LEVELS:
            raise ValidationError(f"unknown ORT opt level {level!r}; choose from {OPT_LEVELS}")
        return cls(opt_level=level, threads=int(fields.get("threads", "1")))


def framework_version() -> str:
    import onnxruntime as ort

    return str(ort.__version__)


def _np_dtype(elem_type: int) -> type[np.generic]:
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(elem_type).type


def random_inputs(
    model: onnx.ModelProto, seed: int = 0, skip: Collection[str] = ()
) -> dict[str, np.ndarray]:
    """Random data for every graph input that is not an initializer (nor named in ``skip``).

    Floating-point inputs are uniform on [-1, 1), drawn in single precision: a brick's input
    is an activation of millions of values (ResNet's first stage: 0.8 M), which the kernels
    time alike whatever their distribution, and drawing them normal in double precision took
    about 7 ms of such a brick's setup against 1 ms (a bricks study opens dozens of them,
    each with its own input, where a whole model has one). Integer inputs keep normal
    draws truncated to integers, as before (small, mostly -2..2).
    """
    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name in inits or value.name in skip:
            continue
        tensor = value.type.tensor_type
        shape = tuple(max(d.dim_value, 1) for d in tensor.shape.dim)
        dtype = _np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.floating):
            draw = rng.random(shape, dtype=np.float32)
            draw *= 2
            draw -= 1
            feeds[value.name] = draw.astype(dtype, copy=False)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def session(
    model: onnx.ModelProto,
    variant: OrtVariant,
    name: str,
    weights: Mapping[str, np.ndarray] | None = None,
    profile_prefix: str | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for ``model`` configured per ``variant``.

    Initializers the model marks as external take their data from ``weights`` (see
    :func:`trims.evaluation.submodel.weights`); ONNX Runtime uses those arrays in place, so
    they must outlive the session (the runner's closure keeps them).
    """
    import onnx
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    opts = ort.SessionOptions()
    opts.graph_optimization_level = levels[variant.opt_level]
    opts.intra_op_num_threads = variant.threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    if profile_prefix is not None:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    external = [
        t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    given = weights or {}
    missing = [n for n in external if n not in given]
    if missing:
        raise ValidationError(
            f"model {name!r} leaves initializers {missing[:3]} out of band but no weights were "
            "given for them; pass submodel.weights(ir) along with the model"
        )
    values = [ort.OrtValue.ortvalue_from_numpy(given[n]) for n in external]
    if external:
        opts.add_external_initializers(external, values)
    try:
        sess = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        raise ValidationError(f"model {name!r} does not load in ONNX Runtime: {e}") from e
    # the session reads the external arrays in place: they live exactly as long as it does
    sess._trims_external = values
    return sess


def runner(
    model: onnx.ModelProto,
    variant: OrtVariant,
    name: str,
    weights: Mapping[str, np.ndarray] | None = None,
) -> Callable[[], object]:
    """A callable that runs ``model`` once on bound random inputs.

    ``weights`` gives the data of the initializers the model leaves out of band (see
    :func:`session`) and of any graph input it names (bound in place: :func:`stream_model`).
    """
    return _bound_runner(session(model, variant, name, weights), model, weights)


#: the layout conversions one run of a model made: ``("ReorderInput" | "ReorderOutput", NCHW
#: shape)`` -> how many
Conversions = Counter[tuple[str, tuple[int, ...]]]


def profiled_runner(
    model: onnx.ModelProto,
    variant: OrtVariant,
    name: str,
    weights: Mapping[str, np.ndarray] | None = None,
) -> tuple[Callable[[], object], Conversions]:
    """:func:`runner` plus the layout conversions one run of the model makes.

    With graph optimizations on, ONNX Runtime runs convolutions in its blocked NCHWc layout and
    inserts ``ReorderInput``/``ReorderOutput`` where a tensor enters or leaves an NCHWc region:
    at a model's ends, and inside it wherever an operator that only runs in NCHW (a Reshape, a
    grouped convolution) sits between blocked ones. The session profiles its first run (a
    warm-up run: never timed), then stops profiling (``end_profiling``), so the runs that
    follow cost what :func:`runner`'s do. The profile names every conversion's kernel and the
    NCHW shape it reads (``ReorderInput``) or writes (``ReorderOutput``).
    """
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="trims-ort-profile-") as folder:
        sess = session(model, variant, name, weights, profile_prefix=f"{folder}/p")
        run_once = _bound_runner(sess, model, weights)
        run_once()
        events = json.loads(Path(sess.end_profiling()).read_text())
    found: Conversions = Counter()
    for event in events:
        args = event.get("args", {})
        op = args.get("op_name")
        if event.get("cat") != "Node" or op not in ("ReorderInput", "ReorderOutput"):
            continue
        key = "input_type_shape" if op == "ReorderInput" else "output_type_shape"
        for entry in args.get(key, [])[:1]:
            for dims in entry.values():
                found[(op, tuple(int(d) for d in dims))] += 1
    return run_once, found


def reorder_model(shape: tuple[int, ...]) -> onnx.ModelProto:
    """A tensor of ``shape`` (NCHW) into ONNX Runtime's NCHWc layout and back: the round trip
    a brick boundary adds (:data:`Conversions`), as its own benchmark."""
    from onnx import TensorProto, helper

    domain = "com.microsoft.nchwc"
    graph = helper.make_graph(
        [
            helper.make_node("ReorderInput", ["x"], ["blocked"], domain=domain),
            helper.make_node("ReorderOutput", ["blocked"], ["y"], domain=domain, channels=shape[1]),
        ],
        "reorder",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(domain, 1)]
    )
    model.ir_version = 8
    return model


def stream_model(shapes: Sequence[tuple[int, int]]) -> onnx.ModelProto:
    """One vector-matrix product per weight matrix ``w{i}`` of ``shapes`` (rows x columns), all
    in one run: every weight byte read once, as one inference of a model holding those weights
    reads it, at the rate memory delivers a working set of their size.

    The matrices are graph inputs, to be bound in place to the model's own arrays
    (:func:`runner`'s ``weights``, ``{"w0": array, ...}``): no copy, no prepacking, no page
    faults, so opening it costs next to nothing beside the weights the analysis already holds.
    """
    from onnx import TensorProto, helper

    nodes, inputs, outputs = [], [], []
    for i, (rows, cols) in enumerate(shapes):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, rows]))
        inputs.append(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, [rows, cols]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, cols]))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
    graph = helper.make_graph(nodes, "weight_stream", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _bound_runner(
    sess: ort.InferenceSession,
    model: onnx.ModelProto,
    weights: Mapping[str, np.ndarray] | None = None,
) -> Callable[[], object]:
    import onnxruntime as ort

    binding = sess.io_binding()
    # graph inputs the caller gives are bound to its arrays (the OrtValue keeps them alive);
    # an initializer an older model also lists as an input keeps its own data
    names = {value.name for value in model.graph.input} - {t.name for t in model.graph.initializer}
    given = {name: array for name, array in (weights or {}).items() if name in names}
    feeds = {**random_inputs(model, skip=given), **given}
    for key, value in feeds.items():
        binding.bind_ortvalue_input(key, ort.OrtValue.ortvalue_from_numpy(value))
    for out in sess.get_outputs():
        binding.bind_output(out.name, "cpu")
    binding.synchronize_inputs()

    def run_once() -> object:
        sess.run_with_iobinding(binding)
        return None

    return run_once


def run_outputs(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], name: str
) -> list[np.ndarray]:
    """Run ``model`` once on ``feeds`` and return its outputs (for correctness checks)."""

    sess = session(model, OrtVariant("disable", 1), name)
    return [np.asarray(o) for o in sess.run(None, feeds)]


def empty_model() -> onnx.ModelProto:
    """A one-Identity model on a 1-element tensor: the fixed cost of a session run."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "empty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model
