"""The narrow interface of a memory tier (cpu, gpu): load a verified layout, export, free."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trims.protocol import Progress


@dataclass(frozen=True)
class Export:
    """How a client maps a resident copy: the ``handle`` dict and at most one descriptor.

    ``fd`` stays owned by the tier (the client receives its own duplicate via SCM_RIGHTS).
    """

    handle: dict[str, Any]
    fd: int | None


class MemoryTier(Protocol):
    name: str

    def load(
        self, digest: str, source: Path, size: int, label: str, progress: Progress | None = None
    ) -> None:
        """Blocking: copy ``size`` bytes of the disk layout in, verify them; raise on failure."""

    def export(self, digest: str) -> Export:
        """The handle and descriptor of a resident copy (KeyError if not resident)."""

    def free(self, digest: str) -> None:
        """Release the tier's copy (only called when no lease holds it)."""

    def close(self) -> None:
        """Free everything (daemon shutdown)."""
