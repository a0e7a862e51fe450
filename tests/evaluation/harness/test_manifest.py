"""The manifest model: every bad-input case is one error naming the file and field; the
published schema is current; every shipped manifest is valid against it."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from trims.errors import CorruptModel, NotFound, ValidationError
from trims.evaluation.harness.manifest import (
    SCHEMA_PATH,
    Manifest,
    load_manifest,
    manifest_schema,
    shipped_manifest_paths,
)

ROOT = Path(__file__).resolve().parents[3]

GOOD: dict[str, Any] = {
    "name": "tiny",
    "version": "1",
    "task": "classification",
    "framework": {"name": "onnxruntime", "version": ">=1.0"},
    "model": {
        "sources": [{"path": "model.onnx", "sha256": "0" * 64}],
        "format": "onnx",
        "weights": "trained-here",
    },
    "inputs": [{"name": "input", "element_type": "FP32", "layout": "NC", "dims": [64]}],
    "outputs": [{"name": "probabilities", "type": "probabilities"}],
    "dataset": {"name": "digits", "split": "test", "samples": 10},
    "accuracy": {"metric": "top1", "reference": 0.9, "provenance": "hand-made"},
}


def write(tmp_path: Path, data: dict[str, Any], name: str = "m.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def variant(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[last] = value
    return data


def test_good_manifest_loads(tmp_path: Path) -> None:
    m = load_manifest(write(tmp_path, GOOD))
    assert m.name == "tiny" and m.accuracy is not None and m.accuracy.reference == 0.9
    assert m.file == tmp_path / "m.yaml"
    with pytest.raises(Exception, match="frozen"):
        m.name = "other"  # type: ignore[misc]


def test_unknown_field_names_file_and_path(tmp_path: Path) -> None:
    path = write(tmp_path, variant(model__colour="red"))
    with pytest.raises(ValidationError) as e:
        load_manifest(path)
    lines = e.value.message.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"{path}: model.colour: unknown field; allowed here: format,")


def test_wrong_type_names_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, variant(dataset__samples="many"))
    with pytest.raises(ValidationError, match=r"m\.yaml: dataset\.samples: .*integer.*'many'"):
        load_manifest(path)


def test_every_problem_is_one_line(tmp_path: Path) -> None:
    data = variant(task="dancing", inputs__0__dims=[0])
    del data["outputs"]
    with pytest.raises(ValidationError) as e:
        load_manifest(write(tmp_path, data))
    fields = e.value.details["fields"]
    assert sorted(fields) == ["inputs[0].dims", "outputs", "task"]
    assert len(e.value.message.splitlines()) == 3


def test_missing_model_source(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"model\.sources: at least one model source"):
        load_manifest(write(tmp_path, variant(model__sources=[])))


def test_source_needs_exactly_one_kind_and_a_digest(tmp_path: Path) -> None:
    both = variant(model__sources=[{"path": "a.onnx", "builder": "prepare:x", "sha256": "0" * 64}])
    with pytest.raises(ValidationError, match=r"model\.sources\[0\]: give exactly one of"):
        load_manifest(write(tmp_path, both))
    bare = variant(model__sources=[{"url": "https://example.com/m.onnx"}])
    with pytest.raises(ValidationError, match=r"model\.sources\[0\]: a url source needs its sha"):
        load_manifest(write(tmp_path, bare))


def test_checksum_mismatch_names_file_expected_and_actual(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"not the model")
    actual = hashlib.sha256(b"not the model").hexdigest()
    m = load_manifest(write(tmp_path, GOOD))
    with pytest.raises(CorruptModel) as e:
        m.verify_sources()
    assert str(tmp_path / "model.onnx") in e.value.message
    assert "0" * 64 in e.value.message and actual in e.value.message
    assert e.value.details["field"] == "model.sources[0].path"


def test_checksum_match_and_missing_file(tmp_path: Path) -> None:
    body = b"model bytes"
    digest = hashlib.sha256(body).hexdigest()
    good = variant(model__sources=[{"path": "model.onnx", "sha256": digest}])
    m = load_manifest(write(tmp_path, good))
    with pytest.raises(NotFound, match=r"model\.sources\[0\]\.path: no such file"):
        m.verify_sources()
    (tmp_path / "model.onnx").write_bytes(body)
    assert m.verify_sources() == [tmp_path / "model.onnx"]


def test_package_source_resolves_inside_installed_package(tmp_path: Path) -> None:
    missing = variant(model__sources=[{"path": "package:onnx/no/such.onnx", "sha256": "0" * 64}])
    with pytest.raises(NotFound, match="no such file in the installed package 'onnx'"):
        load_manifest(write(tmp_path, missing)).verify_sources()
    source = {"path": "package:no_such_pkg_xyz/a.onnx", "sha256": "0" * 64}
    absent = variant(model__sources=[source])
    with pytest.raises(NotFound, match="package 'no_such_pkg_xyz' is not installed"):
        load_manifest(write(tmp_path, absent)).verify_sources()


def test_unsatisfiable_framework_constraint(tmp_path: Path) -> None:
    m = load_manifest(write(tmp_path, variant(framework__version=">=999")))
    with pytest.raises(ValidationError) as e:
        m.check_stack({"onnxruntime": "1.20.1"})
    expected = "framework.version: installed onnxruntime 1.20.1 does not satisfy '>=999'"
    assert expected in e.value.message
    assert str(tmp_path / "m.yaml") in e.value.message
    assert e.value.details == {
        "field": "framework.version",
        "installed": "1.20.1",
        "constraint": ">=999",
    }
    import onnxruntime

    ok = load_manifest(write(tmp_path, variant(framework__version=">=1.0"), "ok.yaml"))
    assert ok.check_stack() == onnxruntime.__version__


def test_invalid_specifier_is_a_field_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"framework\.version: not a PEP 440 specifier"):
        load_manifest(write(tmp_path, variant(framework__version="newest please")))


def test_dataset_not_found(tmp_path: Path) -> None:
    path = write(tmp_path, variant(dataset__name="imagenet-full"))
    with pytest.raises(NotFound, match=r"m\.yaml: dataset: no dataset 'imagenet-full'; choose"):
        load_manifest(path)
    with pytest.raises(ValidationError, match="dataset 'digits' has no split 'validation'"):
        load_manifest(write(tmp_path, variant(dataset__split="validation")))


def test_constant_weights_never_carry_an_accuracy(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="performance-only; set accuracy: null"):
        load_manifest(write(tmp_path, variant(model__weights="constant")))


def test_accuracy_reference_is_a_fraction_and_k_goes_with_precision(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"accuracy\.reference: .*less than or equal to 1"):
        load_manifest(write(tmp_path, variant(accuracy__reference=92.7)))
    p_at_k = variant(accuracy={"metric": "precision_at_k", "reference": 0.1, "provenance": "x"})
    with pytest.raises(ValidationError, match="precision_at_k needs k"):
        load_manifest(write(tmp_path, p_at_k))


def test_not_a_mapping_and_bad_yaml(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValidationError, match="a manifest is a mapping of fields, got list"):
        load_manifest(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ValidationError, match="not valid YAML"):
        load_manifest(tmp_path / "bad.yaml")


def test_published_schema_is_current() -> None:
    published = json.loads((ROOT / SCHEMA_PATH).read_text())
    assert published == manifest_schema(), (
        f"{SCHEMA_PATH} is stale; regenerate it from Manifest.model_json_schema() "
        "(see docs/evaluation.md, Manifests and datasets)"
    )


def test_shipped_manifests_are_valid_against_the_schema() -> None:
    import jsonschema

    schema = json.loads((ROOT / SCHEMA_PATH).read_text())
    validator = jsonschema.Draft202012Validator(schema)
    paths = shipped_manifest_paths()
    assert len(paths) >= 22
    for path in paths:
        data = yaml.safe_load(path.read_text())
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(data)]
        assert not errors, f"{path}: {errors}"
        m = load_manifest(path)
        assert m.verify_sources() is not None
    bad = dict(yaml.safe_load(paths[0].read_text()), colour="red")
    assert list(validator.iter_errors(bad)), "the schema must refuse unknown fields too"


def test_shipped_set_covers_the_projects_models() -> None:
    by_name = {m.name: m for m in map(load_manifest, shipped_manifest_paths())}
    zoo = [m for n, m in by_name.items() if n.startswith("onnx-")]
    assert len(zoo) == 9 and all(m.model.weights == "constant" and m.accuracy is None for m in zoo)
    families = [m for n, m in by_name.items() if n.startswith("torch-")]
    assert len(families) == 9 and all(m.model.weights == "random" for m in families)
    assert by_name["all-minilm-l6-v2"].model.weights == "pretrained"
    digits = by_name["digits-mlp"]
    assert digits.accuracy is not None and digits.accuracy.metric == "top1"
    als = by_name["als-ml100k"].accuracy
    assert als is not None and (als.metric, als.k) == ("precision_at_k", 10)
    assert isinstance(digits, Manifest)


def test_module_goes_with_a_state_dict_only(tmp_path: Path) -> None:
    onnx_with_module = variant(model__module="prepare:mnist-cnn")
    with pytest.raises(ValidationError, match=r"model: module applies to torch and safetensors"):
        load_manifest(write(tmp_path, onnx_with_module))
    not_prepare = variant(model__format="torch", model__module="ccexam.models:MNISTNet")
    with pytest.raises(ValidationError, match=r"m\.yaml: model\.module: .*pattern"):
        load_manifest(write(tmp_path, not_prepare))
    ok = load_manifest(write(tmp_path, variant(model__format="torch",
                                               model__module="prepare:mnist-cnn")))  # fmt: skip
    assert ok.model.module == "prepare:mnist-cnn"


def test_image_steps_pad_resize_mode_and_grayscale_are_checked(tmp_path: Path) -> None:
    pre = {"resize": 20, "resize_mode": "nearest", "pad": 4, "color_order": "GRAY"}
    m = load_manifest(write(tmp_path, variant(inputs__0__preprocessing=pre)))
    got = m.inputs[0].preprocessing
    assert got is not None and (got.resize_mode, got.pad, got.color_order) == ("nearest", 4, "GRAY")
    default = load_manifest(write(tmp_path, variant(inputs__0__preprocessing={"resize": 8})))
    assert default.inputs[0].preprocessing is not None
    assert default.inputs[0].preprocessing.resize_mode == "bilinear"
    bad = {"resize_mode": "cubic", "pad": 0}
    with pytest.raises(ValidationError) as e:
        load_manifest(write(tmp_path, variant(inputs__0__preprocessing=bad)))
    assert sorted(e.value.details["fields"]) == [
        "inputs[0].preprocessing.pad",
        "inputs[0].preprocessing.resize_mode",
    ]


def test_shipped_onnx_manifests_declare_their_models_real_inputs() -> None:
    """Each ONNX file manifest names the graph's real inputs (not initializers listed as
    inputs, as older zoo graphs do) with their dims after the batch dimension."""
    onnx = pytest.importorskip("onnx")
    checked = 0
    for path in shipped_manifest_paths():
        manifest = load_manifest(path, check_dataset=False)
        source = manifest.model.sources[0]
        if manifest.model.format != "onnx" or source.path is None:
            continue
        graph = onnx.load(str(manifest.resolve(source.path)), load_external_data=False).graph
        weights = {i.name for i in graph.initializer}
        real = [
            (i.name, [d.dim_value for d in i.type.tensor_type.shape.dim][1:])
            for i in graph.input
            if i.name not in weights
        ]
        assert [(i.name, list(i.dims)) for i in manifest.inputs] == real, path.name
        checked += 1
    assert checked >= 9
