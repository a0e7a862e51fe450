"""Leases: which client connection holds which resident model, and for how long.

Note [lease keeps memory alive]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    connection ──owns──> lease ──pins──> (tier, digest) resident copy ──> memfd / device memory
        │                                          ▲
        └── disconnect / kill -9: every lease of   │ eviction and remove skip any
            the connection ends (release_all)      │ (tier, digest) with count > 0

A lease is the daemon's promise that the resident copy it points at stays where it is. While
any lease on a (tier, digest) is live, eviction never selects it and ``remove`` only detaches it
from the catalog: the tier keeps its fd (memfd or exported device memory) until the last lease
ends, and only then frees it. The daemon's fd is not what keeps a client's mapping valid (a
MAP_PRIVATE mapping holds its own reference to the memfd's pages, so a client keeps reading
even after the daemon closes its fd or is killed), but it is what lets the next acquire of the
same model share those very pages instead of loading a second copy, and for device memory it is
what keeps the allocation from being released while an importer still uses it.

Leases belong to the connection that acquired them: the kernel closes a client's socket when
the process dies, even by SIGKILL, the server sees EOF and ends every lease of that connection.
So a crashed client can never leak a reference (the reference-count leak of the original TrIMS).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass

from trims.errors import NotFound
from trims.protocol import PeerCredentials


@dataclass(frozen=True)
class Lease:
    id: str
    connection: int
    name: str
    version: str
    digest: str
    tier: str
    peer: PeerCredentials
    #: The process that sent the acquire; ``peer.pid`` is the one that connected, which is
    #: another process when a connection is passed on (a pooled worker's, made by the zygote).
    pid: int
    acquired_at: float

    def to_dict(self) -> dict[str, object]:
        return {
            "lease": self.id,
            "model": f"{self.name}:{self.version}",
            "tier": self.tier,
            "pid": self.pid,
            "connected_pid": self.peer.pid,
            "uid": self.peer.uid,
            "acquired_at": self.acquired_at,
        }


class LeaseTable:
    """Live leases by id, by connection, and a count per (tier, digest)."""

    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        self._counts: Counter[tuple[str, str]] = Counter()
        self._per_connection: Counter[int] = Counter()

    def grant(
        self,
        connection: int,
        name: str,
        version: str,
        digest: str,
        tier: str,
        peer: PeerCredentials,
        pid: int,
    ) -> Lease:
        lease = Lease(
            uuid.uuid4().hex, connection, name, version, digest, tier, peer, pid, time.time()
        )
        self._leases[lease.id] = lease
        self._counts[(tier, digest)] += 1
        self._per_connection[connection] += 1
        return lease

    def release(self, lease_id: str, connection: int) -> Lease:
        """End one lease of ``connection``; NotFound if it has no such lease."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.connection != connection:
            raise NotFound(f"lease {lease_id!r} is not held by this connection")
        del self._leases[lease_id]
        self._counts[(lease.tier, lease.digest)] -= 1
        if self._counts[(lease.tier, lease.digest)] <= 0:
            del self._counts[(lease.tier, lease.digest)]
        self._per_connection[connection] -= 1
        if self._per_connection[connection] <= 0:
            del self._per_connection[connection]
        return lease

    def release_all(self, connection: int) -> list[Lease]:
        ended = [lease for lease in self._leases.values() if lease.connection == connection]
        for lease in ended:
            self.release(lease.id, connection)
        return ended

    def count(self, tier: str, digest: str) -> int:
        return self._counts.get((tier, digest), 0)

    def held_by(self, connection: int) -> int:
        return self._per_connection.get(connection, 0)

    def __len__(self) -> int:
        return len(self._leases)

    def all(self) -> list[Lease]:
        return list(self._leases.values())
