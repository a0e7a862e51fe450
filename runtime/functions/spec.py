"""Function specs: what a function is (code + models + resources + scaling), parsed and checked.

One typed model is the contract. :func:`parse_spec` turns a mapping into a frozen
:class:`FunctionSpec` or raises :class:`ValidationError` whose message names the field
(``scaling.concurrency: must be an integer >= 1, got 0``); ``schema.FUNCTION_SCHEMA`` is the
JSON Schema generated from these same classes for the gateway's OpenAPI document and the
Function CRD. A rule JSON Schema cannot express (``min_instances <= max_instances``, unique model
keys, env key names in a Kubernetes structural schema) is written once here as a check and,
beside it, as the CEL rule the CRD carries (``cel_rule``).

The classes are pydantic dataclasses: real frozen dataclasses (``dataclasses.replace`` works and
validates), compared by value, and validated whenever they are built.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal, get_args

import pydantic
from pydantic import (
    AfterValidator,
    AliasChoices,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from trims.config import parse_size
from trims.errors import ValidationError
from trims.runtime.functions.validation import cel_rule, describe_errors, hint, rule_error

__all__ = [
    "DATATYPES",
    "FRAMEWORKS",
    "FunctionSpec",
    "ModelRef",
    "Resources",
    "Scaling",
    "ServedModel",
    "TensorMeta",
    "environment_name",
    "load_spec_file",
    "parse_spec",
]

# Note [patterns]: every pattern is anchored and spelled so that pydantic (Rust regex), the
# Kubernetes API server (Go RE2), OpenAPI clients (ECMA-262) and Python agree: '^...$' (in all
# of them but Python's re.search '$' is the end of the string; a name never ends in a newline),
# explicit ASCII classes instead of \w, no lookaround. These names become file names (the
# gateway's state dir), label values and URL paths.
FUNCTION_NAME = hint(
    r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
    "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit",
)
_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,99}"
HANDLER = hint(
    rf"^{_IDENT}(\.{_IDENT}){{0,15}}:{_IDENT}$", "'module:function' (e.g. 'handler:handle')"
)
ENV_NAME = hint(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", "an environment variable name")

#: Environment every executor gives a worker unless the executor's settings or the spec set
#: the variable. Note [passive OpenMP threads]: an OpenMP runtime (libgomp, which torch's CPU
#: build uses) keeps its threads spinning for a while after each parallel region by default.
#: One process alone gains a little latency from that; instances sharing a node's cores burn
#: them: with two instances of a small torch MLP on two cores at 16 requests in flight, about
#: 85% of the busy worker's CPU was libgomp spinning and it answered 222 req/s; passive waits
#: gave 1,205 req/s (p50 at c=1 0.5 ms slower). On a shared node an idle-spinning instance
#: takes CPU from the others, so passive is the default. Its price: threads that slept through
#: an idle spell wake slowly, and a 512 MiB model's first two passes after half a second idle
#: took 35-50% longer on a 2-core VM (``GOMP_SPINCOUNT=3000`` in the gateway's environment
#: avoids that, at about 20% of a small model's throughput there; docs/runtime.md). libgomp
#: reads the variable once, when loaded: a spec's own value reaches instances the zygote forks
#: only when the zygote has it too (set it in the gateway's environment), and reaches spawned
#: processes and containers directly.
WORKER_ENV_DEFAULTS: Mapping[str, str] = MappingProxyType({"OMP_WAIT_POLICY": "PASSIVE"})
#: The store's model name rule (trims.layout): no '..' anywhere, at most 128 characters.
MODEL_NAME = hint(
    r"^[A-Za-z0-9]([A-Za-z0-9_-]|\.[A-Za-z0-9_-])*\.?$",
    "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, without '..'",
)
VERSION = hint(
    r"^[A-Za-z0-9]([A-Za-z0-9_+-]|\.[A-Za-z0-9_+-])*\.?$",
    "1-64 letters, digits, '.', '_', '+' or '-', starting with a letter or digit, without '..'",
)
EXECUTOR_NAME = hint(
    r"^[a-z][a-z0-9-]{0,62}$", "an executor name such as local, docker or kubernetes"
)
#: The same rule as EXECUTOR_NAME, spelled apart so that its errors say what it names.
ENVIRONMENT_NAME = hint(
    r"^[a-z][-a-z0-9]{0,62}$",
    "an environment name the gateway declares, such as mxnet "
    "(1-63 lowercase letters, digits or '-', starting with a letter)",
)
CODE_DIR = hint(
    r"^/[^\x00-\x1f\x7f]*$",
    "an absolute path without control characters (a spec file's relative one is resolved)",
)
#: A '..' path component; JSON Schema states it as ``not: {pattern: DOT_DOT}``.
DOT_DOT = r"(^|/)\.\.(/|$)"
SIZE = hint(
    r"^\s*([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)\s*([kKmMgGtT][iI]?[bB]?|[bB])?\s*$",
    "a size in bytes > 0 or a string like '512MiB'",
)
#: Bounds that keep the CRD's CEL rules within the API server's cost budget.
MAX_MODELS = 64
MAX_ENV = 256

Framework = Literal["numpy", "torch", "onnxruntime", "mxnet"]
Tier = Literal["cpu", "gpu", "disk"]
#: Open Inference Protocol tensor datatypes.
Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
]  # fmt: skip
FRAMEWORKS: tuple[str, ...] = get_args(Framework)
TIERS: tuple[str, ...] = get_args(Tier)
DATATYPES: tuple[str, ...] = get_args(Datatype)


def _size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError("size", "must be a size in bytes or a string like '512MiB'")
    try:
        size = parse_size(value)
    except ValidationError as e:
        raise PydanticCustomError("size", "{reason}", {"reason": e.message}) from e
    if size <= 0:
        raise PydanticCustomError("size", "must be > 0")
    return size


def _scalar_text(value: object) -> object:
    """Numbers written without quotes in YAML (``OMP_NUM_THREADS: 1``, ``version: 2``)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return value


