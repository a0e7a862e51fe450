"""Open Inference Protocol (KServe V2) tensor encoding: JSON, and Triton's binary extension.

A request is JSON ``{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype", "data"}],
"outputs"?: [{"name", "parameters"?: {"binary_data": bool}}]}``. With the binary extension the
body is that JSON (its length in the ``Inference-Header-Content-Length`` header) followed by the
raw tensors in input order, each input saying ``parameters.binary_data_size``. ``BYTES`` tensors
are strings in JSON and 4-byte little-endian length-prefixed elements in binary. An input or a
requested output may instead name a registered shared-memory region
(``parameters.shared_memory_region``, ``shared_memory_byte_size``, ``shared_memory_offset``):
this module parses the reference, :mod:`trims.runtime.gateway.oip_shm` reads and writes it.

JSON carries what JSON can: a float output holding NaN or Infinity, or a BYTES output that is
not UTF-8 text, sent as JSON is refused (400, naming the output and the binary extension that
carries it) rather than written as bare ``NaN`` (not JSON) or with U+FFFD replacements.

Every check raises :class:`RequestError` (400) naming the tensor and what to fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trims.errors import RequestError
from trims.oip import DTYPES, HEADER_LENGTH
from trims.runtime.functions.spec import ServedModel, TensorMeta

_BY_KIND = {(d.kind, d.itemsize): n for n, d in DTYPES.items() if n != "BYTES"}


#: The request ``id`` is echoed with its JSON type (the spec says string; numbers are common).
RequestId = str | int | float


@dataclass(frozen=True)
class ShmRef:
    """A tensor's bytes by reference: ``byte_size`` bytes at ``offset`` in a registered region."""

    region: str
    offset: int
    byte_size: int

    def parameters(self) -> dict[str, Any]:
        """The Triton parameters naming this reference (offset only when not 0, as Triton)."""
        out: dict[str, Any] = {
            "shared_memory_region": self.region,
            "shared_memory_byte_size": self.byte_size,
        }
        if self.offset:
            out["shared_memory_offset"] = self.offset
        return out


