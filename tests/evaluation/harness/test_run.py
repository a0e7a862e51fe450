"""run_scenario: both modes in one call, post-processed outputs, and the gateway under LoadGen."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.gateway import RunningGateway
from tests.fixtures.models import ONNX_HANDLER, samples, tiny_mlp, tiny_mlp_reference
from trims.errors import ValidationError
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.manifest_run import run_manifest
from trims.evaluation.harness.run import SampleSet, run_scenario
from trims.evaluation.harness.sut import DirectSUT, GatewaySUT, onnx_function_spec

TINY = LoadGenSettings(min_duration_ms=300, min_query_count=16, offline_expected_qps=200.0)


def argmax(output: dict[str, np.ndarray]) -> int:
    return int(np.argmax(output["probs"]))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return tiny_mlp(tmp_path / "tiny.onnx")


@pytest.fixture
def direct(model: Path, tmp_path: Path) -> Iterator[DirectSUT]:
    sut = DirectSUT.onnx("tiny", model, socket_path=tmp_path / "no-store.sock")
    yield sut
    sut.close()


def test_both_modes_run_twice_and_postprocess_every_sample(
    direct: DirectSUT, tmp_path: Path
) -> None:
    inputs = samples(20, seed=11)
    labels = [int(np.argmax(tiny_mlp_reference(x))) for x in inputs]
    data = SampleSet(inputs, labels, postprocess=argmax, name="tiny-set")
    run = run_scenario(direct, data, "offline", "both", TINY, batch=8, log_dir=tmp_path / "logs")
    assert run.performance is not None and run.accuracy is not None
    assert [r.mode for r in run.results] == ["performance", "accuracy"]
    assert run.performance.qps is not None
    assert (tmp_path / "logs" / "performance" / "mlperf_log_summary.txt").is_file()
    assert (tmp_path / "logs" / "accuracy" / "mlperf_log_detail.txt").is_file()
    assert run.accuracy.valid
    assert run.predictions() == labels


def test_performance_mode_keeps_no_outputs(direct: DirectSUT) -> None:
    run = run_scenario(direct, SampleSet(samples(8)), "single-stream", "performance", TINY)
    assert run.accuracy is None and run.outputs == {}
    assert run.valid == run.results[0].valid


def test_bad_requests_are_refused(direct: DirectSUT) -> None:
    with pytest.raises(ValidationError, match="labels for"):
        SampleSet(samples(3), labels=[0])
    with pytest.raises(ValidationError, match="unknown mode"):
        run_scenario(direct, SampleSet(samples(3)), "offline", "twice")
    with pytest.raises(ValidationError, match="unknown scenario"):
        run_scenario(direct, SampleSet(samples(3)), "burst")


@pytest.mark.parametrize("scenario", ["single-stream", "server", "offline"])
async def test_the_gateway_under_loadgen_answers_as_the_direct_sut(
    scenario: str,
    model: Path,
    direct: DirectSUT,
    start_gateway: Callable[..., Awaitable[RunningGateway]],
) -> None:
    gw = await start_gateway()
    spec = onnx_function_spec("tiny-mlp", model, code_dir=ONNX_HANDLER, concurrency=2)
    data = SampleSet(samples(16, seed=2), name="tiny-set")
    settings = LoadGenSettings(
        min_duration_ms=300, min_query_count=16, server_target_qps=50.0, offline_expected_qps=50.0
    )

    def evaluate() -> tuple[Any, Any]:
        gateway = GatewaySUT.deploy(gw.url, spec)
        try:
            over_http = run_scenario(gateway, data, scenario, "both", settings, batch=4, workers=2)
        finally:
            gateway.close()
        return over_http, run_scenario(direct, data, scenario, "accuracy", settings, batch=4)

    over_http, in_process = await asyncio.to_thread(evaluate)
    assert over_http.performance is not None and over_http.performance.qps is not None
    assert over_http.sut == "tiny-mlp" and over_http.accuracy is not None
    assert sorted(over_http.outputs) == list(range(16))
    for i, out in in_process.outputs.items():
        np.testing.assert_allclose(over_http.outputs[i]["probs"], out["probs"], rtol=1e-6)


def test_a_manifest_runs_with_its_accuracy_on_real_labelled_digits(tmp_path: Path) -> None:
    from trims.evaluation.harness.manifest import load_manifest, shipped_manifest_paths

    path = next(p for p in shipped_manifest_paths() if p.name == "digits-mlp.yaml")
    manifest = load_manifest(path)
    result = run_manifest(
        manifest, "direct", "offline", "accuracy", TINY, work_dir=tmp_path, batch=32
    )
    assert manifest.accuracy is not None and result.accuracy is not None
    assert result.samples == manifest.dataset.samples
    assert result.run.accuracy is not None and result.run.accuracy.valid
    assert abs(result.accuracy - manifest.accuracy.reference) <= 0.005


def test_run_manifest_refuses_a_system_under_test_the_framework_lacks(tmp_path: Path) -> None:
    from trims.evaluation.harness.manifest import load_manifest, shipped_manifest_paths

    path = next(p for p in shipped_manifest_paths() if p.name == "torch-resnet18.yaml")
    with pytest.raises(ValidationError, match="torch models run on the direct or gateway"):
        run_manifest(load_manifest(path), "pipeline", "offline", work_dir=tmp_path)


def test_offline_without_an_expected_rate_is_calibrated_and_valid(direct: DirectSUT) -> None:
    settings = LoadGenSettings(min_duration_ms=300, min_query_count=16)
    run = run_scenario(direct, SampleSet(samples(32)), "offline", "performance", settings)
    assert run.performance is not None
    assert run.performance.settings["target_qps"] > 1.0, "LoadGen got the measured rate"
    assert run.performance.valid, run.performance.invalid_reasons
