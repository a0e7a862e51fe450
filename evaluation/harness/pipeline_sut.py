"""The ``pipeline`` system under test: a pipeline of functions on a gateway, end to end.

:class:`PipelineSUT` sends each sample (a request body: bytes, or str sent as UTF-8) to
``POST /v1/pipelines/{name}/invoke`` and answers the pipeline's final output (parsed JSON for a
JSON answer, else the bytes). The gateway times every step of every run and says so in the
``Server-Timing`` header (``decode;dur=1.204, classify;dur=3.917, total;dur=5.310``); the SUT
keeps those figures per query, and :meth:`PipelineSUT.stage_latencies` hands them to
:func:`trims.evaluation.harness.run.run_scenario`, which reports p50/p90/p99 per stage next to
LoadGen's end-to-end latencies (``ScenarioRun.stage_latency_ms``).

Requests go through one aiohttp session (a persistent pool of ``connections`` connections) on
a private event loop thread, as :class:`~trims.evaluation.harness.sut.GatewaySUT` does, so
LoadGen's threads may call ``predict`` at once; a batch is sent as concurrent requests.
:meth:`PipelineSUT.deploy` deploys the functions and the pipeline (e.g. the specs of
``examples/pipelines/digits``, read by :func:`example_specs`) and :meth:`close` removes them.

:data:`PIPELINES` names the shipped pipeline that serves a manifest's model end to end
(``digits-mlp``: PNG -> decode -> the MLP -> labels), how a raw dataset sample becomes its
request body and how its answer becomes the metric's scores; ``trims evaluate run --sut
pipeline`` evaluates those manifests (:func:`pipeline_specs` deploys the example with the
harness's model file).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trims.errors import NotFound, TrimsError, ValidationError
from trims.evaluation.harness.gateway_client import GatewayClient, gateway_error, put_specs

__all__ = [
    "PIPELINES",
    "PipelineExample",
    "PipelineSUT",
    "example_specs",
    "parse_server_timing",
    "pipeline_example",
    "pipeline_specs",
]

log = logging.getLogger(__name__)


def parse_server_timing(value: str) -> dict[str, float]:
    """A ``Server-Timing`` value -> metric name -> duration in ms (metrics without ``dur`` are
    left out; a repeated name keeps its first figure)."""
    found: dict[str, float] = {}
    for metric in value.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, raw = param.partition("=")
            if key.strip().lower() != "dur" or not name or name in found:
                continue
            try:
                found[name] = float(raw.strip().strip('"'))
            except ValueError:
                continue
    return found


def example_specs(folder: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The function specs (every ``*.yaml`` spec file) and the pipeline spec
    (``pipeline.json``) of a pipeline example folder, such as ``examples/pipelines/digits``;
    relative code and model paths are resolved against the folder."""
    from trims.runtime.functions.spec import load_spec_file

    root = Path(folder)
    pipeline_file = root / "pipeline.json"
    try:
        pipeline = json.loads(pipeline_file.read_text())
    except OSError as e:
        raise ValidationError(f"cannot read pipeline spec {pipeline_file}: {e.strerror}") from e
    except ValueError as e:
        raise ValidationError(f"{pipeline_file}: not valid JSON: {e}") from e
    functions = [load_spec_file(p).to_dict() for p in sorted(root.glob("*.yaml"))]
    if not functions:
        raise ValidationError(f"{root}: no function spec (*.yaml) next to pipeline.json")
    return functions, pipeline


class PipelineSUT:
    """A pipeline on a running gateway, invoked over HTTP, timed per stage.

    ``content_type``: sent with every sample; ``outputs``: ask for the per-stage outputs
    envelope (then each answer is that JSON object, see the gateway's pipelines docs).
    """

    def __init__(
        self,
        url: str,
        pipeline: str,
        *,
        token: str | None = None,
        content_type: str = "application/octet-stream",
        outputs: bool = False,
        connections: int = 8,
        timeout_s: float = 120.0,
    ) -> None:
        self.name = pipeline
        self.content_type = content_type
        self._query = "?outputs=true" if outputs else ""
        self._deployed: tuple[str, ...] = ()
        self._timings: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._client = GatewayClient(
            url, name=f"pipeline-sut-{pipeline}", token=token, connections=connections,
            timeout_s=timeout_s,
        )  # fmt: skip
        self.url = self._client.url
        try:
            self._client.call(self._client.json("GET", f"/v1/pipelines/{pipeline}"))
        except BaseException:
            self._client.close()
            raise

    @classmethod
    def deploy(
        cls,
        url: str,
        functions: Sequence[Mapping[str, Any]],
        pipeline: Mapping[str, Any],
        **options: Any,
    ) -> PipelineSUT:
        """Deploy ``functions`` (each PUT, replacing one of the same name) and ``pipeline``;
        :meth:`close` removes them again. ``options`` as for the constructor (``token`` must
        be an admin's)."""
        name = pipeline.get("name")
        if not isinstance(name, str):
            raise ValidationError("a pipeline system under test needs a pipeline spec with a name")
        puts = [(f"/v1/functions/{f['name']}", f) for f in functions]
        put_specs(url, [*puts, (f"/v1/pipelines/{name}", pipeline)], options.get("token"))
        log.info(
            "pipeline %s and its %d functions deployed on %s for a pipeline system under test",
            name,
            len(functions),
            url,
        )
        sut = cls(url, name, **options)
        made = [f"/v1/functions/{f['name']}" for f in functions]
        sut._deployed = (f"/v1/pipelines/{name}", *made)
        return sut

    def predict(self, batch: list[Any]) -> list[Any]:
        return self._client.call(self._predict(batch))

    async def _predict(self, batch: list[Any]) -> list[Any]:
        if not batch:
            raise ValidationError("predict got an empty batch")
        return list(await asyncio.gather(*(self._invoke(sample) for sample in batch)))

    async def _invoke(self, sample: Any) -> Any:
        if isinstance(sample, str):
            sample = sample.encode()
        if not isinstance(sample, bytes | bytearray | memoryview):
            raise ValidationError(
                f"a pipeline sample is a request body (bytes or str), got {type(sample).__name__}"
            )
        path = f"/v1/pipelines/{self.name}/invoke{self._query}"
        headers = {"Content-Type": self.content_type}
        async with self._client.session.post(
            self.url + path, data=bytes(sample), headers=headers
        ) as r:
            body = await r.read()
            if r.status >= 400:
                raise gateway_error(r.status, body, f"invoking pipeline {self.name}")
            timing = parse_server_timing(r.headers.get("Server-Timing", ""))
            json_body = "json" in r.headers.get("Content-Type", "")
        if timing:
            with self._lock:
                self._timings.append(timing)
        return json.loads(body) if json_body else body

    def stage_latencies(self) -> dict[str, list[float]]:
        """Each stage's durations (ms, from ``Server-Timing``, ``total`` included) over the
        queries answered since the last call; the record starts empty again."""
        with self._lock:
            timings, self._timings = self._timings, []
        stages: dict[str, list[float]] = {}
        for timing in timings:
            for stage, ms in timing.items():
                stages.setdefault(stage, []).append(ms)
        return stages

    def close(self) -> None:
        """Close the connection pool, and remove what :meth:`deploy` made."""
        if not self._client.open:
            return
        try:
            for path in self._deployed:
                self._client.call(self._client.json("DELETE", path))
            if self._deployed:
                log.info("pipeline %s and its functions removed from %s", self.name, self.url)
        finally:
            self._client.close()


