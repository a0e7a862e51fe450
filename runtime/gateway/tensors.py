"""Open Inference Protocol (KServe V2) tensor encoding: JSON, and Triton's binary extension.

A request is JSON ``{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype", "data"}],
"outputs"?: [{"name", "parameters"?: {"binary_data": bool}}]}``. With the binary extension the
body is that JSON (its length in the ``Inference-Header-Content-Length`` header) followed by the
raw tensors in input order, each input saying ``parameters.binary_data_size``. ``BYTES`` tensors
are strings in JSON and 4-byte little-endian length-prefixed elements in binary.

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


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    #: Requested outputs (None: all) and whether each comes back binary.
    outputs: dict[str, bool] | None
    binary_default: bool


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
        raise RequestError(f"infer request is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise RequestError("infer request must be a JSON object with an 'inputs' list")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise RequestError("infer request needs a non-empty 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        name, array, used = _parse_input(raw, i, binary[offset:])
        if name in inputs:
            raise RequestError(f"input {name!r} appears twice; send each input once")
        inputs[name] = array
        offset += used
    if offset != len(binary):
        raise RequestError(f"{len(binary) - offset} bytes of binary data follow the last input")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError("'parameters' must be an object")
    binary_default = bool(params.get("binary_data_output", False))
    outputs: dict[str, bool] | None = None
    raw_outputs = doc.get("outputs")
    if raw_outputs is not None:
        if not isinstance(raw_outputs, list):
            raise RequestError("'outputs' must be a list of {\"name\": ...} objects")
        outputs = {}
        for out in raw_outputs:
            if not isinstance(out, dict) or not isinstance(out.get("name"), str):
                raise RequestError("each entry of 'outputs' needs a string 'name'")
            p = out.get("parameters") or {}
            outputs[out["name"]] = bool(p.get("binary_data", binary_default))
    request_id = doc.get("id")
    return InferRequest(
        id=str(request_id) if request_id is not None else None,
        inputs=inputs,
        outputs=outputs,
        binary_default=binary_default,
    )


def _parse_input(raw: Any, index: int, binary: memoryview) -> tuple[str, np.ndarray, int]:
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
    count = math.prod(shape)
    params = raw.get("parameters") or {}
    if not isinstance(params, dict):
        raise RequestError(f"input {name!r}: 'parameters' must be an object")
    size = params.get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size < 0 or size > len(binary):
            raise RequestError(
                f"input {name!r}: binary_data_size {size!r} exceeds the {len(binary)} bytes left"
            )
        chunk = binary[:size]
        return name, _from_binary(name, datatype, shape, count, chunk), size
    if "data" not in raw:
        raise RequestError(f"input {name!r} has no 'data' (or binary_data_size parameter)")
    return name, _from_json(name, datatype, shape, count, raw["data"]), 0


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


def _from_binary(
    name: str, datatype: str, shape: list[int], count: int, chunk: memoryview
) -> np.ndarray:
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


def encode_response(
    model: str,
    version: str,
    request: InferRequest,
    outputs: Mapping[str, np.ndarray],
    declared: Sequence[TensorMeta] = (),
) -> tuple[bytes, dict[str, str]]:
    """The response body and headers (binary extension when any output asks for it)."""
    wanted = request.outputs
    if wanted is not None:
        for name in wanted:
            if name not in outputs:
                raise RequestError(
                    f"model {model} has no output {name!r}; its outputs are {', '.join(outputs)}"
                )
    types = {t.name: t.datatype for t in declared}
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array in outputs.items():
        if wanted is not None and name not in wanted:
            continue
        binary = wanted[name] if wanted is not None else request.binary_default
        datatype = types.get(name) or datatype_of(array)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            blob = _to_binary(array, datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _to_json(array, datatype)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    head = json.dumps(doc).encode()
    if not blobs:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }


def _to_json(array: np.ndarray, datatype: str) -> list[Any]:
    flat = array.reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.astype(DTYPES[datatype]).tolist()  # type: ignore[no-any-return]


def _to_binary(array: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        parts: list[bytes] = []
        for v in array.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode()
            parts.append(len(b).to_bytes(4, "little") + b)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=DTYPES[datatype]).tobytes()


def model_metadata(name: str, served: ServedModel) -> dict[str, Any]:
    return {
        "name": name,
        "versions": list(served.versions),
        "platform": served.platform,
        "inputs": [_meta(t) for t in served.inputs],
        "outputs": [_meta(t) for t in served.outputs],
    }


def _meta(t: TensorMeta) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