def _env_value(value: object) -> object:
    value = _scalar_text(value)
    if not isinstance(value, str):
        raise PydanticCustomError("env_value", "must be a string")
    return value


def _code_dir(path: str) -> str:
    """Whether it exists and may hold code is checked at deploy (code_rules), where the host is."""
    if not path.isprintable():
        raise PydanticCustomError("code_dir", "must be a printable path")
    if re.search(DOT_DOT, path):
        raise PydanticCustomError("code_dir", "must not contain '..' components")
    return path


def _json_copy(value: Mapping[str, Any]) -> Mapping[str, Any]:
    try:
        copied = json.loads(json.dumps(dict(value)))
    except (TypeError, ValueError) as e:
        raise PydanticCustomError("json", "must be JSON-serializable ({e})", {"e": str(e)}) from e
    return MappingProxyType(copied)


def _frozen(value: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(value))


def _plain_dict(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


Text = Annotated[str, StringConstraints(strict=True, min_length=1)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
Count = Annotated[int, Field(strict=True, ge=0)]
PositiveNumber = Annotated[float, Field(strict=True, gt=0)]
Size = Annotated[
    int,
    BeforeValidator(_size),
    WithJsonSchema(
        {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": SIZE}]}
    ),
]
FunctionName = Annotated[str, StringConstraints(strict=True, pattern=FUNCTION_NAME)]
Handler = Annotated[str, StringConstraints(strict=True, pattern=HANDLER)]
ModelName = Annotated[str, StringConstraints(strict=True, max_length=128, pattern=MODEL_NAME)]
Version = Annotated[
    str,
    StringConstraints(strict=True, max_length=64, pattern=VERSION),
    BeforeValidator(_scalar_text),
]
EnvName = Annotated[str, StringConstraints(strict=True, pattern=ENV_NAME)]
EnvValue = Annotated[
    str,
    BeforeValidator(_env_value),
    WithJsonSchema({"type": ["string", "number"]}),
]
ExecutorName = Annotated[str, StringConstraints(strict=True, pattern=EXECUTOR_NAME)]
EnvironmentName = Annotated[str, StringConstraints(strict=True, pattern=ENVIRONMENT_NAME)]
CodeDir = Annotated[
    str,
    StringConstraints(strict=True, max_length=4096, pattern=CODE_DIR),
    AfterValidator(_code_dir),
]

_NO_UNKNOWN_FIELDS = ConfigDict(extra="forbid")


def _model_key(m: str) -> str:
    return f"(has({m}.alias) ? {m}.alias : {m}.name)"


@dataclass(frozen=True, config=_NO_UNKNOWN_FIELDS)
class ModelRef:
    """A model the function needs; acquired from the store before ``init(ctx)`` runs."""

    name: ModelName
    version: Version | None = None
    #: Path or URL the instance loads directly when no store daemon is reachable.
    source: Text | None = None
    framework: Framework = "numpy"
    tier: Tier = "cpu"
    #: The key under which the function finds it in ``ctx.models`` (default: ``name``).
    alias: ModelName | None = None

    @property
    def key(self) -> str:
        return self.alias or self.name


def _memory_alias(schema: dict[str, Any]) -> None:
    """``memory`` is the spelling people write; ``memory_bytes`` the one ``to_dict`` writes."""
    schema["properties"]["memory"] = schema["properties"]["memory_bytes"]
    schema["not"] = {"required": ["memory", "memory_bytes"]}


@dataclass(frozen=True, config=ConfigDict(extra="forbid", json_schema_extra=_memory_alias))
class Resources:
    #: CPU cores (fractions allowed); None = no limit.
    cpus: PositiveNumber | None = None
    #: Memory limit in bytes beyond what the preloaded frameworks map; None = no limit.
    memory_bytes: Size | None = Field(
        default=None, validation_alias=AliasChoices("memory_bytes", "memory")
    )
    gpus: Count = 0

    @model_validator(mode="before")
    @classmethod
    def _one_memory(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "memory" in data and "memory_bytes" in data:
            raise rule_error("memory", "give memory or memory_bytes, not both")
        return data


_MIN_INSTANCES = 0
_MAX_INSTANCES = 4
_MIN_MAX = (
    f"(has(self.min_instances) ? self.min_instances : {_MIN_INSTANCES}) <= "
    f"(has(self.max_instances) ? self.max_instances : {_MAX_INSTANCES})"
)


@dataclass(
    frozen=True,
    config=ConfigDict(
        extra="forbid",
        json_schema_extra=cel_rule(_MIN_MAX, "min_instances must not exceed max_instances"),
    ),
)
class Scaling:
    min_instances: Count = _MIN_INSTANCES
    max_instances: PositiveInt = _MAX_INSTANCES
    #: Instances kept prepared but not started (Note [standby instances] in
    #: trims.runtime.gateway.pool): models mapped, code imported, ``init`` not run; a scale-up
    #: takes one and runs only ``init``. Not serving, so not counted in min/max_instances.
    standby: Count = 0
    #: Requests one instance handles at once (sync handlers get a thread pool this size).
    concurrency: PositiveInt = 1
    #: Requests waiting for an instance before the gateway answers 429.
    queue_size: Count = 64
    #: Seconds an instance may sit idle before it is stopped (scale to zero).
    idle_timeout_s: PositiveNumber = 60.0
    #: Seconds one request may take before the gateway answers 504.
    request_timeout_s: PositiveNumber = 30.0
    max_body_bytes: Size = 16 << 20

    @model_validator(mode="after")
    def _min_below_max(self) -> Scaling:
        if self.min_instances > self.max_instances:
            raise rule_error(
                "min_instances",
                f"must not exceed scaling.max_instances ({self.max_instances}), "
                f"got {self.min_instances}",
            )
        return self


@dataclass(frozen=True, config=_NO_UNKNOWN_FIELDS)
class TensorMeta:
    """One input or output of a served model (Open Inference Protocol metadata)."""

    name: Text
    datatype: Datatype
    #: -1 marks a variable dimension (the batch, a sequence length).
    shape: tuple[Annotated[int, Field(strict=True, ge=-1)], ...]


@dataclass(frozen=True, config=_NO_UNKNOWN_FIELDS)
class ServedModel:
    """Declares that the function's module defines ``infer(inputs, ctx)`` for these tensors."""

    inputs: Annotated[tuple[TensorMeta, ...], Field(min_length=1)]
    outputs: Annotated[tuple[TensorMeta, ...], Field(min_length=1)]
    platform: Text = "trims"
    versions: Annotated[
        tuple[Annotated[Text, BeforeValidator(_scalar_text)], ...], Field(min_length=1)
    ] = ("1",)


_UNIQUE_KEYS = f"self.all(a, self.exists_one(b, {_model_key('b')} == {_model_key('a')}))"
_ENV_KEYS = f"self.all(k, k.matches('{ENV_NAME}'))"


@dataclass(
    frozen=True,
    config=ConfigDict(
        extra="forbid",
        json_schema_extra={"anyOf": [{"required": ["handler"]}, {"required": ["image"]}]},
    ),
)
class FunctionSpec:
    name: FunctionName
    handler: Handler | None = Field(
        default=None,
        description="module:function of the HTTP handler; the module may also define "
        "init(ctx) and infer(inputs, ctx). It must be a file or package in code_dir (or one of "
        "the project's benchmark modules, trims.kernels.* / trims.evaluation.*)",
    )
    code_dir: CodeDir | None = Field(
        default=None,
        description="absolute directory put first on sys.path so the handler module imports "
        "from it; no '..', no system or trims directory (checked at deploy)",
        json_schema_extra={"not": {"pattern": DOT_DOT}},
    )
    image: Text | None = Field(
        default=None,
        description="container image that runs the trims worker (docker, kubernetes executors)",
    )
    models: tuple[ModelRef, ...] = Field(
        default=(),
        max_length=MAX_MODELS,
        json_schema_extra=cel_rule(
            _UNIQUE_KEYS, "two models have the same key; give one of them an 'alias'"
        ),
    )
    resources: Resources = dataclasses.field(default_factory=Resources)
    scaling: Scaling = dataclasses.field(default_factory=Scaling)
    env: Annotated[
        Mapping[EnvName, EnvValue], AfterValidator(_frozen), PlainSerializer(_plain_dict)
    ] = Field(
        default_factory=lambda: MappingProxyType({}),
        max_length=MAX_ENV,
        json_schema_extra=cel_rule(_ENV_KEYS, "env keys must be environment variable names"),
    )
    config: Annotated[
        Mapping[str, Any], AfterValidator(_json_copy), PlainSerializer(_plain_dict)
    ] = Field(
        default_factory=lambda: MappingProxyType({}),
        description="free-form JSON the handler reads as ctx.config",
    )
    executor: ExecutorName | None = Field(
        default=None,
        description="executor name (local, docker, kubernetes); default: the gateway's. The "
        "gateway checks at deploy that it has such an executor",
    )
    serves: ServedModel | None = None
    environment: EnvironmentName | None = Field(
        default=None,
        description="the Python environment the local executor runs the function in, by the "
        "name the gateway declares (--environment NAME=PYTHON); default: the gateway's own "
        "interpreter. Checked at deploy",
    )

    @model_validator(mode="after")
    def _rules(self) -> FunctionSpec:
        if self.handler is None and self.image is None:
            raise rule_error(
                "handler", "a function needs a handler ('module:function') or an image"
            )
        keys = [m.key for m in self.models]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            raise rule_error("models", f"{dup!r} is listed twice; give one of them an 'alias'")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``parse_spec(spec.to_dict()) == spec``."""
        out: dict[str, Any] = _ADAPTER.dump_python(self, mode="json", exclude_none=True)
        for key in ("models", "env", "config"):
            if not out.get(key):
                out.pop(key, None)
        return out


_ADAPTER: pydantic.TypeAdapter[FunctionSpec] = pydantic.TypeAdapter(FunctionSpec)


def parse_spec(data: Mapping[str, Any]) -> FunctionSpec:
    """Validate ``data`` and build the spec; ValidationError names the first bad field."""
    if not isinstance(data, Mapping):
        raise ValidationError(f"spec: must be an object, got {type(data).__name__}", field="spec")
    try:
        return _ADAPTER.validate_python(dict(data))
    except pydantic.ValidationError as e:
        raise describe_errors(e, FunctionSpec) from None


def environment_name(value: Any) -> str | None:
    """An environment name; the gateway checks at deploy that its settings declare it."""
    try:
        return _ENVIRONMENT.validate_python(value)
    except pydantic.ValidationError as e:
        raise describe_errors(e, FunctionSpec, root="environment") from None


_ENVIRONMENT: pydantic.TypeAdapter[str | None] = pydantic.TypeAdapter(EnvironmentName | None)


def _resolve_source(model: Any, base: Path) -> Any:
    if not isinstance(model, Mapping):
        return model
    source = model.get("source")
    if not isinstance(source, str) or "://" in source or Path(source).is_absolute():
        return model
    return {**model, "source": str((base / source).resolve())}


def load_spec_file(path: Path) -> FunctionSpec:
    """Read a YAML or JSON spec; a relative ``code_dir`` is resolved against the file's folder."""
    import yaml

    try:
        text = path.read_text()
    except OSError as e:
        raise ValidationError(f"cannot read function spec {path}: {e.strerror}") from e
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ValidationError(f"{path}: not valid YAML/JSON: {e}") from e
    if not isinstance(data, Mapping):
        raise ValidationError(f"{path}: a function spec must be a mapping at the top level")
    data = dict(data)
    code_dir = data.get("code_dir")
    if isinstance(code_dir, str) and ".." in Path(code_dir).parts:
        raise ValidationError(
            f"{path}: code_dir: must not contain '..' components, got {code_dir!r}",
            field="code_dir",
        )
    if isinstance(code_dir, str) and not Path(code_dir).is_absolute():
        data["code_dir"] = str((path.parent / code_dir).resolve())
    elif code_dir is None and data.get("handler") and data.get("image") is None:
        data["code_dir"] = str(path.parent.resolve())
    models = data.get("models")
    if isinstance(models, list):
        data["models"] = [_resolve_source(m, path.parent) for m in models]
    try:
        return parse_spec(data)
    except ValidationError as e:
        raise ValidationError(f"{path}: {e.message}", **e.details) from e
