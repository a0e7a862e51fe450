"""`trims evaluate manifests`: the table, the exact --json shape, --validate's exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trims.cli import main
from trims.evaluation.harness.manifest import shipped_manifest_paths


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", "manifests", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(shipped_manifest_paths())
    for row in rows:
        assert list(row) == ["name", "version", "task", "framework", "weights", "accuracy"]
        assert row["weights"] in ("pretrained", "trained-here", "random", "constant")
        if row["accuracy"] is not None:
            assert list(row["accuracy"]) == ["metric", "reference"]
            assert 0.0 <= row["accuracy"]["reference"] <= 1.0
    by_name = {r["name"]: r for r in rows}
    assert by_name["onnx-squeezenet"]["accuracy"] is None
    assert by_name["digits-mlp"]["accuracy"]["metric"] == "top1"


def test_table_and_validate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", "manifests"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["name", "version", "task", "framework", "weights", "dataset",
                              "accuracy"]  # fmt: skip
    assert any(line.startswith("digits-mlp ") and "top1 0." in line for line in out)
    assert main(["evaluate", "manifests", "--validate"]) == 0
    assert capsys.readouterr().out.strip() == f"{len(shipped_manifest_paths())} manifests valid"


def test_given_files_and_bad_input_exit_nonzero_without_traceback(tmp_path: Path) -> None:
    good = yaml.safe_load(shipped_manifest_paths()[0].read_text())
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(good))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(good, colour="red")))
    done = subprocess.run(
        [sys.executable, "-m", "trims.cli", "evaluate", "manifests", "--validate", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"{tmp_path / 'bad.yaml'}: colour: unknown field" in done.stderr
    assert "1 of 2 manifests are invalid" in done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "trims.cli", "evaluate", "manifests", str(tmp_path / "nope.yaml")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "nope.yaml: cannot read the manifest" in missing.stderr


def test_given_file_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = next(p for p in shipped_manifest_paths() if p.stem == "als-ml100k")
    assert main(["evaluate", "manifests", "--json", str(path)]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["accuracy"]["metric"] == "precision_at_k" and row["weights"] == "trained-here"
