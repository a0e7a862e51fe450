"""ALS on MovieLens-100k through the harness: precision@10 against its reference, direct and
on a gateway (int64 user indices end to end), and prepared models readable by every user."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.gateway import RunningGateway
from tests.fixtures.models import ONNX_HANDLER
from trims.evaluation.harness import prepare
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.manifest import Manifest, load_manifest, shipped_manifest_paths
from trims.evaluation.harness.manifest_run import (
    GatewayTarget,
    ManifestRun,
    metric_predictions,
    run_manifest,
)

pytest.importorskip("recbole", reason="the movielens-100k dataset ships in the recbole wheel")

TINY = LoadGenSettings(min_duration_ms=100, min_query_count=8)


def als_manifest() -> Manifest:
    return load_manifest(next(p for p in shipped_manifest_paths() if p.stem == "als-ml100k"))


def test_metric_predictions_rank_scores_for_precision_at_k() -> None:
    manifest = als_manifest()
    scores = [np.array([0.1, 0.9, -1e9, 0.5] + [0.0] * 8, np.float32)]
    ranked = metric_predictions(manifest, scores)
    assert ranked.shape == (1, 10)
    assert list(ranked[0][:3]) == [1, 3, 0], "best first, then ties by the lower index"
    assert 2 not in ranked[0], "an item already seen (-1e9) is never recommended"


def _check(result: ManifestRun, manifest: Manifest) -> None:
    assert manifest.accuracy is not None and result.accuracy is not None
    assert result.samples == 943
    assert result.run.accuracy is not None and result.run.accuracy.valid
    assert abs(result.accuracy - manifest.accuracy.reference) <= 0.005, result.accuracy


def test_direct_precision_at_10_matches_the_reference(tmp_path: Path) -> None:
    manifest = als_manifest()
    result = run_manifest(
        manifest, "direct", "offline", "accuracy", TINY, work_dir=tmp_path, batch=64,
        socket_path=tmp_path / "no-store.sock",
    )  # fmt: skip
    _check(result, manifest)


async def test_als_gateway(
    tmp_path: Path, start_gateway: Callable[..., Awaitable[RunningGateway]]
) -> None:
    """int64 user indices reach the model over the gateway, and its precision@10 is the
    reference's (a short name: the instances' AF_UNIX socket paths live under tmp_path)."""
    manifest = als_manifest()
    gw = await start_gateway()
    target = GatewayTarget(gw.url, ONNX_HANDLER)
    result = await asyncio.to_thread(
        run_manifest, manifest, "gateway", "offline", "accuracy", TINY, work_dir=tmp_path,
        gateway=target, batch=64,
    )  # fmt: skip
    _check(result, manifest)
    status, _ = await gw.get_json("/v1/functions/eval-als-ml100k")
    assert status == 404, "the evaluation removes the function it deployed"


def test_prepared_models_are_readable_by_every_user(tmp_path: Path) -> None:
    path = prepare.build("prepare:digits-mlp", tmp_path / "models")
    assert stat.S_IMODE(path.stat().st_mode) == prepare.MODEL_MODE == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["digits-mlp.onnx"], "no temp file left"
