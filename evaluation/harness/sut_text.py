"""The text systems under test: a sentence-embedding manifest (all-MiniLM-L6-v2) on raw text.

A text manifest's first input is ``BYTES`` with ``tokenization`` in its preprocessing: its
samples are strings (e.g. the ``movielens-100k-titles`` dataset) and each answer is
``{output name: embedding}``.

* :func:`direct_text_sut`: the model in this process. The text is tokenized with the
  WordPiece of ``examples/minilm/wordpiece.py`` over the manifest's ``vocab`` and
  ``max_length``, and embedded by ``examples/minilm/bert.py`` (BERT as plain torch functions)
  over the real weights, mapped through :func:`trims.runtime.models.open_model` (the store when
  its daemon holds the model, else the manifest's checked safetensors file), as the example's
  handler maps them.
* :class:`TextFunctionSUT`: the ``examples/minilm`` function deployed on a gateway
  (:func:`text_function_spec`) and invoked with its own JSON body, ``{"texts": [...]}`` ->
  ``{"embeddings": [[...], ...]}``, one request per ``predict`` chunk.

Both need the ``examples/minilm`` folder of a source checkout.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import NotFound, TrimsError, ValidationError
from trims.evaluation.harness.gateway_client import gateway_error
from trims.evaluation.harness.sut import DirectSUT, GatewaySUT, Output

if TYPE_CHECKING:
    from trims.evaluation.harness.manifest import Manifest, Tokenization

__all__ = [
    "TextFunctionSUT",
    "direct_text_sut",
    "is_text_manifest",
    "minilm_example_dir",
    "text_function_spec",
]

log = logging.getLogger(__name__)


def minilm_example_dir() -> Path:
    """``examples/minilm`` of the source checkout trims runs from."""
    return Path(__file__).resolve().parents[2] / "examples" / "minilm"


def is_text_manifest(manifest: Manifest) -> bool:
    """True when the manifest's first input is text (``BYTES`` with a tokenization)."""
    first = manifest.inputs[0]
    pre = first.preprocessing
    return first.element_type == "BYTES" and pre is not None and pre.tokenization is not None


def _tokenization(manifest: Manifest) -> Tokenization:
    pre = manifest.inputs[0].preprocessing
    if not is_text_manifest(manifest) or pre is None or pre.tokenization is None:
        raise ValidationError(
            f"manifest {manifest.name}: inputs[0] is not text; a text system under test needs "
            "a BYTES input with preprocessing.tokenization",
            field="inputs[0]",
        )
    if not pre.tokenization.lowercase:
        raise ValidationError(
            f"manifest {manifest.name}: inputs[0].preprocessing.tokenization.lowercase is false; "
            "the WordPiece of examples/minilm is the uncased BERT tokenizer",
            field="inputs[0].preprocessing.tokenization.lowercase",
        )
    return pre.tokenization


