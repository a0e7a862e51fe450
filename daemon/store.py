"""The store: catalog + tiers + leases + budgets, and the operations the server dispatches to.

Runs on the daemon's event loop; blocking work (copying into a memfd, hashing, converting,
downloading) goes to threads. Loads are single-flight: one in-flight load per (tier, digest),
every concurrent request for the same copy awaits it (Note [single-flight loads]).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trims.daemon.catalog import AccessList, Catalog, ModelRecord
from trims.daemon.eviction import Resident, TierLedger
from trims.daemon.leases import LeaseTable
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.tiers.cpu import CpuTier
from trims.daemon.tiers.disk import DiskTier
from trims.daemon.tiers.gpu import GpuTier
from trims.daemon.tiers.memory import MemoryTier

from trims import __version__
from trims.config import DaemonSettings, format_size
from trims.errors import (
    AlreadyExists,
    CorruptModel,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    ValidationError,
)
from trims.layout import Manifest
from trims.protocol import PROTOCOL_VERSION, PeerCredentials
from trims.telemetry import tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

Progress = Callable[[str, int, int | None], None]
MEMORY_TIERS = ("cpu", "gpu")
#: Loads tried for one acquire when concurrent loads keep evicting the fresh copy.
_LOAD_ATTEMPTS = 3
TIERS = ("gpu", "cpu", "disk")


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
        settings.store_dir.mkdir(parents=True, exist_ok=True)
        self.catalog = Catalog(settings.store_dir / "catalog.sqlite")
        self.disk = DiskTier(settings.store_dir / "disk", settings.budgets.disk)
        self.gpu = gpu
        self.tiers: dict[str, MemoryTier] = {"cpu": CpuTier()}
        if gpu is not None:
            self.tiers["gpu"] = gpu
        budgets = {"cpu": settings.budgets.cpu, "gpu": settings.budgets.gpu if gpu else 0}
        policies = policies or {}
        self.ledgers = {
            t: TierLedger(t, budgets[t], policies.get(t, settings.eviction)) for t in MEMORY_TIERS
        }
        #: The disk tier's usage figures; blobs of models with a remote source are evictable
        #: (they can be fetched again), others are the only copy and stay.
        self.disk_ledger = TierLedger(
            "disk", settings.budgets.disk, policies.get("disk", settings.eviction)
        )
        self.leases = LeaseTable()
        self.connections = 0
        self.loads: dict[str, int] = {t: 0 for t in TIERS}
        self.evictions: dict[str, int] = {t: 0 for t in TIERS}
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._manifests: dict[str, Manifest] = {}
        self._verified: set[str] = set()
        for tier in TIERS:
            budget = self.disk_budget if tier == "disk" else self.ledgers[tier].budget
            metrics.bytes_budget.labels(tier).set(budget)

    @property
    def disk_budget(self) -> int:
        return self.settings.budgets.disk

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start-up recovery: drop disk temps, register disk blobs the catalog lacks."""
        removed = self.disk.cleanup_temps()
        if removed:
            log.info("removed %d unfinished temp file(s) from the disk tier", removed)
        known = {r.digest for r in self.catalog.all()}
        for digest in self.disk.digests():
            if digest in known:
                continue
            try:
                m = self.disk.manifest(digest)
                self.catalog.check_free(m.name, m.version)
            except (CorruptModel, ValidationError, AlreadyExists) as e:
                log.warning("disk blob %s left unregistered: %s", digest[:12], e)
                continue
            self.catalog.add(self._record_from_manifest(m, source=""))
            log.info("model %s:%s registered from the disk tier", m.name, m.version)
        missing = [r.key for r in self.catalog.all() if not self.disk.contains(r.digest)]
        if missing:
            log.warning(
                "models %s have no disk copy; they are fetched again from their source when "
                "acquired",
                ", ".join(missing),
            )
        self._sync_disk_ledger()
        self._update_gauges()

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
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

    def _manifest(self, record: ModelRecord) -> Manifest:
        m = self._manifests.get(record.digest)
        if m is None:
            m = self.disk.manifest(record.digest)
            self._manifests[record.digest] = m
        return dataclasses.replace(m, name=record.name, version=record.version)

    def _resident_tiers(self, digest: str) -> list[str]:
        tiers = [t for t in MEMORY_TIERS if digest in self.ledgers[t].residents]
        if self.disk.contains(digest):
            tiers.append("disk")
        return tiers

    def _update_gauges(self) -> None:
        m = self.metrics
        for t, ledger in self.ledgers.items():
            m.bytes_used.labels(t).set(ledger.used)
            m.models_resident.labels(t).set(len(ledger.residents))
        m.bytes_used.labels("disk").set(self.disk.used_bytes())
        m.models_resident.labels("disk").set(len(self.disk.digests()))
        m.leases.set(len(self.leases))
        m.connections.set(self.connections)

    def model_dict(self, r: ModelRecord, *, admin: bool, tensors: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": r.name,
            "version": r.version,
            "digest": r.digest,
            "framework": r.framework,
            "format": r.format,
            "total_bytes": r.total_bytes,
            "added_at": r.added_at,
            "tiers": self._resident_tiers(r.digest),
            "pins": sorted(r.pins),
            "leases": sum(self.leases.count(t, r.digest) for t in TIERS),
        }
        if admin:
            d["source"] = r.source
            d["access"] = r.access.to_dict()
        if tensors and self.disk.contains(r.digest):
            d["manifest"] = self._manifest(r).to_dict()
        return d

    # ---- loading --------------------------------------------------------------------------

    # Note [single-flight loads]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The first request for a (tier, digest) that is not resident puts, in
    # self._loading: a task of its own that does the load; it and every request that arrives
    # meanwhile await that task, shielded, so a requester that disconnects cancels neither the
    # load nor the others' wait. When the load ends the task hands its result or error to all
    # of them, and the entry goes. So 32 concurrent acquires of a cold model cause one copy,
    # one digest check, one load count.

    async def _single_flight(self, key: tuple[str, str], load: Callable[[], Any]) -> None:
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(load(), name=f"load {key[0]} {key[1][:12]}")
            self._loading[key] = task
            task.add_done_callback(lambda t: self._load_done(key, t))
        await asyncio.shield(task)

    def _load_done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter got it (or had gone)

    async def _ensure_disk(self, record: ModelRecord) -> None:
        """The layout is in the disk tier: fetched again from the source if it was removed."""
        if self.disk.contains(record.digest):
            return

        async def fetch() -> None:
            if not record.source:
                raise NotFound(
                    f"model {record.key} has no disk copy and no known source; add it again"
                )
            log.info("model %s has no disk copy; fetching it again from its source", record.key)
            manifest = await self._ingest_with_room(
                record.source, record.name, record.version, record.format or None, None, None
            )
            if manifest.digest != record.digest:
                raise CorruptModel(
                    f"the source of {record.key} changed: it now has digest "
                    f"{manifest.digest[:12]}, the catalog expects {record.digest[:12]}; "
                    "add it again under a new version"
                )
            self.loads["disk"] += 1
            self.metrics.loads.labels("disk").inc()

        await self._single_flight(("disk", record.digest), fetch)

    async def _ingest_with_room(
        self,
        source: str,
        name: str,
        version: str,
        fmt: str | None,
        sha256: str | None,
        progress: Progress | None,
    ) -> Manifest:
        """Ingest into the disk tier; when it does not fit, evict by policy and try once more."""
        from trims.daemon.ingest import ingest

        for attempt in range(2):
            try:
                manifest: Manifest = await asyncio.to_thread(
                    ingest,
                    source,
                    name=name,
                    version=version,
                    fmt=fmt,
                    expected_sha256=sha256,
                    disk=self.disk,
                    s3_endpoint=self.settings.s3_endpoint,
                    progress=progress,
                    max_bytes=self.disk_budget,
                )
            except ResourceExhausted as e:
                needed = e.details.get("needed")
                if attempt or not isinstance(needed, int):
                    raise
                self._sync_disk_ledger()
                for victim in self.disk_ledger.plan(needed, self._disk_evictable):
                    self._evict_disk(victim.digest, f"needed {format_size(needed)} for {name}")
                continue
            self._sync_disk_ledger()
            return manifest
        raise AssertionError("unreachable")

    def _sync_disk_ledger(self) -> None:
        """Match the disk ledger to the blobs on disk, keeping the usage figures it has."""
        on_disk = set(self.disk.digests())
        residents = self.disk_ledger.residents
        for digest in set(residents) - on_disk:
            del residents[digest]
        for digest in on_disk - set(residents):
            self.disk_ledger.add(digest, self.disk.path(digest).stat().st_size)

    def _disk_evictable(self, r: Resident) -> bool:
        from trims.daemon.tiers.cloud import is_remote

        records = self.catalog.by_digest(r.digest)
        return (
            bool(records)
            and all(is_remote(rec.source) for rec in records)
            and self.leases.count("disk", r.digest) == 0
            and not self.catalog.pinned_in(r.digest, "disk")
            and not any(key[1] == r.digest for key in self._loading)
        )

    def _evict_disk(self, digest: str, reason: str) -> None:
        with _tracer.start_as_current_span("evict") as span:
            span.set_attribute("trims.tier", "disk")
            span.set_attribute("trims.digest", digest)
            size = self.disk.path(digest).stat().st_size
            self.disk.remove(digest)
            self._verified.discard(digest)
            self._sync_disk_ledger()
            self.evictions["disk"] += 1
            self.metrics.evictions.labels("disk").inc()
            names = ", ".join(r.key for r in self.catalog.by_digest(digest)) or "?"
            log.info(
                "model %s evicted from disk tier (%s; %s freed; fetched again on use)",
                names,
                reason,
                format_size(size),
            )
            self._update_gauges()

    def _evictable(self, tier: str) -> Callable[[Resident], bool]:
        def ok(r: Resident) -> bool:
            return self.leases.count(tier, r.digest) == 0 and not self.catalog.pinned_in(
                r.digest, tier
            )

        return ok

    def _evict(self, tier: str, resident: Resident, reason: str) -> None:
        with _tracer.start_as_current_span("evict") as span:
            span.set_attribute("trims.tier", tier)
            span.set_attribute("trims.digest", resident.digest)
            self.tiers[tier].free(resident.digest)
            del self.ledgers[tier].residents[resident.digest]
            self.evictions[tier] += 1
            self.metrics.evictions.labels(tier).inc()
            names = ", ".join(r.key for r in self.catalog.by_digest(resident.digest)) or "?"
            log.info(
                "model %s evicted from %s tier (%s; %s freed)",
                names,
                tier,
                reason,
                format_size(resident.size),
            )
            self._update_gauges()

    async def _ensure_resident(self, tier: str, record: ModelRecord) -> Resident:
        """The resident copy, loaded if needed. On return no await has happened since it was
        seen resident, so the caller can lease it before anything else can evict it."""
        ledger = self.ledgers[tier]
        for _ in range(_LOAD_ATTEMPTS):
            resident = ledger.residents.get(record.digest)
            if resident is not None:
                return resident
            await self._load_into(tier, record)
        raise ResourceExhausted(
            f"model {record.key} was evicted from the {tier} tier by other loads "
            f"{_LOAD_ATTEMPTS} times before it could be leased; the tier is too small for the "
            "working set: raise its budget",
            tier=tier,
            budget=ledger.budget,
            needed=record.total_bytes,
        )

    async def _load_into(self, tier: str, record: ModelRecord) -> None:
        ledger = self.ledgers[tier]
        if tier not in self.tiers:
            raise Unavailable(
                "no CUDA device is available to this daemon, so the gpu tier is off; acquire "
                "with tier 'cpu', or run the daemon on a GPU node with --gpu-budget"
            )

        async def load() -> None:
            with _tracer.start_as_current_span("load") as span:
                span.set_attribute("trims.tier", tier)
                span.set_attribute("trims.model", record.key)
                await self._ensure_disk(record)
                size = record.total_bytes
                victims = ledger.plan(size, self._evictable(tier))
                for victim in victims:
                    self._evict(
                        tier,
                        victim,
                        f"budget {format_size(ledger.budget)}, "
                        f"needed {format_size(size)} for {record.key}",
                    )
                ledger.reserved += size
                started = time.monotonic()
                try:
                    await asyncio.to_thread(
                        self.tiers[tier].load,
                        record.digest,
                        self.disk.path(record.digest),
                        size,
                        record.key,
                    )
                finally:
                    ledger.reserved -= size
                ledger.add(record.digest, size)
                self.loads[tier] += 1
                self.metrics.loads.labels(tier).inc()
                self.metrics.load_duration.labels(tier).observe(time.monotonic() - started)
                self._update_gauges()

        await self._single_flight((tier, record.digest), load)

    async def _verify_disk(self, record: ModelRecord) -> None:
        """Check the disk file against its digest once per daemon run before serving it."""
        if record.digest in self._verified:
            return

        async def verify() -> None:
            await asyncio.to_thread(self.disk.verify, record.digest)
            self._verified.add(record.digest)

        await self._single_flight(("verify", record.digest), verify)

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
            record = self._resolve(name, version, digest)
            if not record.access.allows(caller.peer.uid, caller.peer.gid):
                raise PermissionDenied(
                    f"uid {caller.peer.uid} / gid {caller.peer.gid} may not acquire model "
                    f"{record.key}; ask the store's owner to add you to its access list"
                )
            await self._ensure_disk(record)
            disk_copy = self.disk_ledger.residents.get(record.digest)
            if disk_copy is not None:
                disk_copy.touch()
            if tier == "disk":
                await self._verify_disk(record)
                try:
                    fd = os.open(self.disk.path(record.digest), os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError as e:
                    raise NotFound(f"model {record.key} was removed while it was acquired") from e
                handle: dict[str, Any] = {"kind": "file", "size": record.total_bytes}
                fds: tuple[int, ...] = (fd,)
                close = True
            else:
                if tier == "gpu":
                    self._check_device(device)
                resident = await self._ensure_resident(tier, record)
                resident.touch()
                export = self.tiers[tier].export(record.digest)
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
                    "manifest": self._manifest(record).to_dict(),
                    "handle": handle,
                },
                fds,
                close,
            )

    def _check_device(self, device: str | None) -> None:
        if self.gpu is None or device is None:
            return
        names = self.gpu.names()
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
        resident = self.ledgers[tier].residents.get(digest)
        if resident is not None and not self.catalog.by_digest(digest):
            self._evict(tier, resident, "its model was removed and its last lease ended")

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
            ledger = self.ledgers[t]
            tiers[t] = {
                "budget": ledger.budget,
                "used": ledger.used,
                "reserved": ledger.reserved,
                "models": len(ledger.residents),
                "policy": ledger.policy,
                "loads": self.loads[t],
                "evictions": self.evictions[t],
                "available": t in self.tiers,
            }
        tiers["disk"] = {
            "budget": self.disk_budget,
            "used": self.disk.used_bytes(),
            "models": len(self.disk.digests()),
            "policy": self.disk_ledger.policy,
            "loads": self.loads["disk"],
            "evictions": self.evictions["disk"],
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

    async def load(self, caller: Caller, name: str, version: str | None, tier: str) -> Reply:
        record = self.catalog.get(name, version)
        if tier == "disk":
            await self._ensure_disk(record)
            await self._verify_disk(record)
        else:
            await self._ensure_resident(tier, record)
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
                if self.disk.contains(record.digest):
                    self._evict_disk(record.digest, "evicted on request")
                    evicted.append(t)
                continue
            resident = self.ledgers[t].residents.get(record.digest)
            if resident is not None:
                self._evict(t, resident, "evicted on request")
                evicted.append(t)
        self._update_gauges()
        return Reply({"evicted": evicted, "model": self.model_dict(record, admin=True)})

    async def pin(self, caller: Caller, name: str, version: str | None, tier: str) -> Reply:
        record = self.catalog.get(name, version)
        if tier == "disk":
            await self._ensure_disk(record)
        else:
            await self._ensure_resident(tier, record)
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
        manifest = await self._ingest_with_room(source, name, version, fmt, sha256, progress)
        record = self._record_from_manifest(manifest, source=source, access=access)
        record = dataclasses.replace(record, name=name, version=version)
        self.catalog.add(record)
        self._manifests[manifest.digest] = manifest
        self._verified.add(manifest.digest)
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
                resident = self.ledgers[t].residents.get(r.digest)
                if resident is not None and not self.leases.count(t, r.digest):
                    self._evict(t, resident, f"model {r.key} was removed")
            if self.disk.contains(r.digest):
                self.disk.remove(r.digest)
                self._sync_disk_ledger()
            self._manifests.pop(r.digest, None)
            self._verified.discard(r.digest)
            log.info("model %s removed from the store", r.key)
        self._update_gauges()
        return Reply({"removed": [r.key for r in records]})