@dataclass(frozen=True)
class PipelineExample:
    """A shipped pipeline that serves a manifest's model end to end (``--sut pipeline``).

    ``folder``: the example (function specs and ``pipeline.json``) under ``examples/``;
    ``content_type``: of each request body; ``raw``: a dataset split's raw samples and labels
    (before the manifest's preprocessing, which the pipeline's own steps do); ``encode``: one
    raw sample -> request body; ``scores``: the pipeline's answer -> a row of class scores for
    the manifest's metric.
    """

    folder: str
    content_type: str
    raw: Callable[[str], tuple[Sequence[Any], Sequence[Any]]]
    encode: Callable[[Any], bytes]
    scores: Callable[[Any], np.ndarray]

    def samples(self, split: str, limit: int) -> tuple[list[bytes], list[Any]]:
        """At most ``limit`` request bodies of ``split`` and their labels, in dataset order."""
        inputs, labels = self.raw(split)
        n = min(limit, len(inputs))
        return [self.encode(x) for x in inputs[:n]], [int(y) for y in labels[:n]]


def _digits(split: str) -> tuple[Sequence[Any], Sequence[Any]]:
    from trims.evaluation.harness.datasets import digits

    images, labels = digits(split)
    return list(images), list(labels)


def _digit_png(image: Any) -> bytes:
    """A digits image (16 grey levels) as the 8-bit grayscale PNG the pipeline decodes
    (level x 15, as ``examples/pipelines/digits/prepare.py`` writes its samples)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray((np.asarray(image) * 15).astype(np.uint8), mode="L").save(out, format="PNG")
    return out.getvalue()


def _top_scores(answer: Any, classes: int = 10) -> np.ndarray:
    """The labels step's ``{"top": [{"class", "score"}, ...]}`` -> a row of ``classes``
    scores: the top classes' scores, -inf for the classes it left out."""
    row = np.full(classes, -np.inf, dtype=np.float64)
    try:
        for entry in answer["top"]:
            row[int(entry["class"])] = float(entry["score"])
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise TrimsError(
            f"the pipeline answered {str(answer)[:120]}, not the labels step's "
            '{"top": [{"class", "score"}]}'
        ) from e
    return row


#: manifest name -> the pipeline example that serves its model
PIPELINES: dict[str, PipelineExample] = {
    "digits-mlp": PipelineExample(
        "pipelines/digits", "image/png", _digits, _digit_png, _top_scores
    ),
}


def examples_dir() -> Path:
    """``examples/`` of the trims source checkout."""
    return Path(__file__).resolve().parents[2] / "examples"


def pipeline_example(manifest_name: str) -> PipelineExample:
    """The pipeline serving ``manifest_name``; ValidationError listing those that exist."""
    example = PIPELINES.get(manifest_name)
    if example is None:
        raise ValidationError(
            f"no shipped pipeline serves {manifest_name!r}; the pipeline system under test "
            f"evaluates {', '.join(sorted(PIPELINES))}",
            field="sut",
        )
    folder = examples_dir() / example.folder
    if not (folder / "pipeline.json").is_file():
        raise NotFound(
            f"the pipeline system under test deploys {folder}/pipeline.json of a trims source "
            "checkout",
            field="sut",
        )
    return example


def pipeline_specs(
    manifest_name: str, model_file: Path, *, executor: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The example's function and pipeline specs, the step that serves ``manifest_name``
    reading ``model_file`` (built or checked by the harness) and every function placed on
    ``executor`` (None: the gateway's default)."""
    functions, pipeline = example_specs(examples_dir() / pipeline_example(manifest_name).folder)
    for spec in functions:
        spec["models"] = [
            {**m, "source": str(model_file)} if m.get("name") == manifest_name else m
            for m in spec.get("models", [])
        ]
        if executor is not None:
            spec["executor"] = executor
    return functions, pipeline
