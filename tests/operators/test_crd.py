"""The Function CRD: valid for the API server, in sync with the chart, and it accepts the same
function specs the gateway does (checked with jsonschema against its OpenAPI v3 schema)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from trims.errors import ValidationError
from trims.operators.crd import API_VERSION, KIND, crd_manifest, structural
from trims.operators.reconcile import function_spec
from trims.runtime.functions.schema import FUNCTION_SCHEMA

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "helm" / "trims" / "crds" / "function.yaml"


def function_schema() -> dict[str, Any]:
    (version,) = crd_manifest()["spec"]["versions"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def function_object(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": "fns", "uid": "u-1", "generation": 1},
        "spec": spec,
    }


def check(obj: dict[str, Any]) -> None:
    """Validate like the API server would: OpenAPI v3.0 (draft-4 style exclusiveMinimum)."""
    jsonschema.Draft4Validator(function_schema()).validate(obj)


def example_objects() -> list[dict[str, Any]]:
    objects = []
    for path in sorted((ROOT / "examples").glob("*/function.yaml")):
        data = yaml.safe_load(path.read_text())
        name = data.pop("name")
        objects.append(function_object(name, data))
    return objects


def test_crd_is_a_valid_custom_resource_definition() -> None:
    kubernetes_validate.validate(crd_manifest(), "1.30.0", strict=True)
    jsonschema.Draft4Validator.check_schema(function_schema())


def test_chart_ships_the_same_crd() -> None:
    shipped = yaml.safe_load(CHART_CRD.read_text())
    assert shipped == json.loads(json.dumps(crd_manifest())), (
        "helm/trims/crds/function.yaml is stale: run "
        "'trims operator crd > helm/trims/crds/function.yaml'"
    )


def test_schema_is_structural() -> None:
    """Every node has a type (or int-or-string / preserve-unknown-fields), no properties beside
    additionalProperties, no oneOf over types: what apiextensions/v1 requires."""

    def walk(node: dict[str, Any], path: str) -> None:
        assert (
            "type" in node
            or node.get("x-kubernetes-int-or-string")
            or node.get("x-kubernetes-preserve-unknown-fields")
        ), f"{path}: no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        assert "oneOf" not in node and "$schema" not in node, path
        for key, sub in (node.get("properties") or {}).items():
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}{{}}")

    walk(function_schema(), "")


def test_example_functions_are_valid_function_objects() -> None:
    objects = example_objects()
    assert len(objects) >= 4
    for obj in objects:
        check(obj)
        spec, replicas = function_spec(obj)
        assert spec.name == obj["metadata"]["name"] and replicas == 1


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"replicas": -1}, "replicas"),
        ({"scaling": {"concurrency": 0}}, "concurrency"),
        ({"resources": {"cpus": 0}}, "cpus"),
        ({"models": [{"name": "m", "framework": "caffe"}]}, "framework"),
        ({"handler": "not a handler"}, "handler"),
    ],
)
def test_invalid_specs_are_rejected_by_the_schema(patch: dict[str, Any], field: str) -> None:
    obj = function_object("bad", {"handler": "handler:handler", **patch})
    with pytest.raises(jsonschema.ValidationError) as info:
        check(obj)
    assert field in json.dumps(list(info.value.absolute_path)) + info.value.message


def test_a_spec_without_handler_or_image_is_rejected_by_both() -> None:
    obj = function_object("nothing", {"scaling": {"max_instances": 2}})
    with pytest.raises(jsonschema.ValidationError):
        check(obj)
    with pytest.raises(ValidationError):
        function_spec(obj)


def test_structural_rejects_what_it_cannot_express() -> None:
    schema = copy.deepcopy(FUNCTION_SCHEMA)
    schema["properties"]["x"] = {"oneOf": [{"type": "boolean"}, {"type": "array"}]}
    with pytest.raises(ValueError, match="oneOf"):
        structural(schema)
    keys = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}
    with pytest.raises(ValueError, match="propertyNames"):
        structural({"type": "object", "properties": {"labels": keys}})


def test_int_or_string_keeps_the_bounds_of_both_branches() -> None:
    size = {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^[1-9]"}]}
    assert structural(size) == {
        "x-kubernetes-int-or-string": True,
        "minimum": 1,
        "pattern": "^[1-9]",
    }
