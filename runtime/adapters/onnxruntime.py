"""ONNX Runtime adapter: an ``InferenceSession`` whose initializers live in the model buffer.

The store keeps an ONNX model as its initializers plus the graph, serialised with every
initializer externalised to the file name ``__trims__`` at its offset in the buffer (tensor
``__onnx_graph__``). Each initializer becomes an ``OrtValue`` over the mapping (no copy),
except tiny ones (shape tensors: ONNX shape inference must read them while ORT loads the graph),
which are copied back into the graph.

Note [Two ways in, both needed]
-------------------------------
ORT 1.32 offers two session options, and each alone falls short:

* ``add_external_initializers`` resolves the graph's external data from OrtValues, so graph
  optimizers (Conv+BN fusion, NCHWc weight reordering, constant folding) see the real weights,
  but session state then copies every initializer into ORT's own buffers;
* ``add_initializer`` makes session state use the OrtValue as is, for the session's life, but
  alone it cannot satisfy the graph's external-data references.

Giving every initializer both ways yields a session that optimizes on the real weights and
runs on the shared mapping: measured on a 108 MB model, session creation allocates ~5 MB of
private memory instead of 110 MB, with bit-identical outputs. Weights an optimizer rewrites
(fused or reordered) are, necessarily, private copies.

Note [Pre-packing]
------------------
By default ORT re-packs MatMul/Gemm weights into its own layout at session creation: faster
kernels, but a private copy of those weights. ``prepack=False`` sets
``session.disable_prepacking`` so the session holds no copy of them; results are then
bit-identical to a normally loaded model with the same option.

Note [Profiled twins]
---------------------
ONNX Runtime profiles a session only if profiling was on when the session was built, and
``end_profiling`` ends it for good. A handler builds its session in ``init``, long before a
traced request, and profiling it from the start would slow every call. So while a traced call
is active (:mod:`trims.tracing.active`, set by the worker around a call traced at ``layer`` or
deeper), :meth:`SharedSession.run` runs on a *twin*: a session built from the same graph, with
the same options (profiling switched on for its creation only) over the same ``OrtValue``
initializers, so the twin maps the same weights and copies what the first session copied
(weights an optimizer rewrote, and pre-packed MatMul/Gemm weights unless ``prepack=False``),
nothing more; the copies go with the twin. One twin serves every run of the model in the
traced call; when the call ends, its node events become layer spans
(:func:`trims.tracing.sources.onnxruntime.collect`, which also removes the profile file) and
the twin is dropped. Its creation is a ``model`` span of its own (``profiled session
<model>``), so the time it takes is seen and not counted in a layer: measured 5-11 ms for
SqueezeNet (5 MB of weights) and 90-130 ms for ResNet-50 (102 MB) on a 2-core machine; the
twin's private copies of rewritten and pre-packed weights were 12 MiB for SqueezeNet (none
with ``prepack=False``) and ~109 MiB for ResNet-50 (18 MiB with ``prepack=False``).
An untraced call pays one ContextVar lookup. Sessions a handler builds itself with
``onnxruntime.InferenceSession`` are not seen: use ``model.onnx_session()``.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.errors import CorruptModel, ValidationError
from trims.runtime.adapters import HostWeights
from trims.runtime.adapters import numpy as numpy_adapter
from trims.tracing.active import ActiveTrace
from trims.tracing.active import current as current_trace
from trims.tracing.levels import Level
from trims.tracing.sources import Recording
from trims.tracing.spans import Span

if TYPE_CHECKING:
    import onnxruntime

log = logging.getLogger(__name__)

GRAPH_TENSOR = "__onnx_graph__"
#: Initializers up to this size are copied back into the graph (shape inference reads them).
INLINE_BYTES = 1024
#: onnx.TensorProto.BFLOAT16: NumPy carries bfloat16 as uint16, ORT needs the real type.
_ONNX_BFLOAT16 = 16
#: Held while a session's options are switched to profiling for a twin's creation (options
#: may be shared by sessions; see Note [Profiled twins]).
_OPTIONS_LOCK = threading.Lock()


def graph_bytes(weights: HostWeights) -> bytes:
    """The serialized graph stored with the model (small: its initializers are external)."""
    manifest = weights.manifest
    name = manifest.metadata.get("onnx_graph", GRAPH_TENSOR)
    try:
        entry = manifest.tensor(name)
    except KeyError:
        raise ValidationError(
            f"model {manifest.name} has no ONNX graph (tensor {name!r}); it was added from "
            f"{manifest.framework!r}, not ONNX: use the torch or numpy adapter"
        ) from None
    return bytes(weights.buffer()[entry.offset : entry.offset + entry.nbytes])


def model_proto(weights: HostWeights) -> Any:
    """The stored graph as an ``onnx.ModelProto`` with each external initializer's bytes copied
    in from the mapping (ValidationError when the model is not ONNX)."""
    import numpy as np
    import onnx

    from trims.runtime.adapters import numpy as numpy_adapter

    proto = onnx.ModelProto()
    proto.ParseFromString(graph_bytes(weights))
    arrays = numpy_adapter.tensors(weights.buffer(), weights.manifest)
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = np.ascontiguousarray(arrays[tensor.name]).tobytes()
    return proto


def inline_small_initializers(graph: bytes, weights: HostWeights) -> tuple[bytes, frozenset[str]]:
    """The graph with initializers of at most ``INLINE_BYTES`` copied back into it.

    ONNX shape inference, which ORT runs while loading a graph, must read the values of shape
    tensors (the second input of Reshape, Expand, ...) and cannot read external data. Those are
    tiny, so they go back into the graph; every larger initializer stays shared. Returns the
    new graph and the names inlined.
    """
    import onnx

    model = onnx.ModelProto()
    try:
        model.ParseFromString(graph)
    except Exception as e:
        raise CorruptModel(f"model {weights.manifest.name}: the stored ONNX graph: {e}") from e
    buffer = weights.buffer()
    stored = {t.name for t in weights.manifest.tensors}
    inlined: set[str] = set()
    for init in model.graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL or init.name not in stored:
            continue
        entry = weights.manifest.tensor(init.name)
        if entry.nbytes > INLINE_BYTES:
            continue
        init.raw_data = bytes(buffer[entry.offset : entry.offset + entry.nbytes])
        del init.external_data[:]
        init.data_location = onnx.TensorProto.DEFAULT
        inlined.add(init.name)
    return (model.SerializeToString() if inlined else graph), frozenset(inlined)


def ort_values(
    weights: HostWeights, skip: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    """One ``OrtValue`` per initializer (except ``skip``), each over the buffer (no copy)."""
    import onnxruntime as ort

    graph = weights.manifest.metadata.get("onnx_graph", GRAPH_TENSOR)
    buffer = weights.buffer()
    out: dict[str, Any] = {}
    for t in weights.manifest.tensors:
        if t.name == graph or t.name in skip:
            continue
        arr = numpy_adapter.tensor_view(buffer, t)
        if t.dtype == "bfloat16":
            out[t.name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, _ONNX_BFLOAT16)
        else:
            out[t.name] = ort.OrtValue.ortvalue_from_numpy(arr)
    return out


class SharedSession:
    """An ``InferenceSession`` plus the ``OrtValue`` objects it reads its weights from.

    ORT does not own supplied initializers, so they must outlive the session: keep this object
    (not just ``.session``) alive while running. Attribute access falls through to the session.
    :meth:`run` profiles when a traced call is active (Note [Profiled twins]).
    """

    def __init__(
        self,
        session: onnxruntime.InferenceSession,
        values: dict[str, Any],
        *,
        model: str = "onnx",
        source: bytes | str | None = None,
        options: onnxruntime.SessionOptions | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ) -> None:
        self.session = session
        self._values = values
        self.model = model
        #: What the session was built from (graph bytes or a path) and with: a profiled twin
        #: is built from the same; None: no twin (unknown source, or a session its maker
        #: profiles itself, whose profile a twin would leave empty).
        self._source = None if options is not None and options.enable_profiling else source
        self._options = options
        self._providers = list(providers)

    def run(self, output_names: Sequence[str] | None, feed: dict[str, Any], **kw: Any) -> Any:
        active = current_trace()
        if active is None:
            return self.session.run(output_names, feed, **kw)
        return self._run_traced(active, output_names, feed, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    def __str__(self) -> str:
        return f"onnxruntime session of model {self.model}"

    def _run_traced(
        self,
        active: ActiveTrace,
        output_names: Sequence[str] | None,
        feed: dict[str, Any],
        **kw: Any,
    ) -> Any:
        """:meth:`run` on this call's profiled twin (Note [Profiled twins])."""
        twin = None
        if active.level >= Level.LAYER and self._source is not None:
            twin = active.resource(
                self,  # one twin per session and call, even for two sessions of one model
                lambda: self._profiled_twin(active),
                lambda t: t.collect(active),
            )
        return (twin.session if twin is not None else self.session).run(output_names, feed, **kw)

    def _profiled_twin(self, active: ActiveTrace) -> _Twin:
        """A session like this one that profiles at ``active.level``, over the same initializers.

        The options are the ones this session was built with (they hold the initializers):
        profiling is switched on for the twin's creation only, under a lock, since ORT copies
        the options into each session it builds.
        """
        import onnxruntime as ort

        from trims.tracing.sources.onnxruntime import session_options

        assert self._source is not None
        thread = threading.current_thread().name
        start = time.time_ns()
        options = self._options if self._options is not None else ort.SessionOptions()
        with _OPTIONS_LOCK:
            saved = (options.enable_profiling, options.profile_file_prefix)
            session_options(active.level, base=options)
            profile_dir = Path(options.profile_file_prefix).parent
            try:
                twin = ort.InferenceSession(self._source, options, providers=self._providers)
            except BaseException:
                shutil.rmtree(profile_dir, ignore_errors=True)
                raise
            finally:
                options.enable_profiling, options.profile_file_prefix = saved
        setup = Span(
            f"profiled session {self.model}",
            Level.MODEL,
            start,
            time.time_ns(),
            (active.process, thread),
            attributes={"framework": "onnxruntime", "model": self.model, "kind": "profiler"},
        )
        log.debug("model %s: profiled onnxruntime twin for a traced call", self.model)
        return _Twin(twin, setup)


