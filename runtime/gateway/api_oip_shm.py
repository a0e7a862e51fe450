"""The shared-memory extensions' routes: Triton's system shared memory, and CUDA's answer.

System shared memory (see :mod:`trims.runtime.gateway.oip_shm`)::

    GET  /v2/systemsharedmemory/status                     this caller's regions
    GET  /v2/systemsharedmemory/region/{region}/status     one of them
    POST /v2/systemsharedmemory/region/{region}/register   {"key", "offset", "byte_size"}
    POST /v2/systemsharedmemory/region/{region}/unregister
    POST /v2/systemsharedmemory/unregister                 all of this caller's regions

They need a caller that may invoke (a token with ``admin``, ``invoke:*`` or
``invoke:<function>``, or no token where anonymous callers may invoke): regions are only good
for infer. They answer loopback callers only: a client elsewhere cannot share memory with this
host. A region belongs to its caller, the token or, without one, the local user
(:func:`owner_of`); a caller may register only objects its own local user owns (Note [region
owners] in ``oip_shm``).

CUDA shared memory (see :mod:`trims.runtime.gateway.oip_cuda_shm`), the same routes under
``/v2/cudasharedmemory``, registering ``{"raw_handle": {"b64"}, "device_id", "byte_size"}``:
on a host without a CUDA driver a registration answers 400 saying so (400, not 501: what the
caller should change is the request). A region name is one namespace per owner across both
kinds; infer finds a region by its name in either.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

from aiohttp import web

from trims.errors import PermissionDenied, RequestError, Unauthorized
from trims.peer_cred import is_loopback, peer_uid
from trims.runtime.gateway.context import auth_of, json_response, read_json
from trims.runtime.gateway.oip_cuda_shm import CudaSharedMemoryRegistry
from trims.runtime.gateway.oip_regions import OwnedRegions
from trims.runtime.gateway.oip_shm import SharedMemoryRegistry
from trims.runtime.gateway.tensors import ShmRef

__all__ = ["SHM", "SharedMemory", "add_routes", "cuda_available", "owner_of", "registry_of"]


class SharedMemory:
    """Both kinds of regions; infer reads and writes a region by name, whichever kind it is."""

    def __init__(self) -> None:
        self.system = SharedMemoryRegistry()
        self.cuda = CudaSharedMemoryRegistry()

    def read(self, owner: str, ref: ShmRef, what: str) -> bytes:
        if self.cuda.has(owner, ref.region):
            return self.cuda.read(owner, ref, what)
        return self.system.read(owner, ref, what)

    def write(self, owner: str, ref: ShmRef, data: bytes, what: str) -> None:
        if self.cuda.has(owner, ref.region):
            self.cuda.write(owner, ref, data, what)
        else:
            self.system.write(owner, ref, data, what)

    def close(self) -> None:
        self.system.close()
        self.cuda.close()


SHM = web.AppKey("trims.oip.shm", SharedMemory)


def registry_of(request: web.Request) -> SharedMemory:
    return request.app[SHM]


@functools.cache
def cuda_available() -> bool:
    """Whether this process can load the CUDA driver (``GET /v2`` then lists the extension)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def owner_of(request: web.Request) -> str:
    """Who owns the regions a request registers or names (Note [region owners] in
    ``oip_shm``): ``token:<name>`` for a caller with a token, ``uid:<n>`` for a caller
    without one (or any caller with authentication off), ``n`` its local user. Routes and
    infer ask this one function.

    Refuses a caller not on this host, a token that may not invoke, and a caller without a
    token whose local user the kernel does not say.
    """
    remote = request.remote or ""
    if not is_loopback(remote):
        raise PermissionDenied(
            f"shared memory is only for clients on the gateway's host, and {remote} is not a "
            "loopback address; send tensors in the request body instead"
        )
    auth = auth_of(request)
    token = auth.authenticate(request)
    if token is not None and not any(s == "admin" or s.startswith("invoke:") for s in token.scopes):
        if "Authorization" not in request.headers:
            raise Unauthorized(
                "shared memory needs a token that may invoke a function: send it as "
                "'Authorization: Bearer <token>'"
            )
        raise PermissionDenied(
            f"token {token.name!r} may not invoke any function, so it may not use shared memory"
        )
    if token is not None and not auth.is_anonymous(token):
        return f"token:{token.name}"
    uid = peer_uid(request.transport)
    if uid is None:
        raise PermissionDenied(
            "the gateway cannot tell which local user is calling, and shared-memory regions of "
            "a caller without a token belong to its local user; connect over loopback TCP, or "
            "send a token that may invoke ('Authorization: Bearer <token>')"
        )
    return f"uid:{uid}"


#: The path part and the registry attribute of each kind of region.
_KINDS = {"systemsharedmemory": "system", "cudasharedmemory": "cuda"}


def _regions(request: web.Request) -> OwnedRegions[Any]:
    """The registry of the kind of region the route names."""
    kind = _KINDS[request.path.split("/")[2]]
    registry: OwnedRegions[Any] = getattr(registry_of(request), kind)
    return registry


def _name_free(request: web.Request, owner: str, name: str) -> None:
    """A region name is one region across both kinds, per owner."""
    shm = registry_of(request)
    for other in (shm.system, shm.cuda):
        if other is not _regions(request) and other.has(owner, name):
            raise RequestError(
                f"region name {name!r} is a {other.kind} region of this caller; a name is one "
                "region across system and CUDA shared memory"
            )


async def status(request: web.Request) -> web.Response:
    owner = owner_of(request)
    return json_response(_regions(request).status(owner, request.match_info.get("region")))


async def register(request: web.Request) -> web.Response:
    owner = owner_of(request)
    doc = await read_json(request)
    name = request.match_info["region"]
    _name_free(request, owner, name)
    shm = registry_of(request)
    if _regions(request) is shm.cuda:
        shm.cuda.register(owner, name, doc)
        return json_response({})
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
        raise RequestError(
            'register needs a JSON object {"key": str, "offset": int, "byte_size": int}'
        )
    shm.system.register(
        owner, name, doc["key"], doc.get("offset", 0), doc.get("byte_size"),
        peer_uid(request.transport),
    )  # fmt: skip
    return json_response({})


async def unregister(request: web.Request) -> web.Response:
    owner = owner_of(request)
    name = request.match_info.get("region")
    if name is None:
        _regions(request).unregister_all(owner)
    else:
        _regions(request).unregister(owner, name)
    return json_response({})


def add_routes(app: web.Application) -> None:
    registry = SharedMemory()
    app[SHM] = registry

    async def close(app: web.Application) -> None:
        registry.close()

    app.on_cleanup.append(close)
    r = app.router
    for base in (f"/v2/{route}" for route in _KINDS):
        r.add_get(f"{base}/status", status)
        r.add_get(f"{base}/region/{{region}}/status", status)
        r.add_post(f"{base}/region/{{region}}/register", register)
        r.add_post(f"{base}/region/{{region}}/unregister", unregister)
        r.add_post(f"{base}/unregister", unregister)
