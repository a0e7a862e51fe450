"""What both shared-memory extensions keep the same way: regions by owner and name.

A region belongs to the caller that registered it, its owner (a token, or the local user of a
caller without one: :func:`trims.runtime.gateway.api_oip_shm.owner_of`): another owner can
neither see, use nor unregister it. An owner holds at most ``max_regions`` at once. A request
naming a region is checked against the region's registered size before any byte moves.
:class:`OwnedRegions` is that bookkeeping; the system (:mod:`.oip_shm`) and CUDA
(:mod:`.oip_cuda_shm`) registries add how a region is opened and how bytes are copied.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Generic, Protocol, TypeVar

from trims.errors import AlreadyExists, NotFound, RequestError, ResourceExhausted
from trims.runtime.gateway.tensors import ShmRef

__all__ = ["MAX_REGIONS_PER_OWNER", "OwnedRegions"]

log = logging.getLogger(__name__)

#: Regions one owner may hold at once (each holds a descriptor or a device mapping).
MAX_REGIONS_PER_OWNER = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class RegionLike(Protocol):
    name: str
    byte_size: int

    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


R = TypeVar("R", bound=RegionLike)


class OwnedRegions(Generic[R]):
    """Regions by owner, then name; ``kind`` names them in messages ("shared-memory"),
    ``route`` is the extension's path part ("systemsharedmemory")."""

    def __init__(self, kind: str, route: str, max_regions: int = MAX_REGIONS_PER_OWNER) -> None:
        self.kind = kind
        self.route = route
        self._max = max_regions
        self._regions: dict[str, dict[str, R]] = {}
        self._closed = False

    def _admit(self, owner: str, name: str) -> None:
        """Refuse a registration before anything is opened: shutting down, a bad or taken
        name, or the owner's cap reached."""
        if self._closed:
            raise RequestError("the gateway is shutting down; register on another gateway")
        if not _NAME_RE.fullmatch(name):
            raise RequestError(
                f"region name {name!r} must be 1-128 letters, digits, '_', '.' or '-'"
            )
        mine = self._regions.get(owner, {})
        if name in mine:
            raise AlreadyExists(
                f"{self.kind} region {name!r} is registered; unregister it first "
                f"(POST /v2/{self.route}/region/{name}/unregister)"
            )
        if len(mine) >= self._max:
            raise ResourceExhausted(
                f"this caller holds {len(mine)} {self.kind} regions, the most one may; "
                "unregister some first"
            )

    def _add(self, owner: str, region: R) -> None:
        self._regions.setdefault(owner, {})[region.name] = region

    def owned(self) -> dict[str, dict[str, R]]:
        """Every owner's regions (read-only use: checks across owners)."""
        return self._regions

    def has(self, owner: str, name: str) -> bool:
        return name in self._regions.get(owner, {})

    def unregister(self, owner: str, name: str) -> None:
        region = self._regions.get(owner, {}).pop(name, None)
        if region is None:
            raise NotFound(f"no {self.kind} region named {name!r} is registered by this caller")
        _close(region)

    def unregister_all(self, owner: str) -> None:
        for region in self._regions.pop(owner, {}).values():
            _close(region)

    def status(self, owner: str, name: str | None = None) -> list[dict[str, Any]]:
        mine = self._regions.get(owner, {})
        if name is None:
            return [r.describe() for r in mine.values()]
        if name not in mine:
            raise NotFound(f"no {self.kind} region named {name!r} is registered by this caller")
        return [mine[name].describe()]

    def close(self) -> None:
        """Close every region (the gateway is shutting down)."""
        self._closed = True
        regions, self._regions = self._regions, {}
        for owned in regions.values():
            for region in owned.values():
                _close(region)

    def _use(self, owner: str, ref: ShmRef, what: str) -> R:
        """The region ``ref`` names, its window checked against the region's size."""
        region = self._regions.get(owner, {}).get(ref.region)
        if region is None:
            raise RequestError(
                f"{what}: no {self.kind} region named {ref.region!r} is registered by this "
                f"caller; register it first (POST /v2/{self.route}/region/{ref.region}/register)"
            )
        if ref.offset + ref.byte_size > region.byte_size:
            raise RequestError(
                f"{what}: shared_memory_offset {ref.offset} + shared_memory_byte_size "
                f"{ref.byte_size} run past region {region.name} ({region.byte_size} bytes)"
            )
        return region


def fits_output(ref: ShmRef, data: bytes, what: str) -> None:
    """RequestError when an output is larger than the window asked to receive it."""
    if len(data) > ref.byte_size:
        raise RequestError(
            f"{what} is {len(data)} bytes; its shared_memory_byte_size {ref.byte_size} "
            "cannot hold it"
        )


def _close(region: RegionLike) -> None:
    try:
        region.close()
    except Exception as e:  # one region that fails to close must not keep the others open
        log.warning("closing region %s failed: %s", region.name, e)
    log.info("region %s unregistered", region.name)
