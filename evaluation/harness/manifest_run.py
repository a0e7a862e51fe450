"""One manifest evaluated end to end: checked, its model opened on a system under test, run
under LoadGen (:mod:`.run`), its accuracy scored, and turned into a results-database row.

:func:`check_manifest` runs every check before anything starts; :func:`run_manifest` opens the
system under test the framework and kind call for (direct, gateway, pipeline, MXNet, text),
runs the scenario and scores accuracy for real weights with labels; :class:`ManifestRun`
carries the result and :meth:`ManifestRun.to_evaluation` its database row.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trims.errors import NotFound, ValidationError
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.run import SampleSet, ScenarioRun, run_scenario
from trims.evaluation.harness.sut import SystemUnderTest

if TYPE_CHECKING:
    import torch

    from trims.evaluation.db import Evaluation
    from trims.evaluation.harness.manifest import Manifest

__all__ = [
    "SUT_KINDS",
    "GatewayTarget",
    "ManifestRun",
    "check_manifest",
    "manifest_model_file",
    "manifest_samples",
    "metric_predictions",
    "run_manifest",
    "torch_model",
]

log = logging.getLogger(__name__)

#: framework -> the systems under test :func:`run_manifest` runs its manifests on.
SUT_KINDS: Mapping[str, tuple[str, ...]] = {
    "onnxruntime": ("direct", "gateway", "pipeline"),
    "torch": ("direct", "gateway"),
    "mxnet": ("direct", "gateway"),
}


@dataclass(frozen=True)
class GatewayTarget:
    """Where a ``gateway`` system under test deploys: the gateway's URL, an admin token (None:
    none sent), the folder of the ONNX handler module (``examples/onnx_zoo`` in the repo) and
    the executor the function runs on (None: the gateway's default)."""

    url: str
    code_dir: Path
    token: str | None = None
    executor: str | None = None


@dataclass(frozen=True)
class ManifestRun:
    """One manifest evaluated in one scenario: the LoadGen run and, after an accuracy run on
    labelled samples with real weights, the metric's value (a fraction in [0, 1]).

    ``model_digest``: sha256 of the model file, or of a built module's tensors in state-dict
    order (a builder's output has no file to pin, Note [model sources] in manifest.py)."""

    manifest: Manifest
    framework_version: str
    sut_kind: str
    run: ScenarioRun
    accuracy: float | None
    samples: int
    model_digest: str = ""
    batch: int = 1
    threads: int = 1
    settings: LoadGenSettings | None = None
    #: The executor the gateway ran the function on ("local" for the in-process SUTs).
    executor: str = "local"

    def to_evaluation(self, mode: str, executor: str | None = None) -> Evaluation:
        """The database row's measurements (:class:`trims.evaluation.db.Evaluation`): LoadGen's
        settings and summaries of every run (performance first), figures of the performance
        run, the accuracy with its reference; ``executor`` (default: the run's) as recorded."""
        from trims.evaluation.db import AccuracyResult, Evaluation, Latency
        from trims.evaluation.harness.results import manifest_digest

        m = self.manifest
        perf = self.run.performance
        latency = None
        if perf is not None and {"p50", "p90", "p99", "mean"} <= set(perf.latency_ms):
            lat = perf.latency_ms
            latency = Latency(lat["p50"], lat["p90"], lat["p99"], lat["mean"])
        accuracy = None
        if self.accuracy is not None and m.accuracy is not None:
            accuracy = AccuracyResult(
                metric=m.accuracy.metric,
                value=self.accuracy,
                reference=m.accuracy.reference,
                dataset=f"{m.dataset.name}/{m.dataset.split}",
                samples=self.samples,
            )
        settings: dict[str, Any] = {
            "requested": (self.settings or LoadGenSettings()).to_dict(),
            **{r.mode: dict(r.settings) for r in self.run.results},
        }
        if self.run.stage_latency_ms:
            # Note [stages in the settings JSON]: per-stage latency percentiles of a pipeline
            # run ride in the row's JSON document under "stages" (stage -> p50/p90/p99/mean
            # ms), so schema 3 holds them without a migration; report_entry reads them back.
            settings["stages"] = {k: dict(v) for k, v in self.run.stage_latency_ms.items()}
        summary = "\n".join(f"== {r.mode} ==\n{r.summary.rstrip()}" for r in self.run.results)
        return Evaluation(
            manifest_name=m.name,
            manifest_version=m.version,
            manifest_digest=manifest_digest(m.model_dump(mode="json")),
            model_digest=self.model_digest,
            framework=m.framework.name,
            framework_version=self.framework_version,
            executor=executor or self.executor,
            sut=self.sut_kind,
            scenario=self.run.scenario,
            mode=mode,
            batch=self.batch,
            threads=self.threads,
            settings=settings,
            summary=summary,
            valid=self.run.valid,
            qps=None if perf is None else perf.qps,
            latency=latency,
            accuracy=accuracy,
        )


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


def _where(manifest: Manifest) -> str:
    return f"{manifest.file}: " if manifest.file is not None else f"manifest {manifest.name}: "


def check_manifest(manifest: Manifest, sut_kind: str) -> str:
    """Everything that can be checked before an evaluation runs; the framework's version.

    The framework constraint on this stack, the system under test for the framework, the
    sources' sha256 (local files) or the builder's existence, and the dataset. Each problem is
    one TrimsError naming the manifest file and the field.
    """
    from trims.evaluation.harness import datasets

    where = _where(manifest)
    framework = manifest.framework.name
    kinds = SUT_KINDS.get(framework, ())
    if sut_kind not in kinds:
        raise ValidationError(
            f"{where}framework.name: {framework} models run on the "
            f"{' or '.join(kinds) or 'no'} system under test, not {sut_kind!r}",
            field="framework.name",
        )
    if sut_kind == "pipeline":
        from trims.evaluation.harness.pipeline_sut import pipeline_example

        try:
            pipeline_example(manifest.name)
        except (NotFound, ValidationError) as e:
            raise type(e)(f"{where}name: {e.message}", field="sut") from e
    version = manifest.check_stack()
    manifest.verify_sources()
    for i, source in enumerate(manifest.model.sources):
        if source.url is not None:
            raise ValidationError(
                f"{where}model.sources[{i}]: {source.url}: url models are fetched by the store; "
                "add the model to the store first and evaluate a local copy",
                field=f"model.sources[{i}]",
            )
        if source.builder is not None:
            _check_builder(manifest, source.builder, f"{where}model.sources[{i}].builder")
    if framework == "mxnet" and manifest.model.format != "onnx":
        raise ValidationError(
            f"{where}model.format: the MXNet system under test runs ONNX graphs, not "
            f"{manifest.model.format}",
            field="model.format",
        )
    try:
        datasets.check(manifest.dataset.name, manifest.dataset.split)
    except (NotFound, ValidationError) as e:
        raise type(e)(f"{where}dataset: {e.message}", field="dataset") from e
    return version


def _check_builder(manifest: Manifest, builder: str, where: str) -> None:
    from trims.evaluation import families
    from trims.evaluation.harness import prepare

    kind, _, name = builder.partition(":")
    known: list[str]
    if kind == "torch":
        known = [f.removeprefix(families.PREFIX) for f in families.FAMILIES]
    elif kind == "prepare":
        known = sorted(prepare.BUILDERS)
    else:
        known = ["resnet50"]
        if name == "resnet50" and not (_examples_dir() / name / "network.py").is_file():
            raise NotFound(
                f"{where}: {builder} needs examples/{name}/network.py of a source checkout",
                field="model.sources",
            )
    if name not in known:
        raise NotFound(
            f"{where}: no builder {builder!r}; choose {kind}:" + f", {kind}:".join(known),
            field="model.sources",
        )
    if manifest.framework.name == "torch" and kind == "prepare":
        raise ValidationError(
            f"{where}: {builder} builds an ONNX model; a torch manifest names torch:<arch>, "
            "example:resnet50, or a state dict with model.module",
            field="model.sources",
        )


def _examples_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "examples"


def _state_digest(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def torch_model(
    manifest: Manifest, *, socket_path: str | Path | None = None
) -> tuple[torch.nn.Module, Callable[[], None] | None, str]:
    """A torch manifest's module in eval mode, what frees its weights (None: nothing to
    free) and the model digest.

    ``torch:<arch>``: the families' seeded module (:func:`trims.evaluation.families.build`);
    ``example:resnet50``: the example's network with the weights its prepare.py writes (seeded
    random if not written); a state dict with ``model.module``: that module filled through the
    store or the checked file (:func:`trims.evaluation.harness.prepare.open_torch_module`).
    """
    from trims.evaluation.harness.prepare import open_torch_module

    source = manifest.model.sources[0]
    if manifest.model.module is not None:
        module, model = open_torch_module(manifest, socket_path=socket_path)
        return module, model.close, source.sha256 or _state_digest(module)
    builder = source.builder or ""
    if builder.startswith("torch:"):
        from trims.evaluation import families

        built = families.build(builder)
    elif builder == "example:resnet50":
        from trims.evaluation.tracing.workload import _example_module

        built = _example_module()
    else:
        raise ValidationError(
            f"{_where(manifest)}model.sources[0]: {source.describe()} is not a torch model; "
            "use a torch:<arch> or example:resnet50 builder, or a state dict with model.module",
            field="model.sources[0]",
        )
    built.eval()
    return built, None, _state_digest(built)


def _function_name(manifest: Manifest) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", manifest.name.lower()).strip("-")[:60]
    return f"eval-{slug}"


#: The model file's name in a self-contained function folder (:func:`_self_contained`).
STAGED_MODEL = "model.onnx"


def _self_contained(
    spec: dict[str, Any], model_name: str, model_file: Path, work_dir: Path
) -> dict[str, Any]:
    """``spec`` with a function folder in ``work_dir`` holding its handler and its model.

    Note [functions in containers]: a container sees none of the evaluating host's files, only
    its ``code_dir`` (bind-mounted read-only, its working directory) and the store socket. So
    the handler module (copied from ``code_dir``) and the model file sit in one folder, and the
    model's ``source`` is relative to it: the worker resolves it in its working directory,
    inside the container as under the local executor. The model is named by the manifest, as
    the direct system under test names it: an instance maps it from the store when the store
    holds it (``trims models add NAME``), else it loads the staged file. The folder and its
    files are world-readable: the container's user (the function's own uid) is not the one that
    wrote them.
    """
    import shutil

    code_dir = Path(spec["code_dir"])
    top = str(spec["handler"]).partition(":")[0].split(".")[0]
    folder = work_dir / "functions" / spec["name"]
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for path in (folder.parent, folder):
        path.chmod(0o755)
    if (code_dir / f"{top}.py").is_file():
        shutil.copyfile(code_dir / f"{top}.py", folder / f"{top}.py")
    elif (code_dir / top).is_dir():
        shutil.copytree(code_dir / top, folder / top, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        raise NotFound(
            f"handler module {top!r} is neither {code_dir / (top + '.py')} nor a package folder "
            "there; pass the folder of the ONNX handler (--code-dir)",
            field="code_dir",
        )
    shutil.copyfile(model_file, folder / STAGED_MODEL)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    (model,) = spec["models"]
    return {
        **spec,
        "code_dir": str(folder),
        "models": [{**model, "name": model_name, "source": STAGED_MODEL}],
    }


def _open_text_sut(
    manifest: Manifest,
    sut_kind: str,
    *,
    gateway: GatewayTarget | None,
    socket_path: str | Path | None,
    threads: int,
) -> tuple[SystemUnderTest, str]:
    """A text manifest (BYTES input with a tokenization, e.g. all-MiniLM-L6-v2): tokenized
    and embedded in this process, or the ``examples/minilm`` function invoked with JSON."""
    from trims.evaluation.harness.sut_text import (
        TextFunctionSUT,
        direct_text_sut,
        text_function_spec,
    )

    if sut_kind == "gateway":
        assert gateway is not None
        spec = text_function_spec(
            manifest, _function_name(manifest), executor=gateway.executor, threads=threads
        )
        sut = TextFunctionSUT.deploy(
            gateway.url, spec, token=gateway.token, output=manifest.outputs[0].name
        )
        return sut, manifest.model.sources[0].sha256 or ""
    return direct_text_sut(manifest, socket_path=socket_path, threads=threads)


def _open_sut(
    manifest: Manifest,
    sut_kind: str,
    *,
    work_dir: Path,
    gateway: GatewayTarget | None,
    socket_path: str | Path | None,
    threads: int,
    mxnet_python: str | None,
) -> tuple[SystemUnderTest, str]:
    """The system under test for ``manifest`` and the model digest."""
    from trims.evaluation.harness.manifest import file_sha256
    from trims.evaluation.harness.sut import (
        DirectSUT,
        GatewaySUT,
        onnx_function_spec,
        torch_function_spec,
    )
    from trims.evaluation.harness.sut_text import is_text_manifest

    framework = manifest.framework.name
    if framework == "torch" and is_text_manifest(manifest):
        return _open_text_sut(
            manifest, sut_kind, gateway=gateway, socket_path=socket_path, threads=threads
        )
    if framework == "torch":
        first, output = manifest.inputs[0], manifest.outputs[0].name
        if sut_kind == "gateway":
            assert gateway is not None
            module, close, digest = torch_model(manifest, socket_path=socket_path)
            if close is not None:
                close()
            del module
            spec = torch_function_spec(
                _function_name(manifest), manifest.model_dump(mode="json"), input_name=first.name,
                input_dims=first.dims, output_name=output, executor=gateway.executor,
                threads=threads,
            )  # fmt: skip
            return GatewaySUT.deploy(gateway.url, spec, token=gateway.token), digest
        module, close, digest = torch_model(manifest, socket_path=socket_path)
        sut = DirectSUT.torch(
            manifest.name, module, input_name=first.name, output_name=output,
            threads=threads, on_close=close,
        )  # fmt: skip
        return sut, digest
    path = manifest_model_file(manifest, work_dir)
    digest = file_sha256(path)
    if framework == "mxnet":
        import onnx

        from trims.evaluation.harness.sut_mxnet import MxnetSUT, mxnet_function_spec, mxnet_spec

        graph = mxnet_spec(manifest.name, onnx.load(str(path)))
        if sut_kind == "gateway":
            assert gateway is not None
            spec = mxnet_function_spec(
                _function_name(manifest), graph, executor=gateway.executor, threads=threads
            )
            return GatewaySUT.deploy(gateway.url, spec, token=gateway.token), digest
        return MxnetSUT(manifest.name, graph, threads=threads, python=mxnet_python), digest
    if sut_kind == "gateway":
        assert gateway is not None
        spec = onnx_function_spec(
            _function_name(manifest), path, code_dir=gateway.code_dir,
            executor=gateway.executor, threads=threads,
        )  # fmt: skip
        if gateway.executor == "docker":
            spec = _self_contained(spec, manifest.name, path, work_dir)
        return GatewaySUT.deploy(gateway.url, spec, token=gateway.token), digest
    sut = DirectSUT.onnx(manifest.name, path, threads=threads, socket_path=socket_path)
    return sut, digest


def metric_predictions(manifest: Manifest, outputs: Sequence[Any]) -> np.ndarray:
    """The accuracy run's outputs (sample-index order) as the manifest's metric takes them.

    Note [ranked recommendations]: top-1/top-5 take each sample's scores (``top_k`` ranks
    them), but precision@k takes each user's *ranked item indices*: a recommender's output is
    one score per item, so its scores are ranked here (best first, ties to the lower index, as
    the reference :func:`trims.evaluation.harness.prepare.als_reference` ranks them) and the
    first ``k`` items are what counts as recommended. Reading the raw scores as item indices
    gave precision@10 0.0036 for a model whose reference is 0.1072.
    """
    from trims.evaluation.harness.accuracy import top_k

    rows = np.stack([np.asarray(p).reshape(-1) for p in outputs])
    if manifest.accuracy is not None and manifest.accuracy.metric == "precision_at_k":
        return top_k(rows, manifest.accuracy.k or 10)
    return rows


def _run_pipeline(
    manifest: Manifest,
    version: str,
    scenario: str,
    mode: str,
    settings: LoadGenSettings | None,
    *,
    work_dir: Path,
    gateway: GatewayTarget,
    batch: int,
    workers: int,
    threads: int,
) -> ManifestRun:
    """The manifest's model served by its shipped pipeline (``pipeline_sut.PIPELINES``),
    end to end: raw samples (e.g. PNGs) in, the pipeline's answer out, each stage timed."""
    from trims.evaluation.harness.manifest import file_sha256
    from trims.evaluation.harness.pipeline_sut import PipelineSUT, pipeline_example, pipeline_specs

    example = pipeline_example(manifest.name)
    path = manifest_model_file(manifest, work_dir)
    inputs, labels = example.samples(manifest.dataset.split, manifest.dataset.samples)
    real = manifest.accuracy is not None
    samples = SampleSet(
        inputs, labels if real else None, example.scores if real else None,
        name=f"{manifest.dataset.name}/{manifest.dataset.split} via pipeline",
    )  # fmt: skip
    functions, pipeline = pipeline_specs(manifest.name, path, executor=gateway.executor)
    sut = PipelineSUT.deploy(
        gateway.url, functions, pipeline, token=gateway.token, content_type=example.content_type
    )
    run, value = _run_and_score(
        manifest, sut, samples, scenario, mode, settings, batch=batch, workers=workers
    )
    return ManifestRun(
        manifest, version, "pipeline", run, value, len(inputs), model_digest=file_sha256(path),
        batch=batch, threads=threads, settings=settings,
    )  # fmt: skip


def _run_and_score(
    manifest: Manifest,
    sut: Any,
    samples: SampleSet,
    scenario: str,
    mode: str,
    settings: Any,
    *,
    batch: int,
    workers: int,
) -> tuple[ScenarioRun, float | None]:
    """Run ``scenario`` on ``sut`` (closed afterwards), then the manifest's metric over the
    accuracy run's predictions when there is one, with real labels."""
    from trims.evaluation.harness.accuracy import score

    try:
        run = run_scenario(sut, samples, scenario, mode, settings, batch=batch, workers=workers)
    finally:
        sut.close()
    if run.accuracy is None or manifest.accuracy is None or samples.labels is None:
        return run, None
    predictions = metric_predictions(manifest, run.predictions())
    return run, score(manifest.accuracy.metric, predictions, samples.labels, manifest.accuracy.k)


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
    mxnet_python: str | None = None,
    framework_version: str | None = None,
) -> ManifestRun:
    """Evaluate a manifest (torch, onnxruntime or mxnet) on a system under test.

    ``direct``: the model in this process (torch module, ONNX Runtime session; MXNet in its
    child process); ``gateway``: deployed as a function on ``gateway`` (torch and onnxruntime).
    Unless ``framework_version`` says the checks already passed, :func:`check_manifest` runs
    first: nothing runs when it fails. ``work_dir`` holds built models (readable by the
    gateway's workers); ``socket_path``: the store the model is mapped from when its daemon
    runs (by the manifest's name). ``threads``: intra-op threads (direct) or the function's
    cores and threads (gateway). Accuracy is computed only for real weights with labels.
    """

    if sut_kind == "gateway" and gateway is None:
        raise ValidationError("a gateway system under test needs the gateway (GatewayTarget)")
    version = framework_version or check_manifest(manifest, sut_kind)
    if sut_kind == "pipeline":
        if gateway is None:
            raise ValidationError("a pipeline system under test needs the gateway (GatewayTarget)")
        return _run_pipeline(
            manifest, version, scenario, mode, settings, work_dir=work_dir, gateway=gateway,
            batch=batch, workers=workers, threads=threads,
        )  # fmt: skip
    samples = manifest_samples(manifest)
    output = manifest.outputs[0].name
    if manifest.accuracy is not None and samples.labels is not None:
        samples = SampleSet(
            samples.inputs, samples.labels, lambda out: out[output], name=samples.name
        )
    sut, digest = _open_sut(
        manifest, sut_kind, work_dir=work_dir, gateway=gateway, socket_path=socket_path,
        threads=threads, mxnet_python=mxnet_python,
    )  # fmt: skip
    run, value = _run_and_score(
        manifest, sut, samples, scenario, mode, settings, batch=batch, workers=workers
    )
    return ManifestRun(
        manifest, version, sut_kind, run, value, len(samples.inputs),
        model_digest=digest, batch=batch, threads=threads, settings=settings,
        executor=(gateway.executor or "local") if gateway and sut_kind == "gateway" else "local",
    )  # fmt: skip
