"""Model states over the Open Inference Protocol, and Triton's model repository extension.

A function that declares ``serves`` is a model. Its state, in Triton's words::

    READY        it can serve: an instance is ready or starting, or it is scaled to zero and
                 starts one on the next request (nothing has failed)
    UNAVAILABLE  its last instance start failed (``init`` raised, the worker died, the start
                 timed out) and no instance is ready: the reason is that failure; the next
                 request or a load tries again, and the first instance that starts makes it
                 READY. Or it was unloaded (reason "unloaded").

``GET /v2/models/{name}/ready`` answers 200 for READY and 503 otherwise. The server is ready
(``GET /v2/health/ready``) as Triton's default strict readiness has it: the gateway is not
draining and every loaded model is READY; ``/readyz`` says only whether the gateway itself
takes requests.

The repository extension maps Triton's explicit model control onto deploy and scale:

- ``POST /v2/repository/index`` (read scope; body ``{"ready": true}`` lists only READY ones):
  ``[{"name", "version", "state", "reason"}]``, one entry per served version.
- ``POST /v2/repository/models/{name}/load`` (admin): a model unloaded by this gateway gets its
  ``min_instances`` and ``standby`` back (the function is deployed again with them), then the
  call waits until an instance is ready, as Triton's load waits for the model: 200 when ready,
  the start's error (502, naming the ``init`` failure) otherwise. Loading needs a deployed
  function: a model that does not exist is deployed with ``PUT /v1/functions/{name}``.
- ``POST /v2/repository/models/{name}/unload`` (admin): scale to zero. The function is deployed
  again with ``min_instances: 0`` and ``standby: 0`` (kept in its saved spec) so its instances
  and standbys drain and stop; the model answers not ready and its infer 503 until it is loaded
  again or deployed anew. The function stays deployed: ``/v1`` invocations still start
  instances on demand.

The unloaded mark lives in this gateway's memory: a restarted gateway serves the model again
(lazily, with the ``min_instances: 0`` the unload saved).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from aiohttp import web

from trims.errors import NotFound, RequestError, Unavailable
from trims.runtime.executors.base import Instance
from trims.runtime.gateway.context import GATEWAY, auth_of, json_response, read_json
from trims.runtime.gateway.pool import Pool
from trims.runtime.gateway.service import Gateway

__all__ = ["READY", "UNAVAILABLE", "Repository", "add_routes", "repository_of"]

log = logging.getLogger(__name__)

READY = "READY"
UNAVAILABLE = "UNAVAILABLE"

#: How long a load waits for an instance to become ready (a cold start with a large model).
LOAD_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class _Unloaded:
    #: The pool the unload deployed; a later deploy replaces it, which loads the model again.
    pool: Pool
    #: ``min_instances`` before the unload, given back by a load.
    min_instances: int
    #: ``standby`` before the unload (an unloaded model keeps no standby either).
    standby: int = 0


class Repository:
    """Which served models this gateway has unloaded, and every model's state."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._unloaded: dict[str, _Unloaded] = {}

    def served_pool(self, name: str) -> Pool:
        pool = self._gateway.pools.get(name)
        if pool is None or pool.spec.serves is None:
            raise NotFound(
                f"no model named {name!r}: deploy a function of that name with 'serves' "
                f"(PUT /v1/functions/{name}; GET /v1/functions lists functions)"
            )
        return pool

    def unloaded(self, name: str) -> bool:
        mark = self._unloaded.get(name)
        if mark is None:
            return False
        if self._gateway.pools.get(name) is not mark.pool:
            del self._unloaded[name]  # deployed again since: loaded
            return False
        return True

    def state(self, name: str) -> tuple[str, str]:
        """(state, reason) of a served model (see the module docstring)."""
        pool = self.served_pool(name)
        if self.unloaded(name):
            return UNAVAILABLE, "unloaded"
        if pool.start_error is not None and pool.counts()["ready"] == 0:
            return UNAVAILABLE, f"its instances fail to start: {pool.start_error}"
        return READY, ""

    def is_ready(self, name: str) -> bool:
        return not self._gateway.draining and self.state(name)[0] == READY

    def server_ready(self) -> bool:
        """Not draining, and every loaded served model READY (Triton's strict readiness)."""
        if self._gateway.draining:
            return False
        return all(
            self.unloaded(name) or self.state(name)[0] == READY
            for name, pool in list(self._gateway.pools.items())
            if pool.spec.serves is not None
        )

    def check_loaded(self, name: str) -> None:
        if self.unloaded(name):
            raise Unavailable(
                f"model {name} is unloaded; POST /v2/repository/models/{name}/load loads it"
            )

    def index(self, ready_only: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for name, pool in sorted(self._gateway.pools.items()):
            if pool.spec.serves is None:
                continue
            state, reason = self.state(name)
            if ready_only and state != READY:
                continue
            for version in pool.spec.serves.versions:
                out.append({"name": name, "version": version, "state": state, "reason": reason})
        return out

    async def load(self, name: str) -> None:
        """Give an unloaded model its instances back, then wait for one to be ready."""
        pool = self.served_pool(name)
        mark = self._unloaded.pop(name, None) if self.unloaded(name) else None
        if mark is not None and (mark.min_instances > 0 or mark.standby > 0):
            spec = pool.spec
            scaling = dataclasses.replace(
                spec.scaling, min_instances=mark.min_instances, standby=mark.standby
            )
            await self._gateway.deploy(dataclasses.replace(spec, scaling=scaling), replace=True)
            pool = self.served_pool(name)
        if self._gateway.draining:
            raise Unavailable("the gateway is shutting down; load the model on another gateway")

        async def ready(instance: Instance, timeout_s: float) -> None:
            return None

        await pool.run(ready, deadline=time.monotonic() + LOAD_TIMEOUT_S)
        log.info("model %s loaded: an instance is ready", name)

    async def unload(self, name: str) -> None:
        """Scale the model to zero and mark it unloaded."""
        pool = self.served_pool(name)
        if self.unloaded(name):
            return
        spec = pool.spec
        scaling = dataclasses.replace(spec.scaling, min_instances=0, standby=0)
        await self._gateway.deploy(dataclasses.replace(spec, scaling=scaling), replace=True)
        self._unloaded[name] = _Unloaded(
            self.served_pool(name), spec.scaling.min_instances, spec.scaling.standby
        )
        log.info("model %s unloaded: its instances drain and stop", name)


REPOSITORY = web.AppKey("trims.oip.repository", Repository)


def repository_of(request: web.Request) -> Repository:
    return request.app[REPOSITORY]


async def _optional_json(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    doc = await read_json(request)
    if not isinstance(doc, dict):
        raise RequestError("the request body must be a JSON object")
    return doc


async def index(request: web.Request) -> web.Response:
    auth_of(request).require_any(request)
    doc = await _optional_json(request)
    ready_only = doc.get("ready", False)
    if not isinstance(ready_only, bool):
        raise RequestError("'ready' must be true or false")
    return json_response(repository_of(request).index(ready_only))


async def load(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    await _optional_json(request)
    await repository_of(request).load(request.match_info["name"])
    return json_response({})


async def unload(request: web.Request) -> web.Response:
    auth_of(request).require_admin(request)
    await _optional_json(request)
    await repository_of(request).unload(request.match_info["name"])
    return json_response({})


def add_routes(app: web.Application) -> None:
    app[REPOSITORY] = Repository(app[GATEWAY])
    r = app.router
    r.add_post("/v2/repository/index", index)
    r.add_post("/v2/repository/models/{name}/load", load)
    r.add_post("/v2/repository/models/{name}/unload", unload)
