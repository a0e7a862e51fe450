"""One contract, three enforcers: every spec the model refuses, the generated JSON Schema (the
OpenAPI component) and the Function CRD refuse too, by a schema keyword or by the CEL rule the
schema carries; every spec the model accepts, they accept."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from trims.errors import ValidationError
from trims.operators.crd import API_VERSION, KIND, crd_manifest
from trims.runtime.functions.schema import FUNCTION_SCHEMA
from trims.runtime.functions.spec import parse_spec

ROOT = Path(__file__).resolve().parents[3]
BASE: dict[str, Any] = {"name": "fn", "handler": "handler:handler"}
TENSOR = {"name": "x", "datatype": "FP32", "shape": [-1]}


def serves(**patch: Any) -> dict[str, Any]:
    return {"serves": {"inputs": [TENSOR], "outputs": [TENSOR], **patch}}


def tensor(**patch: Any) -> dict[str, Any]:
    return {"serves": {"inputs": [{**TENSOR, **patch}], "outputs": [TENSOR]}}


#: (spec patch, the field the model's error names). "handler": None removes the handler.
INVALID: list[tuple[dict[str, Any], str]] = [
    # the four the hand-written schema used to accept
    ({"env": {"1BAD": "x"}}, "env.1BAD"),
    ({"resources": {"memory": "0"}}, "resources.memory"),
    ({"scaling": {"min_instances": 3, "max_instances": 2}}, "scaling.min_instances"),
    ({"models": [{"name": "m"}, {"name": "m"}]}, "models"),
    # and every other rule
    ({"name": "Bad_Name"}, "name"),
    ({"name": "x" * 64}, "name"),
    ({"name": "echo\n"}, "name"),
    ({"name": "-echo"}, "name"),
    ({"handler": None}, "handler"),
    ({"handler": "no-colon"}, "handler"),
    ({"handler": "handler:handler\n"}, "handler"),
    ({"handler": "hændler:handler"}, "handler"),
    ({"handler": 5}, "handler"),
    ({"code_dir": "relative/dir"}, "code_dir"),
    ({"code_dir": "/srv/../../etc"}, "code_dir"),
    ({"code_dir": "/srv/.."}, "code_dir"),
    ({"code_dir": "/srv/fn\n"}, "code_dir"),
    ({"code_dir": "/" + "a" * 4096}, "code_dir"),
    ({"image": ""}, "image"),
    ({"models": "resnet"}, "models"),
    ({"models": [3]}, "models[0]"),
    ({"models": [{}]}, "models[0].name"),
    ({"models": [{"name": "../etc"}]}, "models[0].name"),
    ({"models": [{"name": "a..b"}]}, "models[0].name"),
    ({"models": [{"name": "resnet\n"}]}, "models[0].name"),
    ({"models": [{"name": "m" * 129}]}, "models[0].name"),
    ({"models": [{"name": "m", "version": "1\n"}]}, "models[0].version"),
    ({"models": [{"name": "m", "version": "1..2"}]}, "models[0].version"),
    ({"models": [{"name": "m", "alias": "a/b"}]}, "models[0].alias"),
    ({"models": [{"name": "m", "framework": "caffe"}]}, "models[0].framework"),
    ({"models": [{"name": "m", "tier": "tape"}]}, "models[0].tier"),
    ({"models": [{"name": "m", "source": ""}]}, "models[0].source"),
    ({"models": [{"name": "m", "colour": "blue"}]}, "models[0].colour"),
    ({"models": [{"name": "a"}, {"name": "b", "alias": "a"}]}, "models"),
    ({"models": [{"name": f"m{i}"} for i in range(65)]}, "models"),
    ({"resources": {"cpus": 0}}, "resources.cpus"),
    ({"resources": {"cpus": "1"}}, "resources.cpus"),
    ({"resources": {"memory": "lots"}}, "resources.memory"),
    ({"resources": {"memory": 0}}, "resources.memory"),
    ({"resources": {"memory": -1}}, "resources.memory"),
    ({"resources": {"memory_bytes": "0GiB"}}, "resources.memory_bytes"),
    ({"resources": {"memory": "1GiB", "memory_bytes": 1}}, "resources.memory"),
    ({"resources": {"gpus": -1}}, "resources.gpus"),
    ({"resources": {"gpus": 1.5}}, "resources.gpus"),
    ({"resources": {"disk": 1}}, "resources.disk"),
    ({"scaling": {"min_instances": -1}}, "scaling.min_instances"),
    ({"scaling": {"min_instances": 5}}, "scaling.min_instances"),
    ({"scaling": {"max_instances": 0}}, "scaling.max_instances"),
    ({"scaling": {"concurrency": 0}}, "scaling.concurrency"),
    ({"scaling": {"queue_size": -1}}, "scaling.queue_size"),
    ({"scaling": {"idle_timeout_s": 0}}, "scaling.idle_timeout_s"),
    ({"scaling": {"request_timeout_s": "fast"}}, "scaling.request_timeout_s"),
    ({"scaling": {"max_body_bytes": "0"}}, "scaling.max_body_bytes"),
    ({"scaling": {"burst": 1}}, "scaling.burst"),
    ({"env": {"PATH\n": "x"}}, "env.PATH\n"),
    ({"env": {"A": True}}, "env.A"),
    ({"env": {"A": ["x"]}}, "env.A"),
    ({"env": "A=x"}, "env"),
    ({"env": {f"K{i}": "v" for i in range(257)}}, "env"),
    ({"config": "top_k=5"}, "config"),
    ({"executor": "Not An Executor!"}, "executor"),
    ({"executor": "local\n"}, "executor"),
    ({"environment": "/usr/bin/python"}, "environment"),
    ({"serves": {"outputs": [TENSOR]}}, "serves.inputs"),
    (serves(inputs=[]), "serves.inputs"),
    (serves(versions=[]), "serves.versions"),
    (serves(platform=""), "serves.platform"),
    (serves(batch=True), "serves.batch"),
    (tensor(datatype="F32"), "serves.inputs[0].datatype"),
    (tensor(shape=3), "serves.inputs[0].shape"),
    (tensor(shape=[-2]), "serves.inputs[0].shape[0]"),
    (tensor(name=""), "serves.inputs[0].name"),
    (tensor(layout="NCHW"), "serves.inputs[0].layout"),
    ({"colour": "blue"}, "colour"),
]

FULL: dict[str, Any] = {
    "name": "resnet",
    "handler": "pkg.handler:handle",
    "code_dir": "/srv/fn",
    "image": "registry.local/fn:1",
    "models": [
        {"name": "resnet50", "version": "1.2.0+cu121", "framework": "torch", "source": "/m.pt"},
        {"name": "resnet50", "alias": "backup", "tier": "disk"},
    ],
    "resources": {"cpus": 1.5, "memory": "512MiB", "gpus": 1},
    "scaling": {"min_instances": 2, "max_instances": 2, "concurrency": 4, "max_body_bytes": 1024},
    "env": {"OMP_NUM_THREADS": "1", "_X": "y"},
    "config": {"top_k": 5, "labels": ["a"]},
    "executor": "kubernetes",
    "environment": "mxnet",
    **serves(platform="pytorch_libtorch", versions=["1", "2"]),
}


def spec_of(patch: dict[str, Any]) -> dict[str, Any]:
    spec = {**BASE, **copy.deepcopy(patch)}
    return {k: v for k, v in spec.items() if v is not None}


def _ecma_pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[jsonschema.ValidationError]:
    """'pattern' as ECMA-262 and Go RE2 read it: '$' is the end of the string (Python's
    re.search also lets it match before a final newline)."""
    strict = re.sub(r"(?<!\\)\$", r"\\Z", pattern)
    if validator.is_type(instance, "string") and not re.search(strict, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


OpenApiValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"pattern": _ecma_pattern}
)
CrdValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _ecma_pattern})


def crd_schema() -> dict[str, Any]:
    (version,) = crd_manifest()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def field_validation(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema as the API server applies it to ``kubectl apply`` (whose default is
    --validate=strict): a structural schema prunes unknown fields, strict field validation
    refuses them instead."""
    out = {k: field_validation(v) if isinstance(v, dict) else v for k, v in schema.items()}
    if "properties" in out:
        out["properties"] = {k: field_validation(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def function_object(spec: dict[str, Any]) -> dict[str, Any]:
    body = dict(spec)
    metadata = {"name": body.pop("name"), "namespace": "fns"}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": body}


def cel_failures(schema: dict[str, Any], value: Any) -> list[str]:
    """The messages of the x-kubernetes-validations rules ``value`` breaks, evaluated where
    the API server evaluates them: at each node of the schema, with ``self`` the value there."""
    celpy = pytest.importorskip("celpy", reason="cel-python evaluates the CRD's CEL rules")
    env = celpy.Environment()
    failed = [
        rule["message"]
        for rule in schema.get("x-kubernetes-validations", [])
        if not env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(value)})
    ]
    if isinstance(value, dict):
        for key, sub in value.items():
            node = (schema.get("properties") or {}).get(key, schema.get("additionalProperties"))
            if isinstance(node, dict):
                failed += cel_failures(node, sub)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            failed += cel_failures(schema["items"], item)
    return failed


