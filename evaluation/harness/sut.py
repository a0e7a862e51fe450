"""Systems under test: one model behind ``predict(batch) -> outputs``, in process or over HTTP.

Every system under test answers the same two methods (:class:`SystemUnderTest`):
``predict(batch)`` takes a list of samples and returns one output per sample, in order, and
``close()`` frees what it holds. A sample is one preprocessed input without the batch axis: a
NumPy array for a single-input model, or ``{input name: array}``; an output is
``{output name: array}`` (that sample's row of every output).

* :class:`DirectSUT`: the model in this process, through the project's adapters
  (:func:`trims.runtime.models.open_model`: from the store when a daemon runs, else the file),
  an ONNX Runtime session or a torch module, with ``threads`` intra-op threads.
* :class:`GatewaySUT`: the model deployed as a function on a running gateway, invoked over the
  Open Inference Protocol (KServe V2) with the binary tensor extension over a persistent
  aiohttp connection pool; it can deploy the function from a spec and remove it at close.
  :func:`onnx_function_spec` and :func:`torch_function_spec` write those specs.
* :class:`trims.evaluation.harness.sut_mxnet.MxnetSUT`: the model in a child process in the
  MXNet environment (its own module: the main environment has no MXNet).

Both split a batch into chunks the model accepts (a fixed batch dimension, e.g. the zoo's 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from trims.errors import TrimsError, ValidationError
from trims.evaluation.harness.gateway_client import GatewayClient, gateway_error, put_specs
from trims.oip import DTYPES, HEADER_LENGTH

if TYPE_CHECKING:
    import aiohttp

__all__ = [
    "DirectSUT",
    "GatewaySUT",
    "Output",
    "SystemUnderTest",
    "onnx_function_spec",
    "torch_function_spec",
]

log = logging.getLogger(__name__)

#: One sample's outputs: output name -> that sample's array.
Output = dict[str, np.ndarray]

#: ONNX Runtime's type strings -> Open Inference Protocol datatypes.
_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(int8)": "INT8",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}


class SystemUnderTest(Protocol):
    """What LoadGen's SUT calls (see :mod:`.loadgen`)."""

    name: str

    def predict(self, batch: list[Any]) -> list[Any]: ...
    def close(self) -> None: ...


def _stack(batch: Sequence[Any], inputs: Sequence[str]) -> dict[str, np.ndarray]:
    """Samples -> one batched array per input (a new leading axis)."""
    if not batch:
        raise ValidationError("predict got an empty batch")
    if isinstance(batch[0], Mapping):
        missing = [n for n in inputs if n not in batch[0]]
        if missing:
            raise ValidationError(
                f"samples lack input(s) {', '.join(missing)}; the model takes {', '.join(inputs)}"
            )
        return {n: np.stack([np.asarray(s[n]) for s in batch]) for n in inputs}
    if len(inputs) != 1:
        raise ValidationError(
            f"the model takes {len(inputs)} inputs ({', '.join(inputs)}): give each sample "
            "as {input name: array}"
        )
    return {inputs[0]: np.stack([np.asarray(s) for s in batch])}


def _split(outputs: Mapping[str, np.ndarray], n: int) -> list[Output]:
    """Batched outputs -> one ``{name: row}`` per sample."""
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != n:
            raise TrimsError(
                f"output {name} has shape {list(array.shape)}, not a leading batch axis of {n}: "
                "the model must answer one row per sample"
            )
    return [{name: array[i] for name, array in outputs.items()} for i in range(n)]


def _chunks(batch: list[Any], size: int | None) -> list[list[Any]]:
    if size is None or size >= len(batch):
        return [batch]
    return [batch[i : i + size] for i in range(0, len(batch), size)]


def _fixed_batch(dim: Any) -> int | None:
    """A declared leading dimension: an int >= 1 is a fixed batch size; else variable."""
    return dim if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 1 else None


