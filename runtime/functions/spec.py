"""Function specs: what a function is (code + models + resources + scaling), parsed and checked.

One schema serves YAML/JSON files and API bodies. :func:`parse_spec` turns a mapping into a
frozen :class:`FunctionSpec` or raises :class:`ValidationError` whose message names the field
(``scaling.concurrency: must be an integer >= 1, got 0``); :data:`FUNCTION_SCHEMA` (in
``schema.py``) is the same contract as JSON Schema for the gateway's OpenAPI document.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from trims.config import parse_size
from trims.errors import ValidationError
from trims.layout import validate_model_name, validate_version
from trims.runtime.functions.schema import FUNCTION_SCHEMA

__all__ = [
    "FUNCTION_SCHEMA",
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

# Note [full-string names]: every pattern here is applied with ``fullmatch``. ``re.match`` with
# ``$`` accepts a trailing newline ("echo\n"), and these names become file names (the gateway's
# state dir), label values and URL paths. \w is ASCII-only (re.ASCII) for the same reason.
FUNCTION_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
HANDLER_RE = re.compile(r"[A-Za-z_]\w{0,99}(\.[A-Za-z_]\w{0,99}){0,15}:[A-Za-z_]\w{0,99}", re.ASCII)
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
#: A model name in a spec: the store's rule (trims.layout), as a full-string match.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
FRAMEWORKS = ("numpy", "torch", "onnxruntime", "mxnet")
TIERS = ("cpu", "gpu", "disk")
#: Open Inference Protocol tensor datatypes.
DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BYTES",
)  # fmt: skip
SPEC_KEYS = frozenset(
    {"name", "handler", "code_dir", "image", "models", "resources", "scaling", "env", "config",
     "executor", "serves", "environment"}
)  # fmt: skip


@dataclass(frozen=True)
class ModelRef:
    """A model the function needs; acquired from the store before ``init(ctx)`` runs."""

    name: str
    version: str | None = None
    #: Path or URL the instance loads directly when no store daemon is reachable.
    source: str | None = None
    framework: str = "numpy"
    tier: str = "cpu"
    #: The key under which the function finds it in ``ctx.models`` (default: ``name``).
    alias: str | None = None

    @property
    def key(self) -> str:
        return self.alias or self.name


@dataclass(frozen=True)
class Resources:
    #: CPU cores (fractions allowed); None = no limit.
    cpus: float | None = None
    #: Memory limit in bytes beyond what the preloaded frameworks map; None = no limit.
    memory_bytes: int | None = None
    gpus: int = 0


@dataclass(frozen=True)
class Scaling:
    min_instances: int = 0
    max_instances: int = 4
    #: Requests one instance handles at once (sync handlers get a thread pool this size).
    concurrency: int = 1
    #: Requests waiting for an instance before the gateway answers 429.
    queue_size: int = 64
    #: Seconds an instance may sit idle before it is stopped (scale to zero).
    idle_timeout_s: float = 60.0
    #: Seconds one request may take before the gateway answers 504.
    request_timeout_s: float = 30.0
    max_body_bytes: int = 16 << 20


@dataclass(frozen=True)
class TensorMeta:
    """One input or output of a served model (Open Inference Protocol metadata)."""

    name: str
    datatype: str
    #: -1 marks a variable dimension (the batch, a sequence length).
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ServedModel:
    """Declares that the function's module defines ``infer(inputs, ctx)`` for these tensors."""

    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    platform: str = "trims"
    versions: tuple[str, ...] = ("1",)


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    #: "module:function" of the HTTP handler; the module may also define init(ctx), infer().
    handler: str | None = None
    #: Directory put first on sys.path so the handler module imports from it.
    code_dir: str | None = None
    #: Container image that runs the trims worker (docker / kubernetes executors).
    image: str | None = None
    models: tuple[ModelRef, ...] = ()
    resources: Resources = field(default_factory=Resources)
    scaling: Scaling = field(default_factory=Scaling)
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: Executor name ("local", "docker", "kubernetes"); None = the gateway's default.
    executor: str | None = None
    serves: ServedModel | None = None
    #: The Python environment the local executor runs the function in, by the name the
    #: gateway's settings give it (``--environment mxnet=/venv/bin/python``); None = the
    #: gateway's own interpreter. Checked at deploy.
    environment: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; ``parse_spec(spec.to_dict()) == spec``."""
        out: dict[str, Any] = {"name": self.name}
        for key in ("handler", "code_dir", "image", "executor", "environment"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.models:
            out["models"] = [_drop_none(vars(m)) for m in self.models]
        out["resources"] = _drop_none(vars(self.resources))
        out["scaling"] = dict(vars(self.scaling))
        if self.env:
            out["env"] = dict(self.env)
        if self.config:
            out["config"] = json.loads(json.dumps(dict(self.config)))
        if self.serves is not None:
            out["serves"] = {
                "inputs": [_tensor_dict(t) for t in self.serves.inputs],
                "outputs": [_tensor_dict(t) for t in self.serves.outputs],
                "platform": self.serves.platform,
                "versions": list(self.serves.versions),
            }
        return out


def _drop_none(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _tensor_dict(t: TensorMeta) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}


def _fail(path: str, what: str, value: Any) -> ValidationError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ValidationError(f"{path}: {what}, got {shown}", field=path)


def _mapping(value: Any, path: str, allowed: frozenset[str] | None = None) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(path, "must be an object", value)
    if allowed is not None:
        unknown = sorted(set(value) - allowed)
        if unknown:
            name = unknown[0] if path == "spec" else f"{path}.{unknown[0]}"
            raise ValidationError(
                f"{name}: unknown field; allowed: {', '.join(sorted(allowed))}", field=name
            )
    return value


def _str(value: Any, path: str, pattern: re.Pattern[str] | None = None, hint: str = "") -> str:
    if not isinstance(value, str) or not value:
        raise _fail(path, "must be a non-empty string", value)
    if pattern is not None and not pattern.fullmatch(value):
        raise _fail(path, f"must be {hint}", value)
    return value


def _opt_str(data: Mapping[str, Any], key: str, path: str) -> str | None:
    value = data.get(key)
    return None if value is None else _str(value, f"{path}{key}")


def _int(value: Any, path: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, f"must be an integer >= {minimum}", value)
    return value


def _number(value: Any, path: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(path, "must be a number", value)
    if positive and value <= 0:
        raise _fail(path, "must be > 0", value)
    return float(value)


def _size(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _fail(path, "must be a size in bytes or a string like '512MiB'", value)
    try:
        size = parse_size(value)
    except ValidationError as e:
        raise ValidationError(f"{path}: {e.message}", field=path) from e
    if size <= 0:
        raise _fail(path, "must be > 0", value)
    return size


def _model(value: Any, path: str) -> ModelRef:
    allowed = frozenset({"name", "version", "source", "framework", "tier", "alias"})
    data = _mapping(value, path, allowed)
    raw_name = data.get("name")
    if not isinstance(raw_name, str) or not MODEL_NAME_RE.fullmatch(raw_name):
        raise _fail(
            f"{path}.name",
            "must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
            raw_name,
        )
    version = data.get("version")
    if version is not None and not VERSION_RE.fullmatch(str(version)):
        raise _fail(
            f"{path}.version", "must be 1-64 letters, digits, '.', '_', '+' or '-'", version
        )
    try:
        name = validate_model_name(raw_name)
        if version is not None:
            version = validate_version(str(version))
    except ValidationError as e:
        raise ValidationError(f"{path}: {e.message}", field=path) from e
    alias = data.get("alias")
    if alias is not None:
        alias = _str(alias, f"{path}.alias", MODEL_NAME_RE, "a name like the model's")
    framework = data.get("framework", "numpy")
    if framework not in FRAMEWORKS:
        raise _fail(f"{path}.framework", f"must be one of {', '.join(FRAMEWORKS)}", framework)
    tier = data.get("tier", "cpu")
    if tier not in TIERS:
        raise _fail(f"{path}.tier", f"must be one of {', '.join(TIERS)}", tier)
    return ModelRef(
        name=name,
        version=version,
        source=_opt_str(data, "source", f"{path}."),
        framework=framework,
        tier=tier,
        alias=alias,
    )


def _resources(value: Any) -> Resources:
    data = _mapping(value, "resources", frozenset({"cpus", "memory", "memory_bytes", "gpus"}))
    memory = data.get("memory_bytes", data.get("memory"))
    cpus = data.get("cpus")
    return Resources(
        cpus=None if cpus is None else _number(cpus, "resources.cpus"),
        memory_bytes=None if memory is None else _size(memory, "resources.memory"),
        gpus=_int(data.get("gpus", 0), "resources.gpus", 0),
    )


def _scaling(value: Any) -> Scaling:
    names = frozenset(Scaling.__dataclass_fields__)
    data = _mapping(value, "scaling", names)
    d = Scaling()
    s = Scaling(
        min_instances=_int(data.get("min_instances", d.min_instances), "scaling.min_instances", 0),
        max_instances=_int(data.get("max_instances", d.max_instances), "scaling.max_instances", 1),
        concurrency=_int(data.get("concurrency", d.concurrency), "scaling.concurrency", 1),
        queue_size=_int(data.get("queue_size", d.queue_size), "scaling.queue_size", 0),
        idle_timeout_s=_number(
            data.get("idle_timeout_s", d.idle_timeout_s), "scaling.idle_timeout_s"
        ),
        request_timeout_s=_number(
            data.get("request_timeout_s", d.request_timeout_s), "scaling.request_timeout_s"
        ),
        max_body_bytes=_size(
            data.get("max_body_bytes", d.max_body_bytes), "scaling.max_body_bytes"
        ),
    )
    if s.min_instances > s.max_instances:
        raise ValidationError(
            f"scaling.min_instances: must not exceed scaling.max_instances "
            f"({s.max_instances}), got {s.min_instances}",
            field="scaling.min_instances",
        )
    return s


def _tensor(value: Any, path: str) -> TensorMeta:
    data = _mapping(value, path, frozenset({"name", "datatype", "shape"}))
    datatype = data.get("datatype")
    if datatype not in DATATYPES:
        raise _fail(f"{path}.datatype", f"must be one of {', '.join(DATATYPES)}", datatype)
    shape = data.get("shape")
    if not isinstance(shape, list | tuple):
        raise _fail(f"{path}.shape", "must be a list of integers (-1 for any size)", shape)
    dims = tuple(_int(d, f"{path}.shape[{i}]", -1) for i, d in enumerate(shape))
    return TensorMeta(name=_str(data.get("name"), f"{path}.name"), datatype=datatype, shape=dims)


def _tensors(value: Any, path: str) -> tuple[TensorMeta, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise _fail(path, "must be a non-empty list of tensors", value)
    return tuple(_tensor(v, f"{path}[{i}]") for i, v in enumerate(value))


def _serves(value: Any) -> ServedModel:
    data = _mapping(value, "serves", frozenset({"inputs", "outputs", "platform", "versions"}))
    versions = data.get("versions", ["1"])
    if not isinstance(versions, list | tuple) or not versions:
        raise _fail("serves.versions", "must be a non-empty list of strings", versions)
    return ServedModel(
        inputs=_tensors(data.get("inputs"), "serves.inputs"),
        outputs=_tensors(data.get("outputs"), "serves.outputs"),
        platform=_str(data.get("platform", "trims"), "serves.platform"),
        versions=tuple(_str(str(v), f"serves.versions[{i}]") for i, v in enumerate(versions)),
    )


def _env(value: Any) -> Mapping[str, str]:
    data = _mapping(value, "env")
    out: dict[str, str] = {}
    for key, v in data.items():
        _str(key, f"env.{key}", ENV_NAME_RE, "an environment variable name")
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise _fail(f"env.{key}", "must be a string", v)
        out[key] = str(v)
    return MappingProxyType(out)


def _config(value: Any) -> Mapping[str, Any]:
    data = _mapping(value, "config")
    try:
        copied = json.loads(json.dumps(dict(data)))
    except (TypeError, ValueError) as e:
        raise ValidationError(f"config: must be JSON-serializable ({e})", field="config") from e
    return MappingProxyType(copied)


_EXECUTOR_RE = re.compile(r"[a-z][a-z0-9-]{0,62}")


def _executor(value: Any) -> str | None:
    """An executor name; the gateway checks at deploy that it has such an executor (it may have
    more than the built-in local, docker and kubernetes)."""
    if value is None:
        return None
    if not isinstance(value, str) or not _EXECUTOR_RE.fullmatch(value):
        raise _fail(
            "executor", "must be an executor name such as local, docker or kubernetes", value
        )
    return value


def environment_name(value: Any) -> str | None:
    """An environment name; the gateway checks at deploy that its settings declare it."""
    if value is None:
        return None
    if not isinstance(value, str) or not _EXECUTOR_RE.fullmatch(value):
        raise _fail(
            "environment",
            "must be an environment name the gateway declares, such as mxnet "
            "(1-63 lowercase letters, digits or '-', starting with a letter)",
            value,
        )
    return value


def _code_dir(value: Any) -> str | None:
    """An absolute path without ``..`` components; whether it exists and may hold code is
    checked at deploy (``trims.runtime.gateway.code_rules``), where the host is known."""
    if value is None:
        return None
    path = _str(value, "code_dir")
    if len(path) > 4096 or not path.isprintable():
        raise _fail("code_dir", "must be a printable path of at most 4096 characters", value)
    if not path.startswith("/"):
        raise _fail(
            "code_dir", "must be an absolute path (a spec file's relative one is resolved)", value
        )
    if ".." in path.split("/"):
        raise _fail("code_dir", "must not contain '..' components", value)
    return path


def parse_spec(data: Mapping[str, Any]) -> FunctionSpec:
    """Validate ``data`` and build the spec; ValidationError names the first bad field."""
    data = _mapping(data, "spec", SPEC_KEYS)
    name = _str(
        data.get("name"), "name", FUNCTION_NAME_RE,
        "1-63 lowercase letters, digits or '-', starting and ending with a letter or digit",
    )  # fmt: skip
    handler = data.get("handler")
    if handler is not None:
        handler = _str(handler, "handler", HANDLER_RE, "'module:function' (e.g. 'handler:handle')")
    image = _opt_str(data, "image", "")
    if handler is None and image is None:
        raise ValidationError(
            "handler: a function needs a handler ('module:function') or an image", field="handler"
        )
    models_raw = data.get("models", [])
    if not isinstance(models_raw, list | tuple):
        raise _fail("models", "must be a list of models", models_raw)
    models = tuple(_model(m, f"models[{i}]") for i, m in enumerate(models_raw))
    keys = [m.key for m in models]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValidationError(
            f"models: {dup!r} is listed twice; give one of them an 'alias'", field="models"
        )
    serves = data.get("serves")
    return FunctionSpec(
        name=name,
        handler=handler,
        code_dir=_code_dir(data.get("code_dir")),
        image=image,
        models=models,
        resources=_resources(data.get("resources", {})),
        scaling=_scaling(data.get("scaling", {})),
        env=_env(data.get("env", {})),
        config=_config(data.get("config", {})),
        executor=_executor(data.get("executor")),
        serves=None if serves is None else _serves(serves),
        environment=environment_name(data.get("environment")),
    )


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
