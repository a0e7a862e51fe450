"""Triton's system shared-memory extension: POSIX shared-memory regions clients register.

A client on the gateway's host creates a POSIX shared-memory object (``shm_open``; what
``tritonclient.utils.shared_memory`` does), registers a window of it under a region name, and
then passes infer inputs and outputs by reference (``shared_memory_region``,
``shared_memory_offset``, ``shared_memory_byte_size``) instead of in the body.

Note [region mappings]
~~~~~~~~~~~~~~~~~~~~~~
A registration opens the object and keeps only its file descriptor (read-write when the
gateway's user may write it, else read-only). Nothing is ever mapped: each use copies exactly
the bytes it names with ``pread`` (an input) or ``pwrite`` (an output)::

    register    open(key) -> fd, checked: a regular file on the shm filesystem, owned by the
                caller, big enough
    input       fstat(fd) >= end?  pread(fd, size, offset): short -> 400
    output      fstat(fd) >= end?  pwrite(fd, bytes, offset)
    unregister  close(fd)          (also for every region when the gateway shuts down)

So the gateway never holds a writable view of an input, and a client that shrinks its object
(after registering, or racing a copy) gets a 400 naming the region: a read of a truncated
object comes back short, where a mapping would have faulted the whole gateway with SIGBUS.
Offsets and sizes are checked against the registered window on every use.

Note [region owners]
~~~~~~~~~~~~~~~~~~~~
The gateway opens an object with its own rights, which may be more than the caller's (a gateway
running as root can open any user's object). So a caller may register only an object its own
local user owns: the gateway learns that user from the connection (``SO_PEERCRED`` over a Unix
socket, the kernel's TCP table on loopback; :mod:`trims.runtime.gateway.peer_cred`) and
compares it with the object's owner. A caller whose user cannot be told is refused.

Ownership: a region belongs to the caller that registered it (``owner_of`` in
:mod:`trims.runtime.gateway.api_oip_shm` names it, for the routes and infer alike)::

    a request with a token         owner "token:<name>"
    a request without one          owner "uid:<n>", n the calling local user as above (with
    (or authentication off)        authentication off, every request); refused when the
                                   kernel does not say

so two local users who call without a token are two owners, as two tokens are, and a token
name can never equal a uid's owner. Another owner can neither see, use nor unregister a region:
for it the region does not exist. A key registered by one owner cannot be registered by
another, so no caller can read or overwrite another's tensors through the gateway. Each owner
holds at most :data:`MAX_REGIONS_PER_OWNER`, so one filling its cap leaves the others theirs.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import posix_ipc

from trims.errors import NotFound, RequestError
from trims.runtime.gateway.oip_regions import MAX_REGIONS_PER_OWNER, OwnedRegions, fits_output
from trims.runtime.gateway.tensors import ShmRef

__all__ = ["MAX_REGIONS_PER_OWNER", "Region", "SharedMemoryRegistry"]

log = logging.getLogger(__name__)


#: Where POSIX shared-memory objects live on Linux; a key must open a file on this filesystem.
SHM_DIR = "/dev/shm"

_KEY_RE = re.compile(r"/?[A-Za-z0-9_.-]{1,250}")


@dataclass(eq=False)
class Region:
    """A registered window of a shared-memory object: ``byte_size`` bytes from ``offset``."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    writable: bool

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def close(self) -> None:
        os.close(self.fd)