@dataclass(frozen=True)
class ShmInput:
    """An input whose data is in shared memory; decoded by :func:`decode_tensor` once read."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    ref: ShmRef


@dataclass(frozen=True)
class OutputRequest:
    """How one requested output comes back: binary or JSON, or into shared memory."""

    binary: bool
    shm: ShmRef | None = None


@dataclass(frozen=True)
class InferRequest:
    id: RequestId | None
    inputs: dict[str, np.ndarray]
    #: Requested outputs (None: all, each binary when ``binary_default``).
    outputs: dict[str, OutputRequest] | None
    binary_default: bool
    #: Inputs by reference into shared memory, in request order.
    shm_inputs: tuple[ShmInput, ...] = ()


def datatype_of(array: np.ndarray) -> str:
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    name = _BY_KIND.get((array.dtype.kind, array.dtype.itemsize))
    if name is not None:
        return name
    raise RequestError(f"output dtype {array.dtype} has no Open Inference Protocol datatype")


def parse_request(body: bytes, header_length: str | None) -> InferRequest:
    """Decode an infer request body (JSON, or JSON + binary tensors)."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise RequestError(
                f"{HEADER_LENGTH} must be an integer, got {header_length!r}"
            ) from None
        if not 0 < n <= len(body):
            raise RequestError(f"{HEADER_LENGTH} {n} does not fit the {len(body)}-byte body")
        head, binary = body[:n], memoryview(body)[n:]
    else:
        head, binary = body, memoryview(b"")
    try:
        doc = json.loads(head)
    except ValueError as e:
        if header_length is None:
            message = _missing_header(body) or f"infer request is not valid JSON: {e}"
            raise RequestError(message) from None
        raise RequestError(f"infer request is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RequestError("infer request must be a JSON object with an 'inputs' list")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise RequestError("infer request needs a non-empty 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    shm_inputs: list[ShmInput] = []
    offset = 0
    for i, raw in enumerate(raw_inputs):
        parsed, used = _parse_input(raw, i, binary[offset:], header_length is not None)
        name = parsed.name if isinstance(parsed, ShmInput) else parsed[0]
        if name in inputs or any(s.name == name for s in shm_inputs):
            raise RequestError(f"input {name!r} appears twice; send each input once")
        if isinstance(parsed, ShmInput):
            shm_inputs.append(parsed)
        else:
            inputs[name] = parsed[1]
        offset += used
    if offset != len(binary):
        raise RequestError(f"{len(binary) - offset} bytes of binary data follow the last input")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    binary_default = bool(params.get("binary_data_output", False))
    outputs: dict[str, OutputRequest] | None = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise RequestError("'outputs' must be a list of {\"name\": ...} objects")
        outputs = {}
        for out in raw_outputs:
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise RequestError("each entry of 'outputs' needs a string 'name'")
            p = out.get("parameters") or {}
            if not isinstance(p, dict):
                raise RequestError(f"output {out['name']!r}: 'parameters' must be an object")
            outputs[out["name"]] = OutputRequest(
                binary=bool(p.get("binary_data", binary_default)),
                shm=_shm_ref(f"output {out['name']!r}", p),
            )
    return InferRequest(
        id=_request_id(doc.get("id")),
        inputs=inputs,
        outputs=outputs,
        binary_default=binary_default,
        shm_inputs=tuple(shm_inputs),
    )


def _request_id(value: Any) -> RequestId | None:
    if value is None:
        return None
    if isinstance(value, str | int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise RequestError(f"'id' must be a string (or a number), got {json.dumps(value)[:40]}")


def _missing_header(body: bytes) -> str | None:
    """The message for a binary request sent without its header; None when it is not one."""
    text = body.decode("utf-8", "surrogateescape")
    try:
        doc, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if not isinstance(doc, dict) or end >= len(text):
        return None
    json_bytes = len(text[:end].encode("utf-8", "surrogateescape"))
    return (
        f"the body is {json_bytes} bytes of JSON followed by {len(body) - json_bytes} bytes of "
        f"binary tensor data, but has no {HEADER_LENGTH} header: send "
        f"'{HEADER_LENGTH}: {json_bytes}' with it (the binary tensor extension)"
    )


def _shm_ref(what: str, params: Mapping[str, Any]) -> ShmRef | None:
    region = params.get("shared_memory_region")
    if region is None:
        for key in ("shared_memory_byte_size", "shared_memory_offset"):
            if key in params:
                raise RequestError(f"{what}: {key} needs shared_memory_region too")
        return None
    if not isinstance(region, str) or not region:
        raise RequestError(f"{what}: shared_memory_region must be a region name")
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise RequestError(f"{what}: {key} must be a non-negative integer, got {value!r}")
    assert isinstance(size, int) and isinstance(offset, int)
    return ShmRef(region, offset, size)


def _parse_input(
    raw: Any, index: int, binary: memoryview, has_header: bool
) -> tuple[tuple[str, np.ndarray] | ShmInput, int]:
    if not isinstance(raw, dict):
        raise RequestError(f"inputs[{index}] must be an object with name, shape, datatype, data")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"inputs[{index}] needs a non-empty string 'name'")
    shape = raw.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise RequestError(f"input {name!r}: 'shape' must be a list of non-negative integers")
    datatype = raw.get("datatype")
    if datatype not in DTYPES:
        raise RequestError(
            f"input {name!r}: datatype {datatype!r} is not one of {', '.join(DTYPES)}"
        )
    params = raw.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError(f"input {name!r}: 'parameters' must be an object")
    size = params.get("binary_data_size")
    ref = _shm_ref(f"input {name!r}", params)
    sources = [
        what
        for what, present in (
            ("'data'", "data" in raw),
            ("binary_data_size", size is not None),
            ("shared_memory_region", ref is not None),
        )
        if present
    ]
    if len(sources) > 1:
        raise RequestError(
            f"input {name!r} has both {' and '.join(sources)}: send its data one way only"
        )
    if ref is not None:
        return ShmInput(name, datatype, tuple(shape), ref), 0
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RequestError(f"input {name!r}: binary_data_size must be a non-negative integer")
        if size > len(binary):
            if not has_header:
                raise RequestError(
                    f"input {name!r} has binary_data_size {size}, but the request has no "
                    f"binary part: send the JSON's length in the {HEADER_LENGTH} header and "
                    "the tensors after it"
                )
            raise RequestError(
                f"input {name!r}: binary_data_size {size} exceeds the {len(binary)} bytes left"
            )
        return (name, decode_tensor(name, datatype, shape, binary[:size])), size
    if "data" not in raw:
        raise RequestError(
            f"input {name!r} has no 'data' (or binary_data_size, or shared_memory_region parameter)"
        )
    return (name, _from_json(name, datatype, shape, math.prod(shape), raw["data"])), 0


def _flatten(data: Any, out: list[Any]) -> None:
    if isinstance(data, list):
        for item in data:
            _flatten(item, out)
    else:
        out.append(data)


def _from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    flat: list[Any] = []
    _flatten(data, flat)
    if len(flat) != count:
        raise RequestError(
            f"input {name!r}: shape {shape} needs {count} elements, 'data' has {len(flat)}"
        )
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise RequestError(f"input {name!r}: BYTES data must be strings")
        array = np.empty(count, dtype=object)
        array[:] = [v.encode() for v in flat]
        return array.reshape(shape)
    if datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise RequestError(f"input {name!r}: BOOL data must be true/false")
    elif datatype.startswith(("INT", "UINT")):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise RequestError(f"input {name!r}: {datatype} data must be integers")
    elif not all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat):
        raise RequestError(f"input {name!r}: {datatype} data must be numbers")
    try:
        array = np.array(flat, dtype=DTYPES[datatype])
    except (OverflowError, ValueError) as e:
        raise RequestError(f"input {name!r}: values do not fit {datatype}: {e}") from None
    if datatype.startswith(("INT", "UINT")) and flat:
        info = np.iinfo(DTYPES[datatype])
        if min(flat) < info.min or max(flat) > info.max:
            raise RequestError(f"input {name!r}: values out of range for {datatype}")
    return array.reshape(shape)


