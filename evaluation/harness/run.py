"""One evaluation run: a system under test, a sample set, a scenario and a mode, under LoadGen.

:func:`run_scenario` takes a plain :class:`SampleSet` (preprocessed inputs, optional labels and
a post-processing function), so it does not depend on how a manifest describes a dataset. Mode
``both`` is two LoadGen runs, performance then accuracy, as MLPerf submissions do; the accuracy
run returns every sample's (post-processed) output by sample index, which the accuracy metrics
(:mod:`.accuracy`) compare with the labels.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import ValidationError
from trims.evaluation.harness.loadgen import (
    MODES,
    SCENARIOS,
    LoadGenSettings,
    ScenarioResult,
    run_loadgen,
)
from trims.evaluation.harness.sut import SystemUnderTest

if TYPE_CHECKING:
    from trims.evaluation.harness.manifest import Manifest

__all__ = [
    "RUN_MODES",
    "GatewayTarget",
    "ManifestRun",
    "SampleSet",
    "ScenarioRun",
    "manifest_model_file",
    "manifest_samples",
    "run_manifest",
    "run_scenario",
]

log = logging.getLogger(__name__)

#: The modes :func:`run_scenario` accepts: LoadGen's two, and both (two runs).
RUN_MODES = (*MODES, "both")


@dataclass(frozen=True)
class SampleSet:
    """What a run evaluates: one preprocessed input per sample, in sample-index order."""

    inputs: Sequence[Any]
    #: The label of each sample (same order), for the accuracy metric; None = none known.
    labels: Sequence[Any] | None = None
    #: Applied to each raw output in accuracy mode (e.g. logits -> class id); None = keep raw.
    postprocess: Callable[[Any], Any] | None = None
    name: str = "samples"

    def __post_init__(self) -> None:
        if self.labels is not None and len(self.labels) != len(self.inputs):
            raise ValidationError(
                f"sample set {self.name}: {len(self.labels)} labels for {len(self.inputs)} "
                "inputs; give one label per input"
            )


@dataclass(frozen=True)
class ScenarioRun:
    """The LoadGen results of one :func:`run_scenario` call and, after an accuracy run, each
    sample's post-processed output by sample index."""

    scenario: str
    sut: str
    performance: ScenarioResult | None = None
    accuracy: ScenarioResult | None = None
    outputs: Mapping[int, Any] = field(default_factory=dict, repr=False)

    @property
    def results(self) -> list[ScenarioResult]:
        return [r for r in (self.performance, self.accuracy) if r is not None]

    @property
    def valid(self) -> bool:
        return all(r.valid for r in self.results)

    def predictions(self) -> list[Any]:
        """The outputs in sample-index order (after an accuracy run, which answers each
        sample once)."""
        return [self.outputs[i] for i in sorted(self.outputs)]


def run_scenario(
    sut: SystemUnderTest,
    samples: SampleSet,
    scenario: str,
    mode: str = "performance",
    settings: LoadGenSettings | None = None,
    *,
    batch: int = 1,
    workers: int = 1,
    warmup: int = 1,
    log_dir: str | Path | None = None,
) -> ScenarioRun:
    """Run ``sut`` over ``samples`` under LoadGen's ``scenario`` in ``mode``.

    ``batch``: the most samples per ``predict`` call (the Offline batch size to sweep);
    ``workers``: threads calling ``predict`` at once; ``warmup``: ``predict`` calls on the first
    sample before LoadGen starts (a cold function instance, lazy framework initialization),
    not timed; ``log_dir``: keep LoadGen's logs there (one subfolder per mode).
    """
    if scenario not in SCENARIOS:
        raise ValidationError(
            f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}",
            field="scenario",
        )
    if mode not in RUN_MODES:
        raise ValidationError(
            f"unknown mode {mode!r}; choose one of {', '.join(RUN_MODES)}", field="mode"
        )
    if not samples.inputs:
        raise ValidationError(f"sample set {samples.name} is empty", field="samples")
    for _ in range(warmup):
        sut.predict([samples.inputs[0]])
    modes = ("performance", "accuracy") if mode == "both" else (mode,)
    found: dict[str, ScenarioResult] = {}
    outputs: dict[int, Any] = {}
    for one in modes:
        result, raw = run_loadgen(
            sut.predict,
            samples.inputs,
            scenario,
            one,
            settings,
            batch=batch,
            workers=workers,
            log_dir=Path(log_dir) / one if log_dir is not None else None,
        )
        found[one] = result
        if one == "accuracy":
            post = samples.postprocess
            outputs = {i: post(out) if post else out for i, out in raw.items()}
    log.info(
        "%s on %s, %s %s: %s",
        samples.name,
        sut.name,
        scenario,
        mode,
        ", ".join(f"{r.mode} {'VALID' if r.valid else 'INVALID'}" for r in found.values()),
    )
    return ScenarioRun(
        scenario=scenario,
        sut=sut.name,
        performance=found.get("performance"),
        accuracy=found.get("accuracy"),
        outputs=outputs,
    )


