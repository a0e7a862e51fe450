"""The overview page: deployed functions with their instances, and the store's models with
their residency per tier. It refreshes itself (a meta refresh, no script)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web

from trims.errors import TrimsError
from trims.evaluation.ui.render import render
from trims.evaluation.ui.state import session_of, state_of

__all__ = ["TIERS", "overview"]

#: the store's tiers, fastest first (trims.daemon's TIERS; the UI does not import the daemon)
TIERS = ("gpu", "cpu", "disk")


def _function_row(doc: dict[str, Any]) -> dict[str, Any]:
    spec, status = doc.get("spec") or {}, doc.get("status") or {}
    instances = status.get("instances") or []
    scaling = spec.get("scaling") or {}
    return {
        "name": spec.get("name", "?"),
        "code": spec.get("handler") or spec.get("image") or "",
        "executor": spec.get("executor") or "default",
        "models": [m.get("alias") or m.get("name", "?") for m in spec.get("models") or []],
        "alive": sum(1 for i in instances if i.get("alive")),
        "instances": len(instances),
        "max_instances": scaling.get("max_instances"),
        "inflight": status.get("inflight", 0),
        "queued": status.get("queued", 0),
        "served": sum(int(i.get("served") or 0) for i in instances),
    }


def _store_models(socket: Path) -> list[dict[str, Any]]:
    from trims.runtime.client import StoreClient

    with StoreClient(socket, timeout=5.0, client_name="trims web ui") as client:
        return client.list()


async def overview(request: web.Request) -> web.Response:
    state = state_of(request)
    doc = await state.api.call(request, "GET", "/v1/functions", token=session_of(request).token)
    functions = [_function_row(f) for f in (doc or {}).get("functions", [])]
    models: list[dict[str, Any]] = []
    store_error = ""
    socket = state.config.store_socket
    if socket is None:
        store_error = "This gateway has no store socket configured, so no models are shown."
    else:
        try:
            models = await asyncio.to_thread(_store_models, socket)
        except TrimsError as e:
            store_error = f"The store daemon at {socket} did not answer: {e.message}"
        except OSError as e:
            store_error = f"The store daemon at {socket} is not reachable: {e.strerror or e}"
    for m in models:
        resident = set(m.get("tiers") or [])
        m["resident"] = {t: t in resident for t in TIERS}
    return render(
        request,
        "overview.html",
        functions=functions,
        models=sorted(models, key=lambda m: (str(m.get("name")), str(m.get("version")))),
        tiers=TIERS,
        store_error=store_error,
        refresh=True,
    )
