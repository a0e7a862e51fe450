"""At deploy, a model no instance could get is a 422 naming it (not a 502 at the first call)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from tests.fixtures.gateway import FUNCS, RunningGateway, echo_spec

StartGateway = Callable[..., Awaitable[RunningGateway]]


def _with_model(model: dict[str, Any], name: str = "needs-model") -> dict[str, Any]:
    spec = echo_spec(name)
    spec["models"] = [model]
    return spec


async def _put(gw: RunningGateway, spec: dict[str, Any]) -> tuple[int, Any]:
    url = f"{gw.url}/v1/functions/{spec['name']}"
    async with gw.session.put(url, json=spec, headers=gw.headers()) as r:
        return r.status, await r.json()


async def test_a_model_neither_on_disk_nor_in_the_store_is_refused(
    start_gateway: StartGateway, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    daemon = start_daemon(models={"lin": {"w": np.ones((2, 2), np.float32)}})
    gw = await start_gateway(store_socket=daemon.socket)
    missing = tmp_path / "nowhere" / "model.onnx"
    status, doc = await _put(gw, _with_model({"name": "typo", "source": str(missing)}))
    assert status == 422, doc
    message = doc["error"]["message"]
    assert "models[0]" in message and str(missing) in message
    assert "the store holds no such model" in message and "trims models add" in message
    status, doc = await _put(gw, _with_model({"name": "typo"}))
    assert status == 422 and "it names no source" in doc["error"]["message"]
    # Nothing was deployed by the refusals.
    async with gw.session.get(f"{gw.url}/v1/functions/needs-model") as r:
        assert r.status == 404


async def test_a_model_the_store_holds_or_a_file_here_passes(
    start_gateway: StartGateway, start_daemon: Callable[..., Any], tmp_path: Path
) -> None:
    daemon = start_daemon(models={"lin": {"w": np.ones((2, 2), np.float32)}})
    gw = await start_gateway(store_socket=daemon.socket)
    # In the store, no source: fine; a stale fallback path does not matter either.
    for model in ({"name": "lin"}, {"name": "lin", "source": str(tmp_path / "old.npz")}):
        status, doc = await _put(gw, _with_model(model))
        assert status in (200, 201), doc
    # A file on this host (relative paths count from code_dir); a URL is the store's to fetch.
    relative = next(p.name for p in FUNCS.iterdir() if p.suffix == ".py")
    for source in (relative, "https://models.example/m.safetensors"):
        status, doc = await _put(gw, _with_model({"name": "other", "source": source}))
        assert status in (200, 201), (source, doc)


async def test_without_a_store_a_missing_source_says_the_store_cannot_be_asked(
    start_gateway: StartGateway, tmp_path: Path
) -> None:
    gw = await start_gateway(store_socket=tmp_path / "no-daemon.sock")
    status, doc = await _put(gw, _with_model({"name": "m", "source": str(tmp_path / "m.pt")}))
    assert status == 422
    assert "the store cannot be asked" in doc["error"]["message"]
