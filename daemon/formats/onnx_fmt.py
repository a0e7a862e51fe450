"""ONNX models -> canonical layout: every initializer a tensor, plus the stripped graph.

Each initializer of the main graph (embedded ``raw_data``, typed fields such as
``float_data``, or external data resolved relative to the model's folder) is written into the
layout. The graph itself is stored last, as the uint8 tensor ``__onnx_graph__``: the ModelProto
serialized with each initializer's data externalized::

    data_location = EXTERNAL
    external_data = {location: "__trims__", offset: <offset in the layout>, length: <nbytes>}
    raw_data / typed fields cleared

so an ONNX Runtime adapter can supply the bytes from the mapping
(``SessionOptions.add_external_initializers``) and no weight is ever stored twice. Each
initializer is stripped right after it is written, so the model is never held twice in memory.
Tensors elsewhere in the graph (Constant node attributes, initializers of If/Loop bodies) stay
in the graph; when they use external data it is read and embedded, so the stored graph never
refers to a file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.daemon.formats.writer import LayoutWriter, chunked, mapped
from trims.errors import CorruptModel, PayloadTooLarge, ValidationError
from trims.layout import Manifest, TensorEntry, TensorSpec, check_tensor_count
from trims.protocol import Progress

if TYPE_CHECKING:
    import onnx

GRAPH_TENSOR = "__onnx_graph__"
EXTERNAL_LOCATION = "__trims__"
#: Largest ONNX file parsed: 2 GiB, protobuf's own limit for one message. The whole file is
#: parsed in memory, so this is checked before it is read; bigger models keep their weights
#: in external data files, which are mapped, not parsed.
MAX_MODEL_FILE = 2 << 30

#: onnx.TensorProto.DataType value -> canonical dtype name.
DTYPES: dict[int, str] = {
    1: "float32",
    2: "uint8",
    3: "int8",
    4: "uint16",
    5: "int16",
    6: "int32",
    7: "int64",
    9: "bool",
    10: "float16",
    11: "float64",
    12: "uint32",
    13: "uint64",
    14: "complex64",
    15: "complex128",
    16: "bfloat16",
}
_TYPED_FIELDS = (
    "float_data",
    "int32_data",
    "string_data",
    "int64_data",
    "double_data",
    "uint64_data",
)


def _load(source: Path) -> onnx.ModelProto:
    import onnx
    from google.protobuf.message import DecodeError

    size = source.stat().st_size
    if size > MAX_MODEL_FILE:
        raise PayloadTooLarge(
            f"{source} is {size} bytes, over the limit of {MAX_MODEL_FILE} for one ONNX file "
            "(protobuf's own limit); save the weights as external data "
            "(`onnx.save(model, path, save_as_external_data=True)`)",
            size=size,
            limit=MAX_MODEL_FILE,
        )
    try:
        return onnx.load(str(source), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, UnicodeDecodeError) as e:
        raise CorruptModel(
            f"{source} is not a readable ONNX model (truncated or corrupt?): {e}"
        ) from e


def _spec(source: Path, tensor: onnx.TensorProto) -> TensorSpec:
    import onnx

    if tensor.data_type not in DTYPES:
        type_name = (
            onnx.TensorProto.DataType.Name(tensor.data_type)
            if tensor.data_type in onnx.TensorProto.DataType.values()
            else str(tensor.data_type)
        )
        raise ValidationError(
            f"{source}: initializer {tensor.name!r} has type {type_name}, which trims does not "
            f"support; use one of {sorted(set(DTYPES.values()))}"
        )
    if tensor.HasField("segment"):
        raise ValidationError(f"{source}: initializer {tensor.name!r} is segmented; re-export it")
    if any(d < 0 for d in tensor.dims):
        raise CorruptModel(f"{source}: initializer {tensor.name!r} has negative dims")
    if tensor.name == GRAPH_TENSOR:
        raise ValidationError(f"{source}: initializer name {GRAPH_TENSOR!r} is reserved by trims")
    return TensorSpec(tensor.name, DTYPES[tensor.data_type], tuple(tensor.dims))


class _ExternalFiles:
    """Read-only mappings of the external data files next to a model, opened once each."""

    def __init__(self, source: Path, stack: contextlib.ExitStack) -> None:
        self._source = source
        self._base = source.parent.resolve()
        self._stack = stack
        self._views: dict[Path, memoryview] = {}

    def view(self, name: str, location: str) -> memoryview:
        path = (self._base / location).resolve()
        if os.path.isabs(location) or not path.is_relative_to(self._base):
            raise ValidationError(
                f"{self._source}: initializer {name!r} points outside the model's folder "
                f"({location!r}); external data must sit beside the model"
            )
        if path not in self._views:
            try:
                f = self._stack.enter_context(open(path, "rb"))  # noqa: SIM115
            except FileNotFoundError as e:
                raise CorruptModel(
                    f"{self._source}: external data file {location!r} of initializer {name!r} "
                    "is missing; copy it next to the model"
                ) from e
            self._views[path] = self._stack.enter_context(mapped(f))
        return self._views[path]


def _external_chunks(
    source: Path, tensor: onnx.TensorProto, spec: TensorSpec, files: _ExternalFiles
) -> Iterable[memoryview]:
    info = {e.key: e.value for e in tensor.external_data}
    if "location" not in info:
        raise CorruptModel(
            f"{source}: initializer {tensor.name!r} has external data without location"
        )
    try:
        offset = int(info.get("offset", "0"))
        length = int(info.get("length", str(spec.nbytes)))
    except ValueError as e:
        raise CorruptModel(f"{source}: initializer {tensor.name!r} has a bad offset/length") from e
    if length != spec.nbytes or offset < 0:
        raise CorruptModel(
            f"{source}: initializer {tensor.name!r} has {length} bytes of external data at "
            f"offset {offset}; its shape needs {spec.nbytes}"
        )
    view = files.view(tensor.name, info["location"])
    if offset + length > len(view):
        raise CorruptModel(
            f"{source}: external data {info['location']!r} of initializer {tensor.name!r} ends "
            f"at byte {offset + length} but the file has {len(view)}: it is truncated"
        )
    chunks: Iterable[memoryview] = chunked(view[offset : offset + length])
    return chunks


def _embedded_chunks(source: Path, tensor: onnx.TensorProto, spec: TensorSpec) -> list[Any]:
    if tensor.HasField("raw_data"):
        return [tensor.raw_data]
    import numpy as np
    from onnx import numpy_helper

    try:
        array = numpy_helper.to_array(tensor)
    except (ValueError, TypeError) as e:
        raise CorruptModel(f"{source}: initializer {tensor.name!r} is malformed: {e}") from e
    data = np.ascontiguousarray(array).tobytes()
    if len(data) != spec.nbytes:
        raise CorruptModel(
            f"{source}: initializer {tensor.name!r} holds {len(data)} bytes; its shape needs "
            f"{spec.nbytes}"
        )
    return [data]


def _externalize(tensor: onnx.TensorProto, entry: TensorEntry) -> None:
    import onnx

    tensor.ClearField("raw_data")
    for field in _TYPED_FIELDS:
        tensor.ClearField(field)
    del tensor.external_data[:]
    for key, value in (
        ("location", EXTERNAL_LOCATION),
        ("offset", str(entry.offset)),
        ("length", str(entry.nbytes)),
    ):
        item = tensor.external_data.add()
        item.key, item.value = key, value
    tensor.data_location = onnx.TensorProto.EXTERNAL


def _nested_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Tensors held by node attributes and subgraphs (not the graph's own initializers)."""
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sub in [attr.g] if attr.HasField("g") else []:
                yield from sub.initializer
                yield from _nested_tensors(sub)
            for sub in attr.graphs:
                yield from sub.initializer
                yield from _nested_tensors(sub)