@dataclass(frozen=True)
class GatewayTarget:
    """Where a ``gateway`` system under test deploys: the gateway's URL, an admin token (None:
    none sent) and the folder of the ONNX handler module (``examples/onnx_zoo`` in the repo)."""

    url: str
    code_dir: Path
    token: str | None = None


@dataclass(frozen=True)
class ManifestRun:
    """One manifest evaluated in one scenario: the LoadGen run and, after an accuracy run on
    labelled samples with real weights, the metric's value (a fraction in [0, 1])."""

    manifest: Manifest
    framework_version: str
    sut_kind: str
    run: ScenarioRun
    accuracy: float | None
    samples: int


def manifest_samples(manifest: Manifest) -> SampleSet:
    """The manifest's dataset samples, preprocessed for its first input."""
    from trims.evaluation.harness.datasets import load

    loaded = list(load(manifest.dataset, manifest.inputs))
    labels = [s.label for s in loaded]
    return SampleSet(
        [s.input for s in loaded],
        labels if all(label is not None for label in labels) else None,
        name=f"{manifest.dataset.name}/{manifest.dataset.split}",
    )


def manifest_model_file(manifest: Manifest, work_dir: Path) -> Path:
    """The model file of an ONNX manifest: its checked local file, or what ``prepare`` builds."""
    source = manifest.model.sources[0]
    if source.builder is not None and source.builder.startswith("prepare:"):
        from trims.evaluation.harness.prepare import build

        return Path(build(source.builder, work_dir))
    if source.path is not None:
        manifest.verify_sources()
        return Path(manifest.resolve(source.path))
    raise ValidationError(
        f"manifest {manifest.name}: model.sources[0] is {source.describe()}; run_manifest runs "
        "local files and prepare: builders (add url models to the store first)",
        field="model.sources[0]",
    )


def run_manifest(
    manifest: Manifest,
    sut_kind: str,
    scenario: str,
    mode: str = "performance",
    settings: LoadGenSettings | None = None,
    *,
    work_dir: Path,
    gateway: GatewayTarget | None = None,
    socket_path: str | Path | None = None,
    batch: int = 1,
    workers: int = 1,
    threads: int = 1,
) -> ManifestRun:
    """Evaluate an ONNX Runtime manifest on the ``direct`` or ``gateway`` system under test.

    Checks before anything runs: the framework constraint (:meth:`Manifest.check_stack`), the
    sources' sha256 and the dataset. ``work_dir`` holds built models (readable by the gateway's
    workers); ``socket_path``: the store the direct SUT maps the model from when its daemon
    runs (by the manifest's name). Accuracy is computed only for real weights with labels.
    """
    from trims.evaluation.harness.accuracy import score
    from trims.evaluation.harness.sut import DirectSUT, GatewaySUT, onnx_function_spec

    if manifest.framework.name != "onnxruntime":
        raise ValidationError(
            f"manifest {manifest.name}: run_manifest runs onnxruntime manifests; "
            f"{manifest.framework.name} models need their framework's system under test",
            field="framework.name",
        )
    if sut_kind not in ("direct", "gateway"):
        raise ValidationError(f"unknown system under test {sut_kind!r}; choose direct or gateway")
    if sut_kind == "gateway" and gateway is None:
        raise ValidationError("a gateway system under test needs the gateway (GatewayTarget)")
    version = manifest.check_stack()
    path = manifest_model_file(manifest, work_dir)
    samples = manifest_samples(manifest)
    output = manifest.outputs[0].name
    if manifest.accuracy is not None and samples.labels is not None:
        samples = SampleSet(
            samples.inputs, samples.labels, lambda out: out[output], name=samples.name
        )
    sut: SystemUnderTest
    if gateway is not None and sut_kind == "gateway":
        function = re.sub(r"[^a-z0-9-]+", "-", manifest.name.lower()).strip("-")[:60]
        spec = onnx_function_spec(f"eval-{function}", path, code_dir=gateway.code_dir)
        sut = GatewaySUT.deploy(gateway.url, spec, token=gateway.token)
    else:
        sut = DirectSUT.onnx(manifest.name, path, threads=threads, socket_path=socket_path)
    try:
        run = run_scenario(sut, samples, scenario, mode, settings, batch=batch, workers=workers)
    finally:
        sut.close()
    value = None
    if run.accuracy is not None and manifest.accuracy is not None and samples.labels is not None:
        predictions = np.stack([np.asarray(p).reshape(-1) for p in run.predictions()])
        value = score(manifest.accuracy.metric, predictions, samples.labels, manifest.accuracy.k)
    return ManifestRun(manifest, version, sut_kind, run, value, len(samples.inputs))