def refused(validator: Any, schema: dict[str, Any], instance: dict[str, Any]) -> bool:
    """Whether the schema's keywords refuse ``instance``, or else one of its CEL rules."""
    if not validator(schema).is_valid(instance):
        return True
    return bool(cel_failures(schema, instance))


@pytest.mark.parametrize(("patch", "field"), INVALID, ids=[f for _, f in INVALID])
def test_every_invalid_spec_is_refused_by_the_model_and_both_schemas(
    patch: dict[str, Any], field: str
) -> None:
    spec = spec_of(patch)
    with pytest.raises(ValidationError) as err:
        parse_spec(spec)
    assert err.value.details["field"] == field
    assert err.value.message.startswith(f"{field}: ")
    assert refused(OpenApiValidator, FUNCTION_SCHEMA, spec), "the OpenAPI schema accepts it"
    crd = field_validation(crd_schema())
    assert refused(CrdValidator, crd, function_object(spec)), "the CRD accepts it"


def valid_specs() -> list[dict[str, Any]]:
    specs = [BASE, FULL, parse_spec(FULL).to_dict(), {"name": "img", "image": "fn:1"}]
    for path in sorted((ROOT / "examples").glob("*/function.yaml")):
        specs.append(yaml.safe_load(path.read_text()))
    return specs