class SharedMemoryRegistry(OwnedRegions[Region]):
    """The system shared-memory regions registered on one gateway."""

    def __init__(self, max_regions_per_owner: int = MAX_REGIONS_PER_OWNER) -> None:
        super().__init__("system shared-memory", "systemsharedmemory", max_regions_per_owner)

    def register(
        self, owner: str, name: str, key: str, offset: Any, byte_size: Any, caller_uid: int | None
    ) -> None:
        """Register ``byte_size`` bytes at ``offset`` of object ``key`` as ``name`` for
        ``owner`` (both as the request sent them, checked here); ``caller_uid`` is the calling
        local user (Note [region owners])."""
        self._admit(owner, name)
        if not _KEY_RE.fullmatch(key) or key.strip("/") in (".", ".."):
            raise RequestError(
                f"key {key!r} must name a POSIX shared-memory object: '/' and 1-250 letters, "
                "digits, '_', '.' or '-' (as tritonclient's create_shared_memory_region takes)"
            )
        key = "/" + key.lstrip("/")
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise RequestError(f"'{what}' must be a non-negative integer, got {value!r}")
        if byte_size == 0:
            raise RequestError("'byte_size' must be at least 1")
        for other, regions in self.owned().items():
            if other != owner and any(r.key == key for r in regions.values()):
                raise RequestError(
                    f"key {key} is registered by another caller; create an object of your own"
                )
        if caller_uid is None:
            raise RequestError(
                "the gateway cannot tell which local user is calling, so it cannot check that "
                "the shared-memory object is yours; connect over loopback TCP or the gateway's "
                "Unix socket"
            )
        fd, writable = _open(key)
        try:
            size = _checked_size(fd, key)
            object_uid = os.fstat(fd).st_uid
            if object_uid != caller_uid:
                raise RequestError(
                    f"shared-memory object {key} belongs to uid {object_uid}, not to the calling "
                    f"user (uid {caller_uid}); register an object you created"
                )
            if offset + byte_size > size:
                raise RequestError(
                    f"shared-memory object {key} is {size} bytes; offset {offset} + byte_size "
                    f"{byte_size} run past its end"
                )
        except BaseException:
            os.close(fd)
            raise
        self._add(owner, Region(name, key, offset, byte_size, fd, writable))
        log.info(
            "shared-memory region %s registered (key %s, %d bytes at %d, %s)",
            name, key, byte_size, offset, "read-write" if writable else "read-only",
        )  # fmt: skip

    def read(self, owner: str, ref: ShmRef, what: str) -> bytes:
        """A copy of the bytes ``ref`` names (for ``what``, e.g. "input 'x'")."""
        region = self._in_object(owner, ref, what, ref.byte_size)
        if ref.byte_size == 0:
            return b""
        data = os.pread(region.fd, ref.byte_size, region.offset + ref.offset)
        if len(data) != ref.byte_size:
            raise _shrank(region, what, os.fstat(region.fd).st_size)
        return data

    def write(self, owner: str, ref: ShmRef, data: bytes, what: str) -> None:
        """Write ``data`` at ``ref`` (for ``what``, e.g. "output 'y'")."""
        fits_output(ref, data, what)
        region = self._in_object(owner, ref, what, len(data))
        if not region.writable:
            raise RequestError(
                f"shared-memory region {region.name} is read-only to the gateway (key "
                f"{region.key}); give the gateway's user write access to receive {what} in it"
            )
        view, at = memoryview(data), region.offset + ref.offset
        while view:
            written = os.pwrite(region.fd, view, at)
            view, at = view[written:], at + written

    def _in_object(self, owner: str, ref: ShmRef, what: str, size: int) -> Region:
        """:meth:`_use`, and the window still inside the object (which its client may have
        shrunk since it registered it)."""
        region = self._use(owner, ref, what)
        end = region.offset + ref.offset + size
        current = os.fstat(region.fd).st_size
        if end > current:
            raise _shrank(region, what, current)
        return region


def _shrank(region: Region, what: str, size: int) -> RequestError:
    return RequestError(
        f"{what}: shared-memory object {region.key} shrank to {size} bytes since region "
        f"{region.name} was registered; register it again"
    )


def _open(key: str) -> tuple[int, bool]:
    """Open an existing object read-write, else read-only: (fd, writable)."""
    for read_only in (False, True):
        try:
            shm = posix_ipc.SharedMemory(key, flags=0, read_only=read_only)
        except posix_ipc.PermissionsError:
            continue
        except posix_ipc.ExistentialError:
            raise NotFound(
                f"no shared-memory object {key} exists on the gateway's host: create it first "
                "(shm_open; tritonclient.utils.shared_memory.create_shared_memory_region)"
            ) from None
        except (OSError, ValueError, posix_ipc.Error) as e:
            raise RequestError(f"cannot open shared-memory object {key}: {e}") from None
        return shm.fd, not read_only
    raise RequestError(
        f"the gateway's user may not open shared-memory object {key}; create it with a mode "
        "that lets the gateway's user read it (and write it, for outputs)"
    )


def _checked_size(fd: int, key: str) -> int:
    """The object's size; refuses anything but a regular file on the shm filesystem (a
    symbolic link placed in /dev/shm would otherwise let a caller read the gateway's files)."""
    info = os.fstat(fd)
    try:
        shm_dev = os.stat(SHM_DIR).st_dev
    except OSError:
        shm_dev = info.st_dev
    if not stat.S_ISREG(info.st_mode) or info.st_dev != shm_dev:
        raise RequestError(f"{key} is not a POSIX shared-memory object")
    return info.st_size
