"""The store's operations (acquire, release, info, ... remove) over catalog, leases, residency.

Runs on the daemon's event loop. Operations resolve a model in the catalog, ask the residency
(:mod:`trims.daemon.residency`) for a copy in the wanted tier, and lease it to the caller's
connection.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from trims import __version__
from trims.config import DaemonSettings, format_size
from trims.daemon.catalog import AccessList, Catalog, ModelRecord
from trims.daemon.leases import LeaseTable
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.residency import MEMORY_TIERS, TIERS, Progress, Residency
from trims.daemon.tiers.gpu import GpuTier
from trims.errors import (
    AlreadyExists,
    CorruptModel,
    NotFound,
    PermissionDenied,
    QueueFull,
    ValidationError,
)
from trims.layout import Manifest
from trims.protocol import PROTOCOL_VERSION, PeerCredentials
from trims.telemetry import tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

#: Most leases one connection may hold at once (a bound on what one client can pin).
MAX_LEASES_PER_CONNECTION = 4096


@dataclass(frozen=True)
class Reply:
    """An operation's result and the descriptors to attach (``close_fds``: ours to close)."""

    result: dict[str, Any]
    fds: tuple[int, ...] = ()
    close_fds: bool = False


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the connection, the peer's credentials, and which socket."""

    connection: int
    peer: PeerCredentials
    admin: bool


