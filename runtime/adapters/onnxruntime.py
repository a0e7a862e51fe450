"""ONNX Runtime adapter: an ``InferenceSession`` whose initializers live in the model buffer.

The store keeps an ONNX model as its initializers plus the graph, serialised with every
initializer externalised to the file name ``__trims__`` at its offset in the buffer (tensor
``__onnx_graph__``). We give ONNX Runtime each initializer as an ``OrtValue`` over the mapping
with ``SessionOptions.add_initializer``; ORT then uses that memory as is, for the session's
whole life, instead of reading the external file.

Note [The placeholder file]
---------------------------
ORT checks that every external-data file a graph names exists next to the model before it
applies supplied initializers, and it refuses in-memory address markers in a model. So the
graph is written to a private temporary directory beside a *sparse* ``__trims__`` file of the
buffer's size (no disk blocks, never read: every initializer is supplied), the session is
created from that path and the directory is removed at once.

Note [Pre-packing]
------------------
By default ORT re-packs MatMul/Gemm weights into its own layout at session creation: faster
kernels, but a private copy of those weights. ``prepack=False`` disables that
(``session.disable_prepacking``) so the session holds no copy at all; results are then
bit-identical to a normally loaded model with the same option, and may differ in the last bit
from one that pre-packs.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.runtime.adapters import HostWeights
from trims.runtime.adapters import numpy as numpy_adapter

from trims.errors import CorruptModel, ValidationError

if TYPE_CHECKING:
    import onnxruntime

log = logging.getLogger(__name__)

GRAPH_TENSOR = "__onnx_graph__"
EXTERNAL_FILE = "__trims__"
#: onnx.TensorProto.BFLOAT16: NumPy carries bfloat16 as uint16, ORT needs the real type.
_ONNX_BFLOAT16 = 16


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


def ort_values(weights: HostWeights) -> dict[str, Any]:
    """One ``OrtValue`` per initializer, each over the buffer (no copy)."""
    import onnxruntime as ort

    graph = weights.manifest.metadata.get("onnx_graph", GRAPH_TENSOR)
    buffer = weights.buffer()
    out: dict[str, Any] = {}
    for t in weights.manifest.tensors:
        if t.name == graph:
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
    """

    def __init__(self, session: onnxruntime.InferenceSession, values: dict[str, Any]) -> None:
        self.session = session
        self._values = values

    def run(self, output_names: Sequence[str] | None, feed: dict[str, Any], **kw: Any) -> Any:
        return self.session.run(output_names, feed, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


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
    values = ort_values(weights)
    for name, value in values.items():
        options.add_initializer(name, value)
    graph = graph_bytes(weights)
    tmp = Path(tempfile.mkdtemp(prefix="trims-onnx-"))
    try:
        (tmp / "model.onnx").write_bytes(graph)
        with open(tmp / EXTERNAL_FILE, "wb") as placeholder:
            placeholder.truncate(weights.manifest.total_bytes)
        sess = ort.InferenceSession(
            str(tmp / "model.onnx"), options, providers=list(providers or ["CPUExecutionProvider"])
        )
    except Exception as e:
        if type(e).__module__.startswith("onnxruntime"):
            raise CorruptModel(
                f"ONNX Runtime cannot build model {weights.manifest.name} from the store: {e}; "
                "re-add it with `trims models add`"
            ) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.debug(
        "model %s: onnxruntime session over %d shared initializers",
        weights.manifest.name,
        len(values),
    )
    return SharedSession(sess, values)
