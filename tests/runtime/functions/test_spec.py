from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest

from trims.errors import ValidationError
from trims.runtime.functions.schema import FUNCTION_SCHEMA
from trims.runtime.functions.spec import FunctionSpec, load_spec_file, parse_spec

FULL: dict[str, Any] = {
    "name": "resnet",
    "handler": "handler:handler",
    "code_dir": "/srv/fn",
    "models": [{"name": "resnet50", "version": "1", "framework": "torch", "source": "/m.pt"}],
    "resources": {"cpus": 1.5, "memory": "512MiB"},
    "scaling": {"max_instances": 2, "concurrency": 4, "request_timeout_s": 5},
    "env": {"OMP_NUM_THREADS": "1"},
    "config": {"top_k": 5},
    "serves": {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "y", "datatype": "INT64", "shape": [-1]}],
    },
}


def test_minimal_spec_gets_the_documented_defaults() -> None:
    spec = parse_spec({"name": "echo", "handler": "handler:handler"})
    assert spec.scaling.concurrency == 1
    assert spec.scaling.max_instances == 4
    assert spec.scaling.max_body_bytes == 16 << 20
    assert spec.models == ()
    assert spec.resources.memory_bytes is None


def test_full_spec_round_trips_through_to_dict() -> None:
    spec = parse_spec(FULL)
    assert spec.resources.memory_bytes == 512 << 20
    assert spec.models[0].framework == "torch"
    assert spec.serves is not None and spec.serves.inputs[0].shape == (-1, 3)
    assert parse_spec(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"name": "Bad_Name"}, "name"),
        ({"handler": "no-colon"}, "handler"),
        ({"handler": None}, "handler"),
        ({"scaling": {"concurrency": 0}}, "scaling.concurrency"),
        ({"scaling": {"min_instances": 3, "max_instances": 2}}, "scaling.min_instances"),
        ({"scaling": {"request_timeout_s": "fast"}}, "scaling.request_timeout_s"),
        ({"resources": {"memory": "lots"}}, "resources.memory"),
        ({"models": [{"name": "m", "framework": "caffe"}]}, "models[0].framework"),
        ({"models": [{"name": "../etc"}]}, "models[0].name"),
        ({"models": [{"name": "m"}, {"name": "m"}]}, "models"),
        ({"serves": {"inputs": [{"name": "x", "datatype": "F32", "shape": [1]}],
                     "outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}},
         "serves.inputs[0].datatype"),
        ({"env": {"1BAD": "x"}}, "env.1BAD"),
        ({"executor": "Not An Executor!"}, "executor"),
        ({"colour": "blue"}, "colour"),
        ({"scaling": {"burst": 1}}, "scaling.burst"),
    ],
)  # fmt: skip
def test_invalid_fields_are_named_in_the_error(patch: dict[str, Any], field: str) -> None:
    data = {"name": "fn", "handler": "handler:handler", **patch}
    with pytest.raises(ValidationError) as err:
        parse_spec(data)
    assert err.value.message.startswith(f"{field}:")
    assert err.value.details["field"] == field


def test_json_schema_accepts_valid_and_rejects_invalid_specs() -> None:
    jsonschema.Draft202012Validator.check_schema(FUNCTION_SCHEMA)
    validator = jsonschema.Draft202012Validator(FUNCTION_SCHEMA)
    validator.validate(FULL)
    validator.validate(parse_spec(FULL).to_dict())
    for bad in ({"name": "fn"}, {"name": "fn", "handler": "h:h", "scaling": {"concurrency": 0}}):
        assert not validator.is_valid(bad)


def test_spec_file_resolves_code_dir_and_model_sources(tmp_path: Path) -> None:
    path = tmp_path / "function.yaml"
    path.write_text(
        "name: demo\nhandler: handler:handler\nmodels:\n  - name: m\n    source: weights.npz\n"
    )
    spec = load_spec_file(path)
    assert spec.code_dir == str(tmp_path.resolve())
    assert spec.models[0].source == str(tmp_path.resolve() / "weights.npz")


def test_spec_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "function.yaml"
    path.write_text("name: demo\nhandler: handler:handler\nscaling: {concurrency: -1}\n")
    with pytest.raises(ValidationError, match=r"function\.yaml: scaling\.concurrency"):
        load_spec_file(path)
    path.write_text("name: [unclosed\n")
    with pytest.raises(ValidationError, match="not valid YAML"):
        load_spec_file(path)


@pytest.mark.parametrize(
    "bad", ["echo\n", "echo\r", "../x", "a/b", "", "x" * 64, "echo\n\n", "Echo", "-echo"]
)
def test_function_names_must_match_in_full(bad: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"name": bad, "handler": "handler:handler"})
    assert err.value.details["field"] == "name"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"handler": "handler:handler\n"}, "handler"),
        ({"handler": "handler\n:handler"}, "handler"),
        ({"handler": "hændler:handler"}, "handler"),
        ({"env": {"PATH\n": "x"}}, "env.PATH\n"),
        ({"executor": "local\n"}, "executor"),
        ({"models": [{"name": "resnet\n"}]}, "models[0].name"),
        ({"models": [{"name": "m", "version": "1\n"}]}, "models[0].version"),
        ({"models": [{"name": "m", "alias": "a/b"}]}, "models[0].alias"),
        ({"code_dir": "relative/dir"}, "code_dir"),
        ({"code_dir": "/srv/../../etc"}, "code_dir"),
        ({"code_dir": "../../../../etc"}, "code_dir"),
        ({"code_dir": "/srv/fn\n"}, "code_dir"),
    ],
)  # fmt: skip
def test_names_and_code_dirs_that_could_escape_are_refused(
    patch: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"name": "fn", "handler": "handler:handler", **patch})
    assert err.value.details["field"] == field


def test_spec_file_refuses_dot_dot_in_a_relative_code_dir(tmp_path: Path) -> None:
    path = tmp_path / "function.yaml"
    path.write_text("name: demo\nhandler: handler:handler\ncode_dir: ../../etc\n")
    with pytest.raises(ValidationError, match=r"function\.yaml: code_dir: must not contain '\.\.'"):
        load_spec_file(path)


def test_specs_are_frozen_dataclasses_that_validate_whenever_built() -> None:
    spec = parse_spec({"name": "fn", "handler": "handler:handler", "env": {"A": 1}})
    assert spec.env == {"A": "1"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.env["B"] = "2"  # type: ignore[index]
    assert dataclasses.replace(spec.scaling, min_instances=2).min_instances == 2
    with pytest.raises(pydantic.ValidationError):
        dataclasses.replace(spec.scaling, min_instances=9)
    assert FunctionSpec(name="fn", handler="handler:handler", env={"A": "1"}) == spec


def test_errors_list_the_fields_a_section_allows() -> None:
    with pytest.raises(ValidationError) as err:
        parse_spec({"name": "fn", "handler": "h:h", "models": [{"name": "m", "colour": 1}]})
    assert err.value.message == (
        "models[0].colour: unknown field; allowed: alias, framework, name, source, tier, version"
    )