class Store:
    """All store state. Create, ``start()`` (start-up recovery), serve, ``close()``."""

    def __init__(
        self,
        settings: DaemonSettings,
        metrics: DaemonMetrics,
        *,
        policies: dict[str, str] | None = None,
        gpu: GpuTier | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        settings.store_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.catalog = Catalog(settings.store_dir / "catalog.sqlite")
        self.leases = LeaseTable()
        self.res = Residency(
            settings, metrics, self.catalog, self.leases, policies=policies or {}, gpu=gpu
        )
        self.connections = 0
        self._manifests: dict[str, Manifest] = {}

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start-up recovery: drop disk temps, register disk blobs the catalog lacks."""
        removed = self.res.disk.cleanup_temps()
        if removed:
            log.info("removed %d unfinished temp file(s) from the disk tier", removed)
        known = {r.digest for r in self.catalog.all()}
        for digest in self.res.disk.digests():
            if digest in known:
                continue
            try:
                m = self.res.disk.manifest(digest)
                self.catalog.check_free(m.name, m.version)
            except (CorruptModel, ValidationError, AlreadyExists) as e:
                log.warning("disk blob %s left unregistered: %s", digest[:12], e)
                continue
            self.catalog.add(self._record_from_manifest(m, source=""))
            log.info("model %s:%s registered from the disk tier", m.name, m.version)
        missing = [r.key for r in self.catalog.all() if not self.res.disk.contains(r.digest)]
        if missing:
            log.warning(
                "models %s have no disk copy; they are fetched again from their source when "
                "acquired",
                ", ".join(missing),
            )
        self.res.sync_disk_ledger()
        self._update_gauges()

    def close(self) -> None:
        self.res.close()
        self.catalog.close()

    # ---- helpers --------------------------------------------------------------------------

    @staticmethod
    def _record_from_manifest(
        m: Manifest, *, source: str, access: AccessList | None = None
    ) -> ModelRecord:
        return ModelRecord(
            name=m.name,
            version=m.version,
            digest=m.digest,
            framework=m.framework,
            format=str(m.metadata.get("source_format", m.framework)),
            source=source,
            total_bytes=m.total_bytes,
            added_at=time.time(),
            access=access or AccessList(),
        )

    def _resolve(self, name: str, version: str | None, digest: str | None) -> ModelRecord:
        if digest is None:
            return self.catalog.get(name, version)
        for r in self.catalog.by_digest(digest):
            if r.name == name and version in (None, r.version):
                return r
        raise NotFound(f"model {name} has no version with digest {digest[:12]}")

    async def _manifest(self, record: ModelRecord) -> Manifest:
        """The record's manifest (fetching the layout again if its disk copy is gone)."""
        m = self._known_manifest(record)
        if m is None:
            await self.res.ensure_disk(record)
            m = self._known_manifest(record)
            assert m is not None
        return m

    def _known_manifest(self, record: ModelRecord) -> Manifest | None:
        """The manifest from the cache or the disk tier, named as the record; None if neither."""
        m = self._manifests.get(record.digest)
        if m is None:
            if not self.res.disk.contains(record.digest):
                return None
            m = self.res.disk.manifest(record.digest)
            self._manifests[record.digest] = m
        return dataclasses.replace(m, name=record.name, version=record.version)

    def _update_gauges(self) -> None:
        self.res.update_gauges()
        self.metrics.leases.set(len(self.leases))
        self.metrics.connections.set(self.connections)

    def model_dict(self, r: ModelRecord, *, admin: bool, tensors: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": r.name,
            "version": r.version,
            "digest": r.digest,
            "framework": r.framework,
            "format": r.format,
            "total_bytes": r.total_bytes,
            "added_at": r.added_at,
            "tiers": self.res.resident_tiers(r.digest),
            "pins": sorted(r.pins),
            "leases": sum(self.leases.count(t, r.digest) for t in TIERS),
        }
        if admin:
            d["source"] = r.source
            d["access"] = r.access.to_dict()
        manifest = self._known_manifest(r) if tensors else None
        if manifest is not None:
            d["manifest"] = manifest.to_dict()
        return d

    # ---- operations -----------------------------------------------------------------------

    def hello(self, caller: Caller) -> Reply:
        return Reply(
            {
                "daemon_version": __version__,
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "admin": caller.admin,
            }
        )

    async def acquire(
        self,
        caller: Caller,
        name: str,
        version: str | None,
        digest: str | None,
        tier: str,
        device: str | None,
    ) -> Reply:
        started = time.monotonic()
        with _tracer.start_as_current_span("acquire") as span:
            span.set_attribute("trims.model", name)
            span.set_attribute("trims.tier", tier)
            if self.leases.held_by(caller.connection) >= MAX_LEASES_PER_CONNECTION:
                raise QueueFull(
                    f"this connection holds {MAX_LEASES_PER_CONNECTION} leases, the most one "
                    "connection may hold; release some before acquiring more"
                )
            record = self._resolve(name, version, digest)
            if not record.access.allows(caller.peer.uid, caller.peer.gid):
                raise PermissionDenied(
                    f"uid {caller.peer.uid} / gid {caller.peer.gid} may not acquire model "
                    f"{record.key}; ask the store's owner to add you to its access list"
                )
            manifest = await self._manifest(record)
            disk_copy = self.res.disk_ledger.residents.get(record.digest)
            if disk_copy is not None:
                disk_copy.touch()
            if tier == "disk":
                await self.res.ensure_disk(record)
                await self.res.verify_disk(record)
                try:
                    fd = os.open(self.res.disk.path(record.digest), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError as e:
                    raise NotFound(f"model {record.key} was removed while it was acquired") from e
                handle: dict[str, Any] = {"kind": "file", "size": record.total_bytes}
                fds: tuple[int, ...] = (fd,)
                close = True
            else:
                if tier == "gpu":
                    self._check_device(device)
                resident = await self.res.ensure_resident(tier, record)
                resident.touch()
                export = self.res.tiers[tier].export(record.digest)
                handle = export.handle
                fds, close = ((export.fd,) if export.fd is not None else ()), False
            lease = self.leases.grant(
                caller.connection, record.name, record.version, record.digest, tier, caller.peer
            )
            self._update_gauges()
            self.metrics.acquire_latency.labels(tier).observe(time.monotonic() - started)
            return Reply(
                {
                    "lease": lease.id,
                    "tier": tier,
                    "manifest": manifest.to_dict(),
                    "handle": handle,
                },
                fds,
                close,
            )

    def _check_device(self, device: str | None) -> None:
        if self.res.gpu is None or device is None:
            return
        names = self.res.gpu.names()
        if device not in names:
            raise ValidationError(
                f"device {device!r} is not served by this daemon; it serves {list(names)}"
            )

    def release(self, caller: Caller, lease_id: str) -> Reply:
        lease = self.leases.release(lease_id, caller.connection)
        self._after_lease_end(lease.tier, lease.digest)
        self._update_gauges()
        return Reply({})

    def end_connection(self, connection: int) -> int:
        """The connection closed (or its process died): end all its leases."""
        ended = self.leases.release_all(connection)
        for lease in ended:
            self._after_lease_end(lease.tier, lease.digest)
        self._update_gauges()
        return len(ended)

    def _after_lease_end(self, tier: str, digest: str) -> None:
        """Free a copy whose model was removed while leased, once its last lease ends."""
        if tier not in MEMORY_TIERS or self.leases.count(tier, digest):
            return
        resident = self.res.ledgers[tier].residents.get(digest)
        if resident is not None and not self.catalog.by_digest(digest):
            self.res.evict(tier, resident, "its model was removed and its last lease ended")

    def info(self, caller: Caller, name: str, version: str | None) -> Reply:
        record = self.catalog.get(name, version)
        return Reply({"model": self.model_dict(record, admin=caller.admin, tensors=True)})

    def list(self, caller: Caller) -> Reply:
        return Reply(
            {"models": [self.model_dict(r, admin=caller.admin) for r in self.catalog.all()]}
        )

    def stats(self, caller: Caller) -> Reply:
        tiers: dict[str, Any] = {}
        for t in MEMORY_TIERS:
            ledger = self.res.ledgers[t]
            tiers[t] = {
                "budget": ledger.budget,
                "used": ledger.used,
                "reserved": ledger.reserved,
                "models": len(ledger.residents),
                "policy": ledger.policy,
                "loads": self.res.loads[t],
                "evictions": self.res.evictions[t],
                "available": t in self.res.tiers,
            }
        tiers["disk"] = {
            "budget": self.settings.budgets.disk,
            "used": self.res.disk.used_bytes(),
            "models": len(self.res.disk.digests()),
            "policy": self.res.disk_ledger.policy,
            "loads": self.res.loads["disk"],
            "evictions": self.res.evictions["disk"],
            "available": True,
        }
        result: dict[str, Any] = {
            "tiers": tiers,
            "leases": len(self.leases),
            "clients": self.connections,
        }
        if caller.admin:
            result["lease_table"] = [lease.to_dict() for lease in self.leases.all()]
        return Reply(result)

    async def load(
        self,
        caller: Caller,
        name: str,
        version: str | None,
        tier: str,
        progress: Progress | None,
    ) -> Reply:
        record = self.catalog.get(name, version)
        if tier == "disk":
            await self.res.ensure_disk(record)
            await self.res.verify_disk(record)
        else:
            await self.res.ensure_resident(tier, record, progress)
        return Reply({"model": self.model_dict(record, admin=True)})

    async def evict(
        self, caller: Caller, name: str, version: str | None, tier: str | None
    ) -> Reply:
        record = self.catalog.get(name, version)
        evicted: list[str] = []
        for t in [tier] if tier else list(MEMORY_TIERS):
            leased = self.leases.count(t, record.digest)
            if leased:
                raise ValidationError(
                    f"model {record.key} has {leased} live lease(s) in the {t} tier and stays "
                    "until they are released"
                )
            if self.catalog.pinned_in(record.digest, t):
                raise ValidationError(
                    f"model {record.key} is pinned in the {t} tier; unpin it first"
                )
            if t == "disk":
                if self.res.disk.contains(record.digest):
                    self.res.evict_disk(record.digest, "evicted on request")
                    evicted.append(t)
                continue
            resident = self.res.ledgers[t].residents.get(record.digest)
            if resident is not None:
                self.res.evict(t, resident, "evicted on request")
                evicted.append(t)
        self._update_gauges()
        return Reply({"evicted": evicted, "model": self.model_dict(record, admin=True)})

    async def pin(self, caller: Caller, name: str, version: str | None, tier: str) -> Reply:
        record = self.catalog.get(name, version)
        if tier == "disk":
            await self.res.ensure_disk(record)
        else:
            await self.res.ensure_resident(tier, record)
        self.catalog.set_pins(record.name, record.version, record.pins | {tier})
        log.info("model %s pinned in the %s tier", record.key, tier)
        return Reply({"model": self.model_dict(self.catalog.get(name, record.version), admin=True)})

    def unpin(self, caller: Caller, name: str, version: str | None, tier: str | None) -> Reply:
        record = self.catalog.get(name, version)
        pins = record.pins - {tier} if tier else frozenset()
        self.catalog.set_pins(record.name, record.version, frozenset(pins))
        return Reply({"model": self.model_dict(self.catalog.get(name, record.version), admin=True)})

    async def add(
        self,
        caller: Caller,
        name: str,
        source: str,
        version: str,
        fmt: str | None,
        sha256: str | None,
        access: AccessList,
        progress: Progress | None,
    ) -> Reply:
        self.catalog.check_free(name, version)
        manifest = await self.res.ingest_with_room(source, name, version, fmt, sha256, progress)
        record = self._record_from_manifest(manifest, source=source, access=access)
        record = dataclasses.replace(record, name=name, version=version)
        self.catalog.add(record)
        self._manifests[manifest.digest] = manifest
        self.res.mark_verified(manifest.digest)
        self._update_gauges()
        log.info(
            "model %s added (%s, %s)", record.key, record.format, format_size(record.total_bytes)
        )
        return Reply({"model": self.model_dict(record, admin=True)})

    def remove(self, caller: Caller, name: str, version: str | None, force: bool) -> Reply:
        records = (
            [self.catalog.get(name, version)]
            if version
            else [r for r in self.catalog.all() if r.name == name]
        )
        if not records:
            raise NotFound(f"model {name} is not in the store")
        for r in records:
            leased = sum(self.leases.count(t, r.digest) for t in TIERS)
            if leased and not force:
                raise ValidationError(
                    f"model {r.key} has {leased} live lease(s); release them first or remove "
                    "with force (leased copies are freed when their last lease ends)"
                )
        for r in records:
            self.catalog.remove(r.name, r.version)
            if self.catalog.by_digest(r.digest):
                continue
            for t in MEMORY_TIERS:
                resident = self.res.ledgers[t].residents.get(r.digest)
                if resident is not None and not self.leases.count(t, r.digest):
                    self.res.evict(t, resident, f"model {r.key} was removed")
            if self.res.disk.contains(r.digest):
                self.res.disk.remove(r.digest)
                self.res.sync_disk_ledger()
            self._manifests.pop(r.digest, None)
            self.res.forget(r.digest)
            log.info("model %s removed from the store", r.key)
        self._update_gauges()
        return Reply({"removed": [r.key for r in records]})