@pytest.mark.parametrize("spec", valid_specs(), ids=lambda s: s["name"])
def test_every_valid_spec_is_accepted_by_the_model_and_both_schemas(spec: dict[str, Any]) -> None:
    parse_spec(spec)
    assert not refused(OpenApiValidator, FUNCTION_SCHEMA, spec)
    assert not refused(CrdValidator, field_validation(crd_schema()), function_object(spec))


def test_rules_json_schema_cannot_state_are_cel_rules_in_the_crd() -> None:
    spec = crd_schema()["properties"]["spec"]["properties"]

    def rules(node: dict[str, Any]) -> list[str]:
        return [r["rule"] for r in node.get("x-kubernetes-validations", [])]

    assert rules(spec["scaling"]) == [
        "(has(self.min_instances) ? self.min_instances : 0) <= "
        "(has(self.max_instances) ? self.max_instances : 4)"
    ]
    assert rules(spec["models"]) == [
        "self.all(a, self.exists_one(b, (has(b.alias) ? b.alias : b.name) == "
        "(has(a.alias) ? a.alias : a.name)))"
    ]
    assert rules(spec["env"]) == ["self.all(k, k.matches('^[A-Za-z_][A-Za-z0-9_]{0,127}$'))"]
    assert rules(crd_schema()) == [
        "self.metadata.name.matches('^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$')"
    ]
    assert "propertyNames" not in spec["env"]
    # the CEL cost estimate needs bounds on what the rules iterate over
    assert spec["models"]["maxItems"] and spec["env"]["maxProperties"]
    assert spec["models"]["items"]["properties"]["name"]["maxLength"]


def test_the_defaults_in_the_cel_rule_are_the_models() -> None:
    scaling = parse_spec(BASE).scaling
    rule = crd_schema()["properties"]["spec"]["properties"]["scaling"]
    assert f": {scaling.min_instances})" in rule["x-kubernetes-validations"][0]["rule"]
    assert f": {scaling.max_instances})" in rule["x-kubernetes-validations"][0]["rule"]
