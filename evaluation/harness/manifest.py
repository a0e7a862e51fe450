"""The evaluation manifest: one YAML file that describes a model evaluation, as one typed model.

A manifest names the model (identity, task), the framework and the version range it needs, where
the model's files come from (with sha256), its inputs and outputs with their pre- and
post-processing, the dataset it is evaluated on and the accuracy metric with a reference value.
:class:`Manifest` is the single definition: validation errors with field paths and the published
JSON Schema (``docs/schemas/manifest.schema.json``) are both generated from it.

:func:`load_manifest` reads a file and turns every problem into one
:class:`trims.errors.ValidationError` whose message has one line per problem, each naming the
file and the field path. Checks that need the machine (is the framework installed in a version
the manifest accepts, do the source files match their sha256) are separate calls:
:meth:`Manifest.check_stack` and :meth:`Manifest.verify_sources`.

Note [model sources]: a source is exactly one of ``url`` (http, https or s3, fetched by the
store's cloud tier), ``path`` (a local file relative to the manifest, or ``package:TOP/REL`` for a
file shipped inside an installed package, e.g.
``package:onnx/backend/test/data/light/light_squeezenet.onnx``) or ``builder`` (the model is made
by project code, reproducibly by seed: ``torch:<arch>`` for the PyTorch families,
``prepare:<name>`` for :mod:`trims.evaluation.harness.prepare`, ``example:<dir>`` for
``examples/<dir>/prepare.py`` of a source checkout). ``url`` and ``path`` need a
sha256; a builder's output has none to pin, because it depends on the framework's version.
A pretrained state dict (format torch or safetensors) names the module its weights fill in
``model.module`` (``prepare:<name>``): the module is built empty by project code and the
weights come through the project's loading path (``open_model(...).torch_module(build)``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from trims.errors import CorruptModel, NotFound, ValidationError

__all__ = [
    "FRAMEWORK_DISTRIBUTIONS",
    "SCHEMA_PATH",
    "Accuracy",
    "DatasetRef",
    "Framework",
    "Input",
    "Manifest",
    "ModelSpec",
    "Output",
    "Postprocessing",
    "Preprocessing",
    "Source",
    "Tokenization",
    "file_sha256",
    "installed_version",
    "load_manifest",
    "manifest_schema",
    "resolve_path",
    "shipped_manifest_paths",
]

log = logging.getLogger(__name__)

Task = Literal["classification", "embedding", "general", "recommendation"]
FrameworkName = Literal["torch", "onnxruntime", "mxnet"]
Weights = Literal["pretrained", "trained-here", "random", "constant"]
Metric = Literal["top1", "top5", "cosine_spearman", "precision_at_k"]
ModelFormat = Literal["safetensors", "torch", "onnx", "mxnet"]
ElementType = Literal["FP32", "FP16", "FP64", "INT64", "INT32", "INT8", "UINT8", "BOOL", "BYTES"]
OutputType = Literal["logits", "probabilities", "embedding", "scores"]

#: the published JSON Schema, relative to the repository root
SCHEMA_PATH = Path("docs/schemas/manifest.schema.json")

#: framework name -> distributions whose installed version is the framework's version, in order
FRAMEWORK_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "mxnet": ("mxnet",),
}

_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_SHA256_RE = r"^[0-9a-f]{64}$"
_BUILDER_RE = r"^(torch|prepare|example):[A-Za-z0-9][A-Za-z0-9._-]*$"
_MODULE_RE = r"^prepare:[A-Za-z0-9][A-Za-z0-9._-]*$"
_PACKAGE = "package:"
_CHUNK = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Framework(_Strict):
    """The framework that runs the model and the versions it is known to work with."""

    name: FrameworkName
    version: str = Field(
        default="",
        description="a PEP 440 specifier, e.g. '>=2.1,<3'; empty accepts any version",
        examples=[">=2.1"],
    )

    @field_validator("version")
    @classmethod
    def _specifier(cls, value: str) -> str:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        try:
            SpecifierSet(value)
        except InvalidSpecifier as e:
            raise ValueError(f"not a PEP 440 specifier ({e}); write e.g. '>=2.1,<3'") from None
        return value


class Source(_Strict):
    """One file of the model: exactly one of url, path or builder (Note [model sources])."""

    url: str | None = Field(default=None, pattern=r"^(https?|s3)://\S+$")
    path: str | None = Field(
        default=None,
        min_length=1,
        description="relative to the manifest file, or package:TOP/REL inside an installed package",
    )
    builder: str | None = Field(
        default=None,
        pattern=_BUILDER_RE,
        description="torch:<arch> (families), prepare:<name> (harness.prepare), example:<dir>",
    )
    sha256: str | None = Field(default=None, pattern=_SHA256_RE)

    @model_validator(mode="after")
    def _one_kind(self) -> Source:
        given = [k for k in ("url", "path", "builder") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of url, path or builder (got {', '.join(given) or 'none'})"
            )
        if self.builder is None and self.sha256 is None:
            raise ValueError(f"a {given[0]} source needs its sha256 (sha256sum FILE)")
        return self

    def describe(self) -> str:
        return self.url or self.path or self.builder or ""


class ModelSpec(_Strict):
    """Where the model comes from, in which format, and what its weights are."""

    sources: list[Source] = Field(
        min_length=1, description="the files that make up the model; at least one"
    )
    format: ModelFormat
    module: str | None = Field(
        default=None,
        pattern=_MODULE_RE,
        description=(
            "a state dict's torch module: prepare:<name> (harness.prepare.MODULES), "
            "built empty and filled with the source's weights (Model.torch_module)"
        ),
    )
    weights: Weights = Field(
        description=(
            "pretrained: published trained weights; trained-here: trained by prepare, by seed; "
            "random: seeded random initialization; constant: constant fills "
            "(performance only, never reported with an accuracy)"
        )
    )

    @model_validator(mode="after")
    def _module_needs_a_state_dict(self) -> ModelSpec:
        if self.module is not None and self.format not in ("torch", "safetensors"):
            raise ValueError(
                f"module applies to torch and safetensors state dicts, not {self.format}; remove it"
            )
        return self


class Tokenization(_Strict):
    """Text to token ids with a WordPiece vocabulary."""

    vocab: str = Field(min_length=1, description="vocab.txt: a path or package:TOP/REL")
    max_length: int = Field(default=256, ge=2)
    lowercase: bool = True


class Preprocessing(_Strict):
    """How a raw sample becomes the input tensor; image steps run in this order."""

    resize: int | None = Field(default=None, ge=1, description="shorter side, pixels")
    resize_mode: Literal["bilinear", "nearest"] = Field(
        default="bilinear",
        description=(
            "bilinear (pixel centres), or nearest: source pixel floor(i * in / out), as "
            "torch's interpolate(mode='nearest')"
        ),
    )
    center_crop: int | None = Field(default=None, ge=1, description="square side, pixels")
    pad: int | None = Field(
        default=None, ge=1, description="zero pixels added on each side, after resize and crop"
    )
    scale: float | None = Field(
        default=None, gt=0, description="multiply pixel values first, e.g. 1/255"
    )
    mean: list[float] | None = Field(default=None, description="per channel, subtracted")
    std: list[float] | None = Field(default=None, description="per channel, divided by")
    color_order: Literal["RGB", "BGR", "GRAY"] | None = Field(
        default=None,
        description=(
            "BGR: swap the channels last; GRAY: one channel (RGB to ITU-R BT.601 luma, done "
            "first, so mean and std have one value)"
        ),
    )
    tokenization: Tokenization | None = None

    @model_validator(mode="after")
    def _channels(self) -> Preprocessing:
        if self.mean is not None and self.std is not None and len(self.mean) != len(self.std):
            raise ValueError("mean and std need one value per channel each")
        if self.std is not None and any(s <= 0 for s in self.std):
            raise ValueError("std values must be > 0")
        return self


class Input(_Strict):
    name: str = Field(min_length=1)
    element_type: ElementType
    layout: Literal["NCHW", "NHWC", "NC", "N"] | None = None
    dims: list[int] = Field(description="per sample, without the batch; -1 for a variable size")
    preprocessing: Preprocessing | None = None

    @field_validator("dims")
    @classmethod
    def _dims(cls, value: list[int]) -> list[int]:
        if any(d == 0 or d < -1 for d in value):
            raise ValueError("each dimension must be > 0, or -1 for a variable size")
        return value


class Postprocessing(_Strict):
    softmax: bool = False
    top_k: int | None = Field(default=None, ge=1)
    labels: str | None = Field(default=None, description="one label a line: a path or package:")
    normalize: bool = Field(default=False, description="L2-normalize feature vectors")


class Output(_Strict):
    name: str = Field(min_length=1)
    type: OutputType
    postprocessing: Postprocessing | None = None


class DatasetRef(_Strict):
    """Which dataset the evaluation draws its samples from (see harness.datasets)."""

    name: str = Field(pattern=_NAME_RE)
    split: str = Field(default="test", min_length=1)
    samples: int = Field(default=1000, ge=1, description="at most this many samples")


class Accuracy(_Strict):
    metric: Metric
    k: int | None = Field(default=None, ge=1, description="precision_at_k only")
    reference: float = Field(ge=0.0, le=1.0, description="a fraction in [0, 1]")
    provenance: str = Field(min_length=1, description="where the reference value comes from")

    @model_validator(mode="after")
    def _k(self) -> Accuracy:
        if self.metric == "precision_at_k" and self.k is None:
            raise ValueError("precision_at_k needs k")
        if self.metric != "precision_at_k" and self.k is not None:
            raise ValueError(f"k applies to precision_at_k only, not {self.metric}")
        return self


class Manifest(_Strict):
    """One model evaluation: identity, framework, model, inputs, outputs, dataset, accuracy."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        title="trims evaluation manifest",
        json_schema_extra={"$id": "https://trims.dev/schemas/manifest.schema.json"},
    )

    name: str = Field(pattern=_NAME_RE)
    version: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
    description: str = ""
    license: str = ""
    references: list[str] = Field(default_factory=list)
    task: Task
    framework: Framework
    model: ModelSpec
    inputs: list[Input] = Field(min_length=1)
    outputs: list[Output] = Field(min_length=1)
    dataset: DatasetRef
    accuracy: Accuracy | None
    attributes: dict[str, Any] = Field(default_factory=dict)

    _file: Path | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _accuracy_needs_real_weights(self) -> Manifest:
        if self.accuracy is not None and self.model.weights in ("constant", "random"):
            raise ValueError(
                f"model.weights is {self.model.weights}: such a model is performance-only; "
                "set accuracy: null"
            )
        return self

    @property
    def base_dir(self) -> Path | None:
        """The folder of the file the manifest was loaded from (relative paths start there)."""
        return None if self._file is None else self._file.parent

    @property
    def file(self) -> Path | None:
        """The file the manifest was loaded from; None when built in code."""
        return self._file

    def check_stack(self, installed: Mapping[str, str] | None = None) -> str:
        """The installed framework version; ValidationError if the constraint refuses it.

        ``installed`` maps framework name -> version (for a remote stack); by default the
        version is looked up on this machine (MXNet: in its own environment).
        """
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        name = self.framework.name
        version = (installed or {}).get(name) or installed_version(name)
        constraint = SpecifierSet(self.framework.version)
        try:
            ok = Version(version) in constraint or constraint.contains(version, prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            raise ValidationError(
                f"{self._where()}framework.version: installed {name} {version} does not satisfy "
                f"{self.framework.version!r}; install a matching {name} or widen the constraint",
                field="framework.version",
                installed=version,
                constraint=self.framework.version,
            )
        return version

    def verify_sources(self) -> list[Path]:
        """Check every local source against its sha256 (streaming); return the files checked.

        url sources are verified by the store when it fetches them; builder sources have no
        digest (Note [model sources]).
        """
        checked: list[Path] = []
        for i, source in enumerate(self.model.sources):
            if source.path is None or source.sha256 is None:
                continue
            field = f"model.sources[{i}].path"
            path = resolve_path(source.path, self.base_dir, field=f"{self._where()}{field}")
            actual = file_sha256(path)
            if actual != source.sha256:
                raise CorruptModel(
                    f"{self._where()}{field}: {path} has sha256 {actual}, the manifest expects "
                    f"{source.sha256}; the file changed or the manifest is stale",
                    field=field,
                    file=str(path),
                    expected=source.sha256,
                    actual=actual,
                )
            checked.append(path)
        return checked

    def resolve(self, path: str) -> Path:
        """A path or package: reference from this manifest as a file on this machine."""
        return resolve_path(path, self.base_dir)

    def _where(self) -> str:
        return f"{self._file}: " if self._file else ""


def manifest_schema() -> dict[str, Any]:
    """The JSON Schema of a manifest file, generated from :class:`Manifest`."""
    return Manifest.model_json_schema()


def installed_version(framework: str) -> str:
    """The version of ``framework`` installed for evaluations; NotFound if there is none."""
    if framework == "mxnet":
        from trims.evaluation.mxnet_backend import find_python, framework_version

        try:
            return str(framework_version(find_python()))
        except Exception as e:
            raise NotFound(f"mxnet is not installed: {e}") from e
    for dist in FRAMEWORK_DISTRIBUTIONS.get(framework, (framework,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise NotFound(f"{framework} is not installed; pip install 'trims[{framework}]'")


def resolve_path(path: str, base_dir: Path | None, field: str = "path") -> Path:
    """A manifest path as a file: ``package:TOP/REL`` inside an installed package, else relative
    to ``base_dir``. NotFound names the field and what to install when the file is missing."""
    if path.startswith(_PACKAGE):
        top, _, rel = path.removeprefix(_PACKAGE).partition("/")
        located: Path | None = None
        if importlib.util.find_spec(top) is not None:
            located = Path(str(importlib.resources.files(top).joinpath(rel)))
        else:
            try:
                located = Path(str(importlib.metadata.distribution(top).locate_file(rel)))
            except importlib.metadata.PackageNotFoundError:
                raise NotFound(
                    f"{field}: {path}: package {top!r} is not installed; pip install {top}",
                    field=field,
                ) from None
        if not located.is_file():
            raise NotFound(
                f"{field}: {path}: no such file in the installed package {top!r} ({located}); "
                f"reinstall {top}",
                field=field,
            )
        return located
    local = Path(path)
    if not local.is_absolute() and base_dir is not None:
        local = base_dir / local
    if not local.is_file():
        raise NotFound(f"{field}: no such file {local}", field=field)
    return local


def load_manifest(path: str | Path, *, check_dataset: bool = True) -> Manifest:
    """Read and validate one manifest file.

    Every problem becomes one line of one ValidationError naming the file and the field path:
    unknown fields, wrong types, a missing model source, an invalid framework constraint, and
    (``check_dataset``) a dataset the registry does not know or cannot find on this machine.
    """
    import yaml

    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise NotFound(f"{file}: cannot read the manifest: {e.strerror}", file=str(file)) from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValidationError(f"{file}: not valid YAML: {e}", file=str(file)) from e
    if not isinstance(data, dict):
        raise ValidationError(
            f"{file}: a manifest is a mapping of fields, got {type(data).__name__}",
            file=str(file),
        )
    try:
        manifest = Manifest.model_validate(data)
    except PydanticValidationError as e:
        problems = list(_problems(e))
        raise ValidationError(
            "\n".join(f"{file}: {field}: {msg}" for field, msg in problems),
            file=str(file),
            fields=[field for field, _ in problems],
        ) from None
    manifest._file = file.resolve()
    if check_dataset:
        from trims.evaluation.harness import datasets

        try:
            datasets.check(manifest.dataset.name, manifest.dataset.split)
        except (NotFound, ValidationError) as e:
            raise type(e)(f"{file}: dataset: {e.message}", file=str(file), field="dataset") from e
    return manifest


def shipped_manifest_paths() -> list[Path]:
    """The manifests installed with trims (``trims.evaluation.manifests``), sorted by name."""
    folder = importlib.resources.files("trims.evaluation.manifests")
    return sorted(
        Path(str(entry)) for entry in folder.iterdir() if entry.name.endswith((".yaml", ".yml"))
    )


def _problems(error: PydanticValidationError) -> Iterator[tuple[str, str]]:
    for item in error.errors(include_url=False):
        loc = item["loc"]
        field = _field_path(loc)
        kind = item["type"]
        if kind == "extra_forbidden":
            allowed = _allowed_fields(loc[:-1])
            yield field, f"unknown field; allowed here: {', '.join(allowed)}"
        elif kind == "missing":
            yield field, "required field is missing"
        elif kind == "too_short" and field.endswith("sources"):
            yield field, "at least one model source (url, path or builder) is required"
        else:
            got = item.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
            yield field, f"{item['msg'].removeprefix('Value error, ')}{shown}"


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in part:
            out += f".{part}" if out else part
        # a part with "[" is a validator tag pydantic inserts; the user never wrote it
    return out or "(top level)"


def _allowed_fields(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = Manifest
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            break
        inner = _model_of(field.annotation)
        if inner is None:
            break
        model = inner
    return sorted(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def file_sha256(path: Path) -> str:
    """The sha256 of a file, hex, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
