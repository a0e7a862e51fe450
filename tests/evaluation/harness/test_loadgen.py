"""The real MLPerf LoadGen driving a real small model (DirectSUT over an ONNX MLP).

Settings are tiny (half-second runs, a few dozen queries); validity is asserted only where the
test makes it certain (an impossible Server target). No timing is asserted.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.models import samples, tiny_mlp, tiny_mlp_reference
from trims.errors import TrimsError, ValidationError
from trims.evaluation.harness.loadgen import (
    SCENARIOS,
    SHORT_DEFAULTS,
    LoadGenSettings,
    build_test_settings,
    run_loadgen,
)
from trims.evaluation.harness.sut import DirectSUT

TINY = LoadGenSettings(min_duration_ms=300, min_query_count=16, offline_expected_qps=200.0)
N = 24


@pytest.fixture
def sut(tmp_path: Path) -> Iterator[DirectSUT]:
    model = tiny_mlp(tmp_path / "tiny.onnx")
    direct = DirectSUT.onnx("tiny", model, socket_path=tmp_path / "no-store.sock")
    yield direct
    direct.close()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_scenario_gives_a_parsed_result_and_the_verbatim_summary(
    scenario: str, sut: DirectSUT, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    result, outputs = run_loadgen(
        sut.predict, samples(N), scenario, "performance", TINY, batch=4, log_dir=logs
    )
    assert result.scenario == scenario and result.mode == "performance"
    assert result.summary == (logs / "mlperf_log_summary.txt").read_text()
    assert f"Scenario : {SCENARIOS[scenario]}" in result.summary
    verdict = "VALID" if result.valid else "INVALID"
    assert f"Result is : {verdict}\n" in result.summary
    assert result.valid == (not result.invalid_reasons)
    assert result.qps is not None and result.qps > 0
    assert set(result.latency_ms) == {"p50", "p90", "p99", "mean"}
    assert 0 < result.latency_ms["p50"] <= result.latency_ms["p90"] <= result.latency_ms["p99"]
    assert result.settings["min_duration_ms"] == 300
    assert result.queries >= 1
    assert outputs == {}, "a performance run keeps no outputs"


@pytest.mark.parametrize("scenario", ["single-stream", "offline"])
def test_accuracy_mode_returns_every_samples_output_once(scenario: str, sut: DirectSUT) -> None:
    inputs = samples(N, seed=5)
    result, outputs = run_loadgen(sut.predict, inputs, scenario, "accuracy", TINY, batch=5)
    assert result.valid and result.invalid_reasons == ()
    assert result.qps is None and result.latency_ms == {}
    assert sorted(outputs) == list(range(N))
    for i, out in outputs.items():
        np.testing.assert_allclose(
            out["probs"], tiny_mlp_reference(inputs[i]), rtol=1e-5, atol=1e-6
        )


def test_server_at_an_impossible_rate_is_invalid_with_loadgens_reason(sut: DirectSUT) -> None:
    impossible = LoadGenSettings(
        min_duration_ms=300,
        min_query_count=64,
        server_target_qps=4000.0,
        server_target_latency_ms=0.001,
    )
    result, _ = run_loadgen(sut.predict, samples(N), "server", "performance", impossible)
    assert not result.valid
    assert "Result is : INVALID" in result.summary
    assert "Performance constraints satisfied : NO" in result.invalid_reasons
    assert result.settings["target_latency_ns"] == 1000


def test_short_defaults_apply_unless_mlperf_defaults_which_come_from_loadgen() -> None:
    import mlperf_loadgen as lg

    short = build_test_settings("offline", "performance", LoadGenSettings())
    assert short.min_duration_ms == SHORT_DEFAULTS["min_duration_ms"]
    assert short.min_query_count == SHORT_DEFAULTS["min_query_count"]
    mlperf = build_test_settings("offline", "performance", LoadGenSettings(mlperf_defaults=True))
    reference = lg.TestSettings()
    reference.scenario = lg.TestScenario.Offline
    assert reference.FromConfig("", "resnet50", "Offline", 0) == 0
    assert mlperf.min_duration_ms == reference.min_duration_ms != short.min_duration_ms
    assert mlperf.min_query_count == reference.min_query_count
    assert mlperf.qsl_rng_seed == reference.qsl_rng_seed == short.qsl_rng_seed
    explicit = LoadGenSettings(mlperf_defaults=True, min_duration_ms=1234, schedule_rng_seed=9)
    chosen = build_test_settings("server", "accuracy", explicit)
    assert (chosen.min_duration_ms, chosen.schedule_rng_seed) == (1234, 9)
    assert chosen.mode == lg.TestMode.AccuracyOnly


def test_bad_names_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValidationError, match="unknown scenario"):
        build_test_settings("burst", "performance", LoadGenSettings())
    with pytest.raises(ValidationError, match="unknown mode"):
        build_test_settings("offline", "fast", LoadGenSettings())
    with pytest.raises(ValidationError, match="empty"):
        run_loadgen(lambda b: b, [], "offline", "performance")


def test_a_failing_system_under_test_fails_the_run() -> None:
    def broken(batch: list[Any]) -> list[Any]:
        raise RuntimeError("model exploded")

    with pytest.raises(TrimsError, match="model exploded"):
        run_loadgen(broken, samples(4), "single-stream", "accuracy", TINY)


def test_a_short_answer_fails_the_run() -> None:
    with pytest.raises(TrimsError, match="one output per input"):
        run_loadgen(lambda b: b[:-1], samples(8), "offline", "accuracy", TINY, batch=4)