def _example_module(name: str) -> ModuleType:
    """``examples/minilm/<name>.py`` as a module (the example is not an installed package)."""
    path = minilm_example_dir() / f"{name}.py"
    if not path.is_file():
        raise NotFound(
            f"the text system under test needs {path} of a trims source checkout",
            field="model.sources",
        )
    spec = importlib.util.spec_from_file_location(f"trims_example_minilm_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _weights_file(manifest: Manifest) -> Path:
    """The manifest's safetensors source, checked against its sha256."""
    source = manifest.model.sources[0]
    if manifest.model.format != "safetensors" or source.path is None:
        raise ValidationError(
            f"manifest {manifest.name}: model.sources[0] is {source.describe()} "
            f"({manifest.model.format}); the text system under test maps a safetensors file",
            field="model.sources[0]",
        )
    manifest.verify_sources()
    return manifest.resolve(source.path)


def direct_text_sut(
    manifest: Manifest, *, socket_path: str | Path | None = None, threads: int | None = None
) -> tuple[DirectSUT, str]:
    """The text model in this process (see the module docstring) and the model digest."""
    import torch

    tokenization = _tokenization(manifest)
    output = manifest.outputs[0].name
    bert = _example_module("bert")
    wordpiece = _example_module("wordpiece").WordPiece(manifest.resolve(tokenization.vocab))
    max_length = tokenization.max_length
    path = _weights_file(manifest)
    from trims.runtime.models import open_model

    model = open_model(manifest.name, source=path, fmt="safetensors", socket_path=socket_path)
    try:
        weights = model.torch()
    except BaseException:
        model.close()
        raise
    if threads is not None:
        torch.set_num_threads(threads)

    def run(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [_text(t) for t in feeds[manifest.inputs[0].name].reshape(-1)]
        rows = [wordpiece.encode(t, max_length) for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        with torch.inference_mode():
            embeddings = bert.sentence_embeddings(weights, ids, mask)
        return {output: embeddings.numpy()}

    log.info(
        "direct system under test %s: WordPiece (max %d tokens) and BERT in torch via %s, %s "
        "intra-op threads",
        manifest.name,
        max_length,
        model.via,
        torch.get_num_threads(),
    )
    sut = DirectSUT(manifest.name, run, [manifest.inputs[0].name], on_close=model.close)
    return sut, manifest.model.sources[0].sha256 or ""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def text_function_spec(
    manifest: Manifest,
    name: str,
    *,
    executor: str | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The spec of ``examples/minilm/function.yaml`` renamed ``name``, serving the manifest's
    checked weights file, with one instance of one concurrent request, the manifest's
    ``max_length``, ``threads`` (the instance's cores and ``config.threads``) and
    ``executor``."""
    from trims.runtime.functions.spec import load_spec_file

    folder = minilm_example_dir()
    if not (folder / "function.yaml").is_file():
        raise NotFound(
            f"the text gateway system under test deploys {folder}/function.yaml of a trims "
            "source checkout",
            field="model.sources",
        )
    tokenization = _tokenization(manifest)
    spec = load_spec_file(folder / "function.yaml").to_dict()
    spec["name"] = name
    spec["code_dir"] = str(folder)
    spec["models"] = [
        {**m, "name": manifest.name, "source": str(_weights_file(manifest))} for m in spec["models"]
    ]
    spec["scaling"] = {**spec.get("scaling", {}), "max_instances": 1, "concurrency": 1}
    spec["config"] = {**spec.get("config", {}), "max_length": tokenization.max_length}
    if executor is not None:
        spec["executor"] = executor
    if threads is not None:
        spec["resources"] = {**spec.get("resources", {}), "cpus": threads}
        spec["config"]["threads"] = threads
    return spec


class TextFunctionSUT(GatewaySUT):
    """A text-embedding function on a gateway, invoked with ``{"texts": [...]}`` at
    ``/v1/functions/{name}/invoke``; each answer row becomes ``{output: embedding}``.

    ``output``: the output name the answers are given under (the manifest's first output);
    :meth:`GatewaySUT.deploy` passes it on (``TextFunctionSUT.deploy(url, spec, output=...)``).
    """

    def __init__(self, url: str, model: str, *, output: str = "embedding", **options: Any) -> None:
        super().__init__(url, model, **options)
        self.output = output
        self.max_batch = None

    async def _infer(self, chunk: list[Any]) -> list[Output]:
        texts = [_text(t) for t in chunk]
        path = f"/v1/functions/{self.name}/invoke"
        body = json.dumps({"texts": texts}).encode()
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self.url + path, data=body, headers=headers) as r:
            payload = await r.read()
            if r.status >= 400:
                raise gateway_error(r.status, payload, f"invoking {self.name}")
        embeddings = _embeddings(payload, len(chunk), self.name)
        return [{self.output: row} for row in embeddings]


def _embeddings(payload: bytes, n: int, name: str) -> Sequence[np.ndarray]:
    try:
        rows = json.loads(payload)["embeddings"]
        array = np.asarray(rows, dtype=np.float32)
    except (ValueError, KeyError, TypeError) as e:
        raise TrimsError(
            f'function {name} answered {payload[:120]!r}, not {{"embeddings": [[...]]}}: '
            "deploy the examples/minilm handler"
        ) from e
    if array.ndim != 2 or array.shape[0] != n:
        raise TrimsError(
            f"function {name} answered embeddings of shape {list(array.shape)} for {n} texts; "
            "it must answer one row per text"
        )
    return list(array)
