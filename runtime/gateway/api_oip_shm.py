"""The shared-memory extensions' routes: Triton's system shared memory, and CUDA's answer.

System shared memory (see :mod:`trims.runtime.gateway.oip_shm`)::

    GET  /v2/systemsharedmemory/status                     this token's regions
    GET  /v2/systemsharedmemory/region/{region}/status     one of them
    POST /v2/systemsharedmemory/region/{region}/register   {"key", "offset", "byte_size"}
    POST /v2/systemsharedmemory/region/{region}/unregister
    POST /v2/systemsharedmemory/unregister                 all of this token's regions

They need a token that may invoke (``admin``, ``invoke:*`` or ``invoke:<function>``): regions
are only good for infer. They answer loopback callers only: a client elsewhere cannot share
memory with this host; and a caller may register only objects its own local user owns (Note
[region owners] in ``oip_shm``).

CUDA shared memory (``/v2/cudasharedmemory/...``) needs CUDA IPC in the gateway, which this
gateway does not have (not built yet; and on a host without a GPU it could not have it): every
route answers 400 saying so and pointing to system shared memory (400, not 501: what the caller
should change is the request).
"""

from __future__ import annotations

import ipaddress
import os

from aiohttp import web

from trims.errors import PermissionDenied, RequestError, Unauthorized
from trims.runtime.gateway.context import auth_of, json_response, read_json
from trims.runtime.gateway.oip_shm import SharedMemoryRegistry
from trims.runtime.gateway.peer_cred import peer_uid

__all__ = ["SHM", "add_routes", "owner_of", "registry_of"]

SHM = web.AppKey("trims.oip.shm", SharedMemoryRegistry)


def registry_of(request: web.Request) -> SharedMemoryRegistry:
    return request.app[SHM]


def owner_of(request: web.Request) -> str:
    """Who owns the regions a request names: its token ("" when authentication is off)."""
    token = auth_of(request).authenticate(request)
    return "" if token is None else token.name


def _is_local(remote: str) -> bool:
    """A loopback address (IPv4-mapped ones too), or "" for a Unix socket: the same host."""
    if remote == "":
        return True
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def _require_local_invoker(request: web.Request) -> str:
    """The owner of a shared-memory request from a loopback caller that may invoke."""
    remote = request.remote or ""
    if not _is_local(remote):
        raise PermissionDenied(
            f"shared memory is only for clients on the gateway's host, and {remote} is not a "
            "loopback address; send tensors in the request body instead"
        )
    auth = auth_of(request)
    token = auth.authenticate(request)
    if token is None:
        return ""
    if not any(s == "admin" or s.startswith("invoke:") for s in token.scopes):
        if "Authorization" not in request.headers:
            raise Unauthorized(
                "shared memory needs a token that may invoke a function: send it as "
                "'Authorization: Bearer <token>'"
            )
        raise PermissionDenied(
            f"token {token.name!r} may not invoke any function, so it may not use shared memory"
        )
    return token.name


async def status(request: web.Request) -> web.Response:
    owner = _require_local_invoker(request)
    return json_response(registry_of(request).status(owner, request.match_info.get("region")))


async def register(request: web.Request) -> web.Response:
    owner = _require_local_invoker(request)
    doc = await read_json(request)
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
        raise RequestError(
            'register needs a JSON object {"key": str, "offset": int, "byte_size": int}'
        )
    registry_of(request).register(
        owner, request.match_info["region"], doc["key"], doc.get("offset", 0),
        doc.get("byte_size"), peer_uid(request.transport),
    )  # fmt: skip
    return json_response({})


async def unregister(request: web.Request) -> web.Response:
    owner = _require_local_invoker(request)
    name = request.match_info.get("region")
    if name is None:
        registry_of(request).unregister_all(owner)
    else:
        registry_of(request).unregister(owner, name)
    return json_response({})


def _cuda_unsupported() -> str:
    # The NVIDIA driver's control device exists on every host with a usable NVIDIA GPU.
    why = "no GPU" if not os.path.exists("/dev/nvidiactl") else "its CUDA IPC is not built yet"
    return (
        f"CUDA shared memory is not supported on this gateway: {why}; pass tensors in system "
        "shared memory (/v2/systemsharedmemory) or in the body"
    )


async def cuda(request: web.Request) -> web.Response:
    raise RequestError(_cuda_unsupported())


def add_routes(app: web.Application) -> None:
    registry = SharedMemoryRegistry()
    app[SHM] = registry

    async def close(app: web.Application) -> None:
        registry.close()

    app.on_cleanup.append(close)
    r = app.router
    base = "/v2/systemsharedmemory"
    r.add_get(f"{base}/status", status)
    r.add_get(f"{base}/region/{{region}}/status", status)
    r.add_post(f"{base}/region/{{region}}/register", register)
    r.add_post(f"{base}/region/{{region}}/unregister", unregister)
    r.add_post(f"{base}/unregister", unregister)
    cuda_base = "/v2/cudasharedmemory"
    r.add_get(f"{cuda_base}/status", cuda)
    r.add_get(f"{cuda_base}/region/{{region}}/status", cuda)
    r.add_post(f"{cuda_base}/region/{{region}}/register", cuda)
    r.add_post(f"{cuda_base}/region/{{region}}/unregister", cuda)
    r.add_post(f"{cuda_base}/unregister", cuda)
