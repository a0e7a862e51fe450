"""The narrow interface of a memory tier (cpu, gpu): load a verified layout, export, free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from trims.daemon.tiers.disk import Stamp
from trims.protocol import Progress


@dataclass(frozen=True)
class Export:
    """How a client maps a resident copy: the ``handle`` dict and at most one descriptor.

    ``fd`` stays owned by the tier (the client receives its own duplicate via SCM_RIGHTS).
    """

    handle: dict[str, Any]
    fd: int | None


class Loaded(NamedTuple):
    """What a load proved about the disk file it read (Note [trusted re-loads] in
    :mod:`trims.daemon.residency`)."""

    #: The file's stamp when its bytes were the verified ones for the whole load; None when
    #: the load cannot vouch for the file (its stamp moved during the copy, the tier does not
    #: look at it, as the GPU tier, or the copy was already resident).
    stamp: Stamp | None
    #: Bytes hashed to verify the load: ``size``, or 0 when nothing was hashed (the file was
    #: trusted by its stamp, or the copy was already resident).
    hashed: int


class MemoryTier(Protocol):
    name: str

    def load(
        self,
        digest: str,
        source: Path,
        size: int,
        label: str,
        progress: Progress | None = None,
        verified: Stamp | None = None,
    ) -> Loaded:
        """Blocking: bring ``size`` bytes of the disk layout in, verified; raise on failure.

        ``verified`` is the stamp under which this daemon last hashed ``source``; a tier may
        skip hashing a file that still has it where that is as safe as the hash.
        """

    def export(self, digest: str) -> Export:
        """The handle and descriptor of a resident copy (KeyError if not resident)."""

    def free(self, digest: str) -> None:
        """Release the tier's copy (only called when no lease holds it)."""

    def close(self) -> None:
        """Free everything (daemon shutdown)."""