def decode_tensor(
    name: str, datatype: str, shape: Sequence[int], chunk: memoryview | bytes
) -> np.ndarray:
    """A tensor from its binary form (binary extension or shared memory); 400 when it does not
    hold exactly ``shape`` of ``datatype``. The array may view ``chunk``."""
    shape = list(shape)
    count = math.prod(shape)
    if datatype == "BYTES":
        items: list[bytes] = []
        pos = 0
        raw = bytes(chunk)
        while pos < len(raw):
            if pos + 4 > len(raw):
                raise RequestError(f"input {name!r}: truncated BYTES element length")
            n = int.from_bytes(raw[pos : pos + 4], "little")
            pos += 4
            if pos + n > len(raw):
                raise RequestError(f"input {name!r}: BYTES element overruns its data")
            items.append(raw[pos : pos + n])
            pos += n
        if len(items) != count:
            raise RequestError(
                f"input {name!r}: shape {shape} needs {count} elements, got {len(items)}"
            )
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(shape)
    dtype = DTYPES[datatype]
    if len(chunk) != count * dtype.itemsize:
        raise RequestError(
            f"input {name!r}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"got {len(chunk)}"
        )
    return np.frombuffer(chunk, dtype=dtype).reshape(shape)


def check_inputs(model: str, served: ServedModel, inputs: Mapping[str, np.ndarray]) -> None:
    """Inputs must match the declared names, datatypes and shapes (-1 = any size)."""
    declared = {t.name: t for t in served.inputs}
    for name in inputs:
        if name not in declared:
            raise RequestError(
                f"model {model} has no input {name!r}; its inputs are {', '.join(declared)}"
            )
    for name, meta in declared.items():
        if name not in inputs:
            raise RequestError(f"model {model} needs input {name!r} ({_describe(meta)})")
        array = inputs[name]
        got = datatype_of(array)
        if got != meta.datatype:
            raise RequestError(f"input {name!r} must be {meta.datatype}, got {got}")
        if len(array.shape) != len(meta.shape) or any(
            want not in (-1, have) for want, have in zip(meta.shape, array.shape, strict=True)
        ):
            raise RequestError(
                f"input {name!r} must have shape {list(meta.shape)} (-1 = any), "
                f"got {list(array.shape)}"
            )


