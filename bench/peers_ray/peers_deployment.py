"""A Ray Serve deployment running bench/peers.py's models (``peers_model.forward``).

One deployment serves every model of its server through Ray's model multiplexing: a request
names its model in the ``serve_multiplexed_model_id`` header, Ray's router sends it to a
replica that has the model loaded where one has, and the replica's ``@serve.multiplexed``
loader opens the weights the first time a replica meets the model. The weights are opened with
``safetensors.torch.load_file`` (a private mmap: no copy, every replica shares the page
cache's one copy), as MLServer's runtime does.

HTTP, on the V2 paths the other peers answer (the model is the header's, as Ray routes by it):

- ``POST /v2/models/<model>/infer``: V2 JSON in (``input``, FP32 [batch, in]), V2 JSON out
  (``output`` FP32 and ``pid`` INT64 [1], the replica process that ran the forward pass);
- ``POST /v2/repository/models/<model>/load``: the multiplexed load into the replica Ray picks;
- ``POST /v2/repository/models/<model>/unload``: evicts the model from the replica that gets it;
- ``GET /v2/health/live``: 200 once the application is deployed.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import numpy as np
import torch
from peers_model import forward
from ray import serve
from safetensors.torch import load_file
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

#: the attribute ``@serve.multiplexed`` keeps its per-replica model cache in (ray/serve/api.py)
_MULTIPLEX_CACHE = "__serve_multiplex_wrapper"


class Loaded(NamedTuple):
    tensors: dict[str, torch.Tensor]
    relu: bool


@serve.deployment
class PeersModels:
    """``models``: name -> {"path": safetensors file, "relu": bool}; ``loaded``: load every
    model in each replica as it starts (else on the first request naming it)."""

    # Ray awaits an async constructor, so the replica is ready only once the models are loaded
    async def __init__(self, models: dict[str, dict[str, Any]], loaded: bool) -> None:  # type: ignore[misc]
        self._files = models
        if loaded:
            for name in models:
                await self.model(name)

    # -1: no limit, so Ray's LRU never evicts one of the server's models to make room
    @serve.multiplexed(max_num_models_per_replica=-1)
    async def model(self, name: str) -> Loaded:
        f = self._files[name]
        return Loaded(load_file(f["path"], device="cpu"), bool(f["relu"]))

    async def __call__(self, request: Request) -> Response:
        op = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        if op == "live":
            return Response()
        name = serve.get_multiplexed_model_id()
        if name not in self._files:
            return JSONResponse(
                {"error": f"unknown model {name!r}: set header serve_multiplexed_model_id"},
                status_code=404,
            )
        if op == "infer":
            return self._infer(await self.model(name), name, await request.body())
        if op == "load":
            await self.model(name)
            return Response()
        if op == "unload":
            await self._evict(name)
            return Response()
        return JSONResponse({"error": f"no route {request.url.path}"}, status_code=404)

    def _infer(self, model: Loaded, name: str, body: bytes) -> JSONResponse:
        tensor = json.loads(body)["inputs"][0]
        x = torch.from_numpy(np.asarray(tensor["data"], dtype=np.float32))
        y = forward(model.tensors, x.reshape(tensor["shape"]), model.relu)
        outputs = [
            {
                "name": "output",
                "datatype": "FP32",
                "shape": list(y.shape),
                "data": y.ravel().tolist(),
            },
            {"name": "pid", "datatype": "INT64", "shape": [1], "data": [os.getpid()]},
        ]
        return JSONResponse({"model_name": name, "outputs": outputs})

    async def _evict(self, name: str) -> None:
        """Ray's multiplexing has no public unload: it evicts only the least recently used
        model when a replica needs room. So the model is made the least recently used one and
        Ray's own eviction step runs (it drops the tensors, unmapping the file), then the
        replica's model list is pushed to the router as after a load."""
        cache = getattr(self, _MULTIPLEX_CACHE, None)
        if cache is None or name not in cache.models:
            return
        cache.models.move_to_end(name, last=False)
        await cache.unload_model_lru()
        cache._push_multiplexed_replica_info = True