class _Twin:
    """A profiled twin session and the span of its creation, until its profile is collected."""

    def __init__(self, session: onnxruntime.InferenceSession, setup: Span) -> None:
        self.session = session
        self.setup = setup

    def collect(self, active: ActiveTrace) -> Recording:
        from trims.tracing.sources.onnxruntime import collect

        recording = collect(self.session, process=active.process, level=active.level)
        recording.spans.insert(0, self.setup)
        return recording


def session(
    weights: HostWeights,
    *,
    providers: Sequence[str] | None = None,
    sess_options: onnxruntime.SessionOptions | None = None,
    prepack: bool = True,
) -> SharedSession:
    """An inference session over the mapped weights (see Notes above)."""
    import onnxruntime as ort

    options = sess_options or ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    graph, inlined = inline_small_initializers(graph_bytes(weights), weights)
    values = ort_values(weights, skip=inlined)
    # ORT >= 1.15; see Note [Two ways in, both needed]
    if hasattr(options, "add_external_initializers"):
        options.add_external_initializers(list(values), list(values.values()))
    for name, value in values.items():
        options.add_initializer(name, value)
    try:
        sess = ort.InferenceSession(
            graph, options, providers=list(providers or ["CPUExecutionProvider"])
        )
    except Exception as e:
        if type(e).__module__.startswith("onnxruntime"):
            raise CorruptModel(
                f"ONNX Runtime cannot build model {weights.manifest.name} from the store: {e}; "
                "re-add it with `trims models add`"
            ) from e
        raise
    log.debug(
        "model %s: onnxruntime session over %d shared initializers",
        weights.manifest.name,
        len(values),
    )
    return SharedSession(
        sess,
        values,
        model=weights.manifest.name,
        source=graph,
        options=options,
        providers=list(providers or ["CPUExecutionProvider"]),
    )