def _describe(meta: TensorMeta) -> str:
    return f"{meta.datatype} {list(meta.shape)}"


def output_datatype(name: str, array: np.ndarray, declared: Sequence[TensorMeta]) -> str:
    """An output's datatype: the declared one, else the one its dtype maps to."""
    for t in declared:
        if t.name == name:
            return t.datatype
    return datatype_of(array)


def encode_response(
    model: str,
    version: str,
    request: InferRequest,
    outputs: Mapping[str, np.ndarray],
    declared: Sequence[TensorMeta] = (),
    in_shm: Mapping[str, dict[str, Any]] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers (binary extension when any output asks for it).

    ``in_shm``: outputs already written into shared memory, with the parameters their entries
    carry instead of data.
    """
    check_outputs(model, request, outputs)
    wanted = request.outputs
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array in outputs.items():
        if wanted is not None and name not in wanted:
            continue
        binary = wanted[name].binary if wanted is not None else request.binary_default
        datatype = output_datatype(name, array, declared)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if in_shm is not None and name in in_shm:
            entry["parameters"] = in_shm[name]
        elif binary:
            blob = encode_tensor(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _to_json(name, array, datatype)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    head = json.dumps(doc, allow_nan=False).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }


def check_outputs(model: str, request: InferRequest, outputs: Mapping[str, np.ndarray]) -> None:
    """Every requested output must be one the model produced."""
    if request.outputs is None:
        return
    for name in request.outputs:
        if name not in outputs:
            raise RequestError(
                f"model {model} has no output {name!r}; its outputs are {', '.join(outputs)}"
            )


def _to_json(name: str, array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        out: list[str] = []
        for i, v in enumerate(flat):
            try:
                out.append(v.decode("utf-8") if isinstance(v, bytes) else str(v))
            except UnicodeDecodeError:
                raise RequestError(
                    f"output {name!r} element {i} is not UTF-8 text, which JSON cannot carry: "
                    + _binary_hint(name)
                ) from None
        return out
    values = flat.astype(DTYPES[datatype])
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        raise RequestError(
            f"output {name!r} holds NaN or Infinity, which JSON cannot carry: " + _binary_hint(name)
        )
    return values.tolist()


def _binary_hint(output: str) -> str:
    wanted = {"outputs": [{"name": output, "parameters": {"binary_data": True}}]}
    return f"ask for it with the binary tensor extension ({json.dumps(wanted)[1:-1]})"


def encode_tensor(array: np.ndarray, datatype: str) -> bytes:
    """A tensor's binary form (binary extension, shared memory): raw little-endian elements,
    BYTES elements each prefixed by its 4-byte little-endian length."""
    if datatype == "BYTES":
        parts: list[bytes] = []
        for v in array.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode()
            parts.append(len(b).to_bytes(4, "little") + b)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=DTYPES[datatype]).tobytes()


def model_metadata(name: str, served: ServedModel, platform: str) -> dict[str, Any]:
    return {
        "name": name,
        "versions": list(served.versions),
        "platform": platform,
        "inputs": [_meta(t) for t in served.inputs],
        "outputs": [_meta(t) for t in served.outputs],
    }


def _meta(t: TensorMeta) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
