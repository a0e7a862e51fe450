"""`trims analyze` end to end on small models, through the real CLI entry point."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from tests.evaluation import graphs
from trims.cli import main

FAST = ["--max-time", "0.05", "--min-reps", "3", "--no-progress"]


def test_layers_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "res.onnx"
    onnx.save(graphs.residual(2), str(path))
    out = tmp_path / "layers.json"
    assert main(["analyze", "layers", "--models", f"{path},squeezenet", "--json", str(out)]) == 0
    body = json.loads(out.read_text())
    assert [m["name"] for m in body["models"]] == ["res", "squeezenet"]
    assert body["models"][0]["layers"][0]["output_shapes"] == [[1, 8, 16, 16]]
    assert "unique layer configurations" in capsys.readouterr().out


def test_lowerbound_and_bricks_json(tmp_path: Path) -> None:
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(graphs.residual(2), str(a))
    onnx.save(graphs.conv_gemm(), str(b))
    common = ["--models", f"{a},{b}", "--db", str(tmp_path / "r.sqlite"), *FAST]
    lb = tmp_path / "lb.json"
    assert main(["analyze", "lowerbound", *common, "--json", str(lb)]) == 0
    models = json.loads(lb.read_text())["models"]
    assert [m["name"] for m in models] == ["a", "b"]
    for m in models:
        assert 0 <= m["parallel_lb_ms"] <= m["sequential_lb_ms"]
        assert m["measured_ms"] > 0
        low, high = m["measured_ci_ms"]
        assert low <= m["measured_ms"] <= high
        low, high = m["sequential_lb_ci_ms"]
        assert low <= m["sequential_lb_ms"] <= high and isinstance(m["precise"], bool)
        # every bound carries its interval, the fused ones and the critical paths too
        for key in ("parallel_lb", "fused_sequential_lb", "fused_parallel_lb"):
            low, high = m[f"{key}_ci_ms"]
            assert low <= m[f"{key}_ms"] <= high
    chains = json.loads(lb.read_text())["fusion"]
    assert chains  # both models have Conv(+Add)+Relu chains
    for chain in chains:
        for key in ("fused", "unfused"):
            low, high = chain[f"{key}_ci_ms"]
            assert low <= chain[f"{key}_ms"] <= high
    br = tmp_path / "bricks.json"
    assert (
        main(
            [
                "analyze",
                "bricks",
                *common,
                "--granularity",
                "1,5",
                "--json",
                str(br),
                "--plots",
                str(tmp_path / "img"),
            ]
        )
        == 0
    )
    body = json.loads(br.read_text())
    assert {"models", "time_whole_s", "time_bricks_s"} <= set(body)
    first = body["models"][0]
    assert {"name", "measured_ms", "estimated_ms", "error_pct", "correction_pct"} <= set(first)
    lo, hi = first["error_ci_pct"]
    assert lo <= first["error_pct"] <= hi
    assert first["within_10pct"] in ("within", "straddles", "outside")
    low, high = first["measured_ci_ms"]
    assert low <= first["measured_ms"] <= high
    assert first["estimated_ms"] == pytest.approx(
        first["raw_ms"] - first["overhead_ms"] - first["layout_ms"] + first["floor_ms"]
    )
    assert body["confidence"] == 0.95 and body["precision"] == 0.02 and not body["quick"]
    assert [g["granularity"] for g in body["by_granularity"]] == [1, 5]
    whole_ms = sum(m["measured_ms"] for m in body["models"])
    for g in body["by_granularity"]:
        assert g["unique_bricks_ms"] > 0
        assert g["sharing"] == pytest.approx(whole_ms / g["unique_bricks_ms"])
    assert (tmp_path / "img" / "evaluation_bricks_error.png").stat().st_size > 0


def test_bad_model_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "weird.onnx"
    onnx.save(graphs.with_op("Hardmax"), str(path))
    assert main(["analyze", "layers", "--models", str(path)]) == 1
    err = capsys.readouterr().err
    assert "weird" in err and "odd_node" in err


def test_quick_bricks_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.onnx"
    onnx.save(graphs.conv_gemm(), str(a))
    out = tmp_path / "quick.json"
    args = ["analyze", "bricks", "--models", str(a), "--db", str(tmp_path / "q.sqlite")]
    assert main([*args, "--quick", "--granularity", "1", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("QUICK RUN (rough")
    body = json.loads(out.read_text())
    assert body["quick"] and body["precision"] == 0.05 and body["max_time_s"] == 2.0
    # a bad precision is refused before anything is measured
    assert main([*args, "--precision", "0"]) == 1
    assert "precision must be between" in capsys.readouterr().err


def test_lowerbound_follows_the_precision_and_says_quick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trims.evaluation import analyses

    settings = analyses.make_settings("lowerbound", models=["zoo"])
    assert (settings.max_time_s, settings.min_reps, settings.precision) == (60.0, 3, 0.02)
    # what stops when stable (the fusion chains, MXNet) keeps its budget, or the one given
    assert settings.stable_max_time_s == 0.5
    assert analyses.make_settings("lowerbound", max_time=3.0).stable_max_time_s == 3.0
    layers = analyses.make_settings("layers", models=["zoo"])
    assert (layers.max_time_s, layers.min_reps) == (0.5, 7)  # no precision rule there
    a = tmp_path / "a.onnx"
    onnx.save(graphs.conv_gemm(), str(a))
    out = tmp_path / "lb.json"
    args = ["analyze", "lowerbound", "--models", str(a), "--db", str(tmp_path / "q.sqlite")]
    assert main([*args, "--quick", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("QUICK RUN (rough")
    body = json.loads(out.read_text())
    assert body["quick"] and body["precision"] == 0.05
    (m,) = body["models"]
    low, high = m["measured_ci_ms"]
    # the interval asked: +-5% of the time at most (the whole model reached its precision)
    assert m["precise"] and (high - low) / 2 <= 0.05 * m["measured_ms"]


def test_an_interval_shows_a_significant_digit() -> None:
    from trims.evaluation.analyses import _plus_minus

    assert _plus_minus(4.57, 0.025) == "4.57 +-0.05"  # two decimals where they suffice
    # a 4 us half-width on a 0.1 ms chain: three decimals, not "0.10 +-0.00"
    assert _plus_minus(0.1, 0.002) == "0.100 +-0.004"
    assert _plus_minus(0.1, 0.0) == "0.10 +-0.00"  # nothing to show
    assert _plus_minus(0.1, 1e-7) == "0.1000 +-0.0000"  # at most four