class DirectSUT:
    """The model in this process: ``run(feeds) -> outputs`` over batched arrays.

    ``max_batch``: the largest batch the model accepts (a fixed batch dimension); None = any.
    """

    def __init__(
        self,
        name: str,
        run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]],
        inputs: Sequence[str],
        *,
        max_batch: int | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.inputs = tuple(inputs)
        self.max_batch = max_batch
        self._run = run
        self._on_close = on_close

    @classmethod
    def onnx(
        cls,
        name: str,
        source: str | Path | None = None,
        *,
        threads: int = 1,
        socket_path: str | Path | None = None,
    ) -> DirectSUT:
        """An ONNX Runtime session over model ``name``: from the store when its daemon runs
        (``socket_path``, default the usual socket), else loaded from ``source``."""
        import onnxruntime as ort

        from trims.runtime.models import open_model

        model = open_model(name, source=source, socket_path=socket_path)
        try:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            session = model.onnx_session(sess_options=options)
        except BaseException:
            model.close()
            raise
        inputs = [i.name for i in session.get_inputs()]
        outputs = [o.name for o in session.get_outputs()]
        types = {i.name: _ORT_TYPES.get(i.type) for i in session.get_inputs()}

        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            cast = {
                k: np.ascontiguousarray(v, dtype=DTYPES[types[k] or "FP32"])
                for k, v in feeds.items()
            }
            return dict(zip(outputs, session.run(outputs, cast), strict=True))

        log.info(
            "direct system under test %s: ONNX Runtime via %s, %d intra-op threads",
            name,
            model.via,
            threads,
        )
        return cls(
            name,
            run,
            inputs,
            max_batch=_fixed_batch(session.get_inputs()[0].shape[0]),
            on_close=model.close,
        )

    @classmethod
    def torch(
        cls,
        name: str,
        module: Any,
        *,
        input_name: str = "input",
        output_name: str = "output",
        threads: int | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> DirectSUT:
        """A torch module called on a float32 batch under ``inference_mode``; ``threads`` sets
        torch's (process-wide) intra-op thread count when given; ``on_close`` frees what the
        module's weights map (e.g. the store's model handle)."""
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        module.eval()

        def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            x = np.ascontiguousarray(feeds[input_name], dtype=np.float32)
            with torch.inference_mode():
                out = module(torch.from_numpy(x))
            return {output_name: out.numpy()}

        log.info(
            "direct system under test %s: torch module %s, %s intra-op threads",
            name,
            type(module).__name__,
            torch.get_num_threads(),
        )
        return cls(name, run, [input_name], on_close=on_close)

    def predict(self, batch: list[Any]) -> list[Any]:
        results: list[Any] = []
        for chunk in _chunks(batch, self.max_batch):
            results.extend(_split(self._run(_stack(chunk, self.inputs)), len(chunk)))
        return results

    def close(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


def onnx_function_spec(
    name: str,
    source: str | Path,
    *,
    code_dir: str | Path,
    handler: str = "handler:handler",
    executor: str | None = None,
    max_instances: int = 1,
    concurrency: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """A function spec serving the ONNX model at ``source`` over the Open Inference Protocol.

    The handler module in ``code_dir`` must define ``init(ctx)`` opening
    ``ctx.models["model"].onnx_session()`` and ``infer(inputs, ctx)``, as
    ``examples/onnx_zoo/handler.py`` does. The served tensors are read from the model.
    ``threads``: the instance's CPU cores (``resources.cpus``, enforced by the docker and
    kubernetes executors) and ``config.threads`` for a handler that sizes its pools by it.
    """
    import onnxruntime as ort

    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])

    def meta(args: Sequence[Any]) -> list[dict[str, Any]]:
        out = []
        for t in args:
            if t.type not in _ORT_TYPES:
                raise ValidationError(
                    f"model {name}: tensor {t.name} of type {t.type} cannot be served"
                )
            shape = [d if isinstance(d, int) else -1 for d in t.shape]
            out.append({"name": t.name, "datatype": _ORT_TYPES[t.type], "shape": shape})
        return out

    spec: dict[str, Any] = {
        "name": name,
        "handler": handler,
        "code_dir": str(code_dir),
        "models": [
            {"name": name, "alias": "model", "framework": "onnxruntime", "source": str(source)}
        ],
        "scaling": {"max_instances": max_instances, "concurrency": concurrency},
        "serves": {"inputs": meta(session.get_inputs()), "outputs": meta(session.get_outputs())},
    }
    return _with_placement(spec, executor, threads)


def _with_placement(
    spec: dict[str, Any], executor: str | None, threads: int | None
) -> dict[str, Any]:
    if executor is not None:
        spec["executor"] = executor
    if threads is not None:
        spec["resources"] = {"cpus": threads}
        spec["config"] = {**spec.get("config", {}), "threads": threads}
    return spec


def torch_function_spec(
    name: str,
    manifest: Mapping[str, Any],
    *,
    input_name: str,
    input_dims: Sequence[int],
    output_name: str,
    code_dir: str | Path | None = None,
    executor: str | None = None,
    max_instances: int = 1,
    concurrency: int = 1,
    threads: int | None = None,
) -> dict[str, Any]:
    """A function spec serving a torch manifest's model over the Open Inference Protocol.

    The handler is ``evaluation/harness/functions/torch_model.py`` (``code_dir`` defaults to
    that folder): its ``init`` builds the module the manifest (its JSON form, carried in the
    spec's config, so no file of the evaluating host need be readable by the function's user
    or inside its container) describes, with ``config.threads`` intra-op threads, and
    ``infer`` runs it on the float32 input ``input_name`` (``[-1, *input_dims]``).
    """
    folder = Path(code_dir) if code_dir is not None else Path(__file__).parent / "functions"
    spec: dict[str, Any] = {
        "name": name,
        "handler": "torch_model:handler",
        "code_dir": str(folder.resolve()),
        "scaling": {"max_instances": max_instances, "concurrency": concurrency},
        "config": {
            "manifest": dict(manifest),
            "input": input_name,
            "output": output_name,
        },
        "serves": {
            "inputs": [{"name": input_name, "datatype": "FP32", "shape": [-1, *input_dims]}],
            "outputs": [{"name": output_name, "datatype": "FP32", "shape": [-1, -1]}],
        },
    }
    return _with_placement(spec, executor, threads)


class GatewaySUT:
    """A function on a running gateway, invoked over the Open Inference Protocol.

    Requests go from a private event loop thread through one aiohttp session (a persistent
    pool of ``connections`` connections), so ``predict`` may be called from LoadGen's threads
    at once. A batch larger than the model's fixed batch dimension is sent as concurrent
    requests. ``binary``: the binary tensor extension (else JSON tensors).
    """

    def __init__(
        self,
        url: str,
        model: str,
        *,
        token: str | None = None,
        binary: bool = True,
        connections: int = 8,
        timeout_s: float = 120.0,
    ) -> None:

        self.name = model
        self.binary = binary
        self._deployed = False
        self._client = GatewayClient(
            url, name=f"gateway-sut-{model}", token=token, connections=connections,
            timeout_s=timeout_s,
        )  # fmt: skip
        self.url = self._client.url
        try:
            meta = self._client.call(self._client.json("GET", f"/v2/models/{model}"))
        except BaseException:
            self._client.close()
            raise
        self.inputs = tuple(t["name"] for t in meta["inputs"])
        self.datatypes = {t["name"]: t["datatype"] for t in meta["inputs"]}
        self.max_batch = _fixed_batch(meta["inputs"][0]["shape"][0])

    @classmethod
    def deploy(cls, url: str, spec: Mapping[str, Any], **options: Any) -> GatewaySUT:
        """Deploy ``spec`` (it must declare ``serves``) and invoke it; :meth:`close` removes
        the function again. ``options`` as for the constructor (``token`` must be an admin's)."""
        name = spec.get("name")
        if not isinstance(name, str) or "serves" not in spec:
            raise ValidationError(
                "a gateway system under test needs a function spec with a name and 'serves'"
            )
        put_specs(url, [(f"/v1/functions/{name}", spec)], options.get("token"))
        log.info("function %s deployed on %s for a gateway system under test", name, url)
        sut = cls(url, name, **options)
        sut._deployed = True
        return sut

    @property
    def _session(self) -> aiohttp.ClientSession:
        return self._client.session

    def predict(self, batch: list[Any]) -> list[Any]:
        return self._client.call(self._predict(batch))

    async def _predict(self, batch: list[Any]) -> list[Output]:
        chunks = _chunks(batch, self.max_batch)
        answers = await asyncio.gather(*(self._infer(c) for c in chunks))
        return [out for answer in answers for out in answer]

    async def _infer(self, chunk: list[Any]) -> list[Output]:
        feeds = _stack(chunk, self.inputs)
        body, headers = encode_request(feeds, self.datatypes, self.binary)
        path = f"/v2/models/{self.name}/infer"
        async with self._session.post(self.url + path, data=body, headers=headers) as r:
            payload = await r.read()
            if r.status >= 400:
                raise gateway_error(r.status, payload, f"inferring {self.name}")
            outputs = decode_response(payload, r.headers.get(HEADER_LENGTH))
        return _split(outputs, len(chunk))

    def close(self) -> None:
        """Close the connection pool, and remove the function when :meth:`deploy` made it."""
        if not self._client.open:
            return
        try:
            if self._deployed:
                self._client.call(self._client.json("DELETE", f"/v1/functions/{self.name}"))
                log.info("function %s removed from %s", self.name, self.url)
        finally:
            self._client.close()


def _numeric(datatype: str, what: str) -> np.dtype[Any]:
    """The NumPy dtype of a numeric Open Inference Protocol datatype (BYTES is not one)."""
    dtype = DTYPES.get(datatype)
    if dtype is None or dtype.kind == "O":
        raise TrimsError(f"{what} is {datatype}: only numeric tensors are encoded and decoded")
    return dtype


def encode_request(
    feeds: Mapping[str, np.ndarray], datatypes: Mapping[str, str], binary: bool = True
) -> tuple[bytes, dict[str, str]]:
    """An infer request body and headers; outputs are asked for in binary when ``binary``."""
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for name, array in feeds.items():
        datatype = datatypes.get(name, "FP32")
        data = np.ascontiguousarray(array, dtype=_numeric(datatype, f"input {name}"))
        entry: dict[str, Any] = {"name": name, "shape": list(data.shape), "datatype": datatype}
        if binary:
            blob = data.tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = data.reshape(-1).tolist()
        entries.append(entry)
    head = json.dumps({"inputs": entries, "parameters": {"binary_data_output": binary}}).encode()
    if not binary:
        return head, {"Content-Type": "application/json"}
    return head + b"".join(blobs), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH: str(len(head)),
    }


def decode_response(body: bytes, header_length: str | None) -> dict[str, np.ndarray]:
    """An infer response body (JSON, or JSON + binary tensors) -> output name -> array."""
    n = int(header_length) if header_length is not None else len(body)
    doc = json.loads(body[:n])
    offset = n
    outputs: dict[str, np.ndarray] = {}
    for entry in doc["outputs"]:
        dtype = _numeric(entry["datatype"], f"output {entry['name']}")
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            array = np.frombuffer(body, dtype=dtype, count=size // dtype.itemsize, offset=offset)
            offset += size
        else:
            array = np.asarray(entry["data"], dtype=dtype)
        outputs[entry["name"]] = array.reshape(entry["shape"])
    return outputs