def external_locations(source: Path) -> list[str]:
    """The external data files the model at ``source`` names, each once, in order.

    Each is a relative path inside the model's folder (``weights.bin``, ``data/part1``);
    anything else (absolute, ``..``, backslashes) is refused here, before anything is fetched.
    """
    import posixpath

    import onnx

    model = _load(source)
    out: list[str] = []
    for tensor in [*model.graph.initializer, *_nested_tensors(model.graph)]:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        if (
            not location
            or "\\" in location
            or "\0" in location
            or location == "."
            or location.startswith("/")
            or posixpath.normpath(location) != location
            or location.split("/")[0] == ".."
        ):
            raise ValidationError(
                f"{source}: initializer {tensor.name!r} names external data {location!r}; it "
                "must be a relative path inside the model's folder"
            )
        if location not in out:
            out.append(location)
    return out


def _embed(source: Path, tensor: onnx.TensorProto, files: _ExternalFiles) -> None:
    """Move a nested tensor's external data into the graph itself."""
    import onnx

    spec = _spec(source, tensor)
    data = b"".join(bytes(c) for c in _external_chunks(source, tensor, spec, files))
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


def convert_onnx(
    source: Path, dest: Path, *, name: str, version: str, progress: Progress | None
) -> Manifest:
    import onnx

    model = _load(source)
    initializers = list(model.graph.initializer)
    check_tensor_count(len(initializers) + 1, f"{source} (its initializers and the graph)")
    specs = [_spec(source, t) for t in initializers]
    total = sum(s.nbytes for s in specs)
    with (
        contextlib.ExitStack() as stack,
        LayoutWriter(dest, source=source, progress=progress, total_hint=total) as writer,
    ):
        files = _ExternalFiles(source, stack)
        for nested in _nested_tensors(model.graph):
            if nested.data_location == onnx.TensorProto.EXTERNAL:
                _embed(source, nested, files)
        for tensor, spec in zip(initializers, specs, strict=True):
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                chunks: Iterable[Any] = _external_chunks(source, tensor, spec, files)
            else:
                chunks = _embedded_chunks(source, tensor, spec)
            _externalize(tensor, writer.add(spec, chunks))
        graph = model.SerializeToString()
        writer.add(TensorSpec(GRAPH_TENSOR, "uint8", (len(graph),)), [graph])
        manifest: Manifest = writer.finish(
            name=name,
            version=version,
            framework="onnx",
            metadata={
                "source_format": "onnx",
                "onnx_graph": GRAPH_TENSOR,
                "onnx_opset": ",".join(
                    f"{o.domain or 'ai.onnx'}:{o.version}" for o in model.opset_import
                ),
            },
        )
    return manifest
