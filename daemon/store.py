"""The store's operations (acquire, release, info, ... remove) over catalog, leases, residency.

Runs on the daemon's event loop. Operations resolve a model in the catalog, ask the residency
(:mod:`trims.daemon.residency`) for a copy in the wanted tier, and lease it to the caller's
connection. Adding and removing follow Note [commit protocol]; a client sees, lists and
acquires only the models its access list lets it (Note [access without leaks]).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trims import __version__
from trims.config import format_size
from trims.daemon.catalog import AccessList, Catalog, ModelRecord, not_found
from trims.daemon.crashpoints import arm, crashpoint
from trims.daemon.leases import LeaseTable
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.pressure import MemorySource, cgroup_memory
from trims.daemon.private import private_dir
from trims.daemon.residency import MEMORY_TIERS, TIERS, Residency
from trims.daemon.settings import DaemonSettings
from trims.daemon.tiers.gpu import GpuTier
from trims.errors import (
    CorruptModel,
    NotFound,
    QueueFull,
    ResourceExhausted,
    ValidationError,
)
from trims.layout import Manifest
from trims.protocol import PROTOCOL_VERSION, PeerCredentials, Progress
from trims.telemetry import tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

#: Most leases one connection may hold at once (a bound on what one client can pin).
MAX_LEASES_PER_CONNECTION = 4096
#: Memory tiers whose acquires fall back to the disk tier (Note [degraded acquires]).
_DEGRADABLE = ("cpu",)
#: Seconds between two log lines about one model's degraded acquires.
DEGRADED_LOG_INTERVAL = 60.0


@dataclass(frozen=True)
class StoreReply:
    """An operation's result and the descriptors to attach (``close_fds``: ours to close)."""

    result: dict[str, Any]
    fds: tuple[int, ...] = ()
    close_fds: bool = False


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the connection, the peer's credentials, which socket, and the
    process that sent this very request (Note [request sender] in trims.daemon.connection)."""

    connection: int
    peer: PeerCredentials
    admin: bool
    pid: int


class Store:
    """All store state. Create, ``start()`` (start-up recovery), serve, ``close()``."""

    def __init__(
        self,
        settings: DaemonSettings,
        metrics: DaemonMetrics,
        *,
        policies: dict[str, str] | None = None,
        gpu: GpuTier | None = None,
        memory: MemorySource | None = cgroup_memory,
    ) -> None:
        """``memory`` reads the cgroup's memory for Note [memory pressure] (in
        trims.daemon.pressure); None: no demotion for memory."""
        self.settings = settings
        self.metrics = metrics
        arm(settings.crash_point)
        private_dir(settings.store_dir)
        self.catalog = Catalog(settings.store_dir / "catalog.sqlite")
        self.leases = LeaseTable()
        self.res = Residency(
            settings,
            metrics,
            self.catalog,
            self.leases,
            policies=policies or {},
            gpu=gpu,
            memory=memory,
        )
        self.connections = 0
        self._manifests: dict[str, Manifest] = {}
        #: Per digest: when its last degraded acquire was logged, and how many since were not
        #: (Note [degraded acquires]).
        self._degraded_log: dict[str, tuple[float, int]] = {}

    # ---- lifecycle ------------------------------------------------------------------------

    # Note [commit protocol]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # A model exists when, and only when, its catalog row is committed; a blob on disk is
    # served only through a committed row that names its digest. The catalog is SQLite in
    # WAL mode with synchronous=FULL, so a committed transaction survives a crash; the disk
    # tier places a blob by fsync + rename + fsync of the directory. The steps, each followed
    # by its crash point (trims.daemon.crashpoints):
    #
    #   add   1. catalog: insert the intent row (state pending: name, version, source,
    #            access list; no digest yet). It reserves name:version.     "add.intent"
    #         2. ingest: convert into tmp/, verify, rename the blob into blobs/,
    #                                                                    "add.blob_renamed"
    #            then its manifest.                                       "add.blob_placed"
    #         3. catalog: one UPDATE fills in digest, framework, format, size and sets the
    #            row committed.                                           "add.committed"
    #         A failed add deletes its intent row and a blob no committed row names.
    #   rm    1. catalog: delete the committed row (one transaction).     "rm.row_deleted"
    #         2. disk: delete the blob unless another committed row names it; memory copies
    #            go now or when their last lease ends.                    "rm.blob_removed"
    #
    # Recovery at start (Store.start), before the sockets open, in this order:
    #   a. delete tmp/ (partial downloads, conversions, manifests) and half-placed entries
    #      (a blob without its manifest, a manifest without its blob);
    #   b. roll back every pending row: its add never committed, so the model is absent;
    #   c. delete every blob that no committed row names (an add that crashed after placing
    #      it, an rm that crashed before deleting it, a copy fetched for a source that had
    #      changed), logging its digest and why. Nothing is registered from the disk.
    # A crash at any instruction therefore leaves each model either absent or fully present
    # with its source and access list; tests/daemon/test_crash_safety.py kills the daemon at
    # every crash point and checks exactly that.

    def start(self) -> None:
        """Start-up recovery (Note [commit protocol]); fails closed."""
        removed = self.res.disk.cleanup_temps()
        if removed:
            log.info("removed %d unfinished temp file(s) from the disk tier", removed)
        for key in self.catalog.rollback_pending():
            log.warning(
                "model %s: its add was interrupted before it committed; rolled back (the model "
                "is absent: add it again)",
                key,
            )
        committed = {r.digest for r in self.catalog.all()}
        for digest in self.res.disk.digests():
            if digest not in committed:
                self.res.drop_disk_copy(
                    digest,
                    "no committed catalog entry names it (an add or remove was interrupted); "
                    "it is never served",
                )
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

    # Note [access without leaks]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A model with an access list exists only for the peers it lets in: for anyone else,
    # info and acquire answer the same NotFound as for an absent model, and list leaves it
    # out, so neither its name nor its digest nor its tensors leak. A peer is let in by its
    # uid, its primary gid or any supplementary group (SO_PEERGROUPS, taken at connect
    # time). The admin socket (owner or root) sees and acquires everything.

    @staticmethod
    def _visible(caller: Caller, record: ModelRecord) -> bool:
        peer = caller.peer
        return caller.admin or record.access.allows(peer.uid, (peer.gid, *peer.groups))

    def _resolve(
        self, caller: Caller, name: str, version: str | None, digest: str | None = None
    ) -> ModelRecord:
        """The record the caller names, NotFound when it is absent or not visible to them."""
        if digest is None:
            record = self.catalog.get(name, version)
        else:
            found = [
                r
                for r in self.catalog.by_digest(digest)
                if r.name == name and version in (None, r.version)
            ]
            if not found:
                raise NotFound(f"model {name} has no version with digest {digest[:12]}")
            record = found[0]
        if not self._visible(caller, record):
            if digest is not None:
                raise NotFound(f"model {name} has no version with digest {digest[:12]}")
            raise not_found(name, version)
        return record

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

    def _remove_strays(self, names: set[str]) -> None:
        """Delete blobs made for ``names`` that no committed row names (e.g. a copy fetched
        after the source changed), unless an add of that name is placing one right now."""
        busy = self.catalog.pending_names()
        for digest in self.res.disk.digests():
            if self.catalog.by_digest(digest):
                continue
            try:
                owner = self.res.disk.manifest(digest).name
            except (NotFound, CorruptModel):
                owner = None
            if owner is None or (owner in names and owner not in busy):
                self.res.drop_disk_copy(digest, f"left over from model {owner or '?'}")

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

    def hello(self, caller: Caller) -> StoreReply:
        return StoreReply(
            {
                "daemon_version": __version__,
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "admin": caller.admin,
            }
        )

    # Note [degraded acquires]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~
    # An acquire of the cpu tier that the tier cannot hold (its load is refused with
    # ResourceExhausted: the budget is held by leased or pinned copies or is smaller than the
    # model, or memory pressure leaves nothing to demote) is answered from the disk tier: the
    # verified file, leased in the disk tier, exactly as an acquire of ``tier: "disk"``, with
    # ``degraded_from: "cpu"`` in the reply. A worker maps a file handle as it maps the cpu
    # tier's (a file too under the page-cache backing), so its function runs unchanged; what
    # it loses is the sharing: its reads go through the page cache, which the kernel may
    # reclaim. Refusing instead failed the instance's start (HTTP 502 under a memory limit,
    # issue 43), although idle instances' leases were all that kept the model out.
    #
    #   acquire(cpu) ──ensure_resident──> resident ──> lease "cpu", tier "cpu"
    #                       │ ResourceExhausted
    #                       ├── strict ──────────────> the error, as before
    #                       └── open_verified ───────> lease "disk", tier "disk",
    #                                                   degraded_from "cpu"
    #
    # The disk lease keeps the blob from disk eviction and nothing in the cpu tier, so a
    # degraded acquire never holds memory the tier could reclaim; the next acquire tries the
    # cpu tier again. The gpu tier is never degraded: its callers build device tensors from
    # the handle, and host bytes in their place would move the function to another device.
    # ``strict`` keeps the error for callers that need the memory tier (a benchmark of it, a
    # warm-up that must fail loudly).
    #
    # No load-through: a cold cpu acquire waits for its load rather than taking the disk
    # handle while the load runs in the background, although the disk copy is verified. On
    # our 2-core test machine (a real daemon, a 256 MiB model verified on disk, its pages
    # dropped from the page cache with POSIX_FADV_DONTNEED, then acquire and read every byte
    # of the mapping; 5 to 9 trials a run, another benchmark running beside):
    #
    #   two runs' medians, total (the second's acquire + read):
    #   cpu backing  acquire(cpu) + read       acquire(disk) + read
    #   file         177 / 162 ms (133 + 19)   167 / 147 ms (1 + 146)
    #   memfd        696 / 741 ms (631 + 103)  163 / 172 ms (1 + 167)
    #
    # With the page-cache backing (``auto`` where the daemon is root and shmem huge pages
    # are off) the load is the same read of the file that the disk handle's first request
    # does, so load-through would save about 15 ms of 160. With sealed memfds it would save
    # the hash and the copy (about 550 ms), but every instance started during the load would
    # keep its mapping of the file for life: the model twice in the node's memory (the file's
    # pages it maps, and the memfd), which is what a node under a memory limit cannot afford,
    # and the hash would run beside that instance's first requests on the same two cores.

    async def acquire(
        self,
        caller: Caller,
        name: str,
        version: str | None,
        digest: str | None,
        tier: str,
        device: str | None,
        *,
        strict: bool = False,
    ) -> StoreReply:
        """Lease ``tier``'s copy of the model; the disk tier's when the cpu tier cannot hold it
        and not ``strict`` (Note [degraded acquires])."""
        started = time.monotonic()
        with _tracer.start_as_current_span("acquire") as span:
            span.set_attribute("trims.model", name)
            span.set_attribute("trims.tier", tier)
            if self.leases.held_by(caller.connection) >= MAX_LEASES_PER_CONNECTION:
                raise QueueFull(
                    f"this connection holds {MAX_LEASES_PER_CONNECTION} leases, the most one "
                    "connection may hold; release some before acquiring more"
                )
            record = self._resolve(caller, name, version, digest)
            manifest = await self._manifest(record)
            disk_copy = self.res.disk_ledger.residents.get(record.digest)
            if disk_copy is not None:
                disk_copy.touch()
            if tier == "gpu":
                self._check_device(device)
            served, handle, fds, close = await self._handle(record, tier, strict)
            lease = self.leases.grant(
                caller.connection,
                record.name,
                record.version,
                record.digest,
                served,
                caller.peer,
                caller.pid,
            )
            self._update_gauges()
            self.metrics.acquire_latency.labels(served).observe(time.monotonic() - started)
            result: dict[str, Any] = {
                "lease": lease.id,
                "tier": served,
                "manifest": manifest.to_dict(),
                "handle": handle,
            }
            if served != tier:
                span.set_attribute("trims.degraded_from", tier)
                result["degraded_from"] = tier
            return StoreReply(result, fds, close)

    async def _handle(
        self, record: ModelRecord, tier: str, strict: bool
    ) -> tuple[str, dict[str, Any], tuple[int, ...], bool]:
        """(the tier that serves, its handle, the fds to send, whether they are ours to close).
        Returns with no await since a memory copy was seen resident, so the caller leases it
        before anything can evict it (Residency.ensure_resident)."""
        if tier != "disk":
            try:
                resident = await self.res.ensure_resident(tier, record)
            except ResourceExhausted as e:
                # a full disk tier (fetching the layout again) is no reason to use the disk
                if strict or tier not in _DEGRADABLE or e.details.get("tier") != tier:
                    raise
                self._degraded(record, tier, e)
            else:
                resident.touch()
                export = self.res.tiers[tier].export(record.digest)
                fds = (export.fd,) if export.fd is not None else ()
                return tier, export.handle, fds, False
        fd = await self.res.open_verified(record)
        return "disk", {"kind": "file", "size": record.total_bytes}, (fd,), True

    def _degraded(self, record: ModelRecord, tier: str, refused: ResourceExhausted) -> None:
        """Count an acquire of ``tier`` served from the disk tier; log it once a minute per
        model (Note [degraded acquires])."""
        reason = str(refused.details.get("reason", "budget"))
        self.metrics.acquires_degraded.labels(tier, reason).inc()
        now = time.monotonic()
        entry = self._degraded_log.get(record.digest)
        if entry is not None and now - entry[0] < DEGRADED_LOG_INTERVAL:
            self._degraded_log[record.digest] = (entry[0], entry[1] + 1)
            return
        skipped = 0 if entry is None else entry[1]
        self._degraded_log[record.digest] = (now, 0)
        log.warning(
            "model %s served from the disk tier instead of the %s tier%s: its acquirers map "
            "the disk file through the page cache, not one shared copy in memory, until the %s "
            "tier can hold it (%s)",
            record.key,
            tier,
            f" ({skipped} more such acquire(s) since the last line)" if skipped else "",
            tier,
            refused.message,
        )

    def _check_device(self, device: str | None) -> None:
        if self.res.gpu is None or device is None:
            return
        names = self.res.gpu.names()
        if device not in names:
            raise ValidationError(
                f"device {device!r} is not served by this daemon; it serves {list(names)}"
            )

    def release(self, caller: Caller, lease_id: str) -> StoreReply:
        lease = self.leases.release(lease_id, caller.connection)
        self._after_lease_end(lease.tier, lease.digest)
        self._update_gauges()
        return StoreReply({})

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
            self.res.evict(
                tier, resident, "its model was removed and its last lease ended", cause="removed"
            )

    def info(self, caller: Caller, name: str, version: str | None) -> StoreReply:
        record = self._resolve(caller, name, version)
        return StoreReply({"model": self.model_dict(record, admin=caller.admin, tensors=True)})

    def list(self, caller: Caller) -> StoreReply:
        visible = [r for r in self.catalog.all() if self._visible(caller, r)]
        return StoreReply({"models": [self.model_dict(r, admin=caller.admin) for r in visible]})

    def stats(self, caller: Caller) -> StoreReply:
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
                "hashed_bytes": self.res.hashed[t],
                "available": t in self.res.tiers,
            }
        tiers["disk"] = {
            "budget": self.settings.budgets.disk,
            "used": self.res.disk.used_bytes(),
            "models": len(self.res.disk.digests()),
            "policy": self.res.disk_ledger.policy,
            "loads": self.res.loads["disk"],
            "evictions": self.res.evictions["disk"],
            "hashed_bytes": self.res.hashed["disk"],
            "available": True,
        }
        result: dict[str, Any] = {
            "tiers": tiers,
            "leases": len(self.leases),
            "clients": self.connections,
        }
        if caller.admin:
            result["lease_table"] = [lease.to_dict() for lease in self.leases.all()]
        return StoreReply(result)

    async def load(
        self,
        caller: Caller,
        name: str,
        version: str | None,
        tier: str,
        progress: Progress | None,
    ) -> StoreReply:
        record = self.catalog.get(name, version)
        if tier == "disk":
            await self.res.ensure_disk(record)
            await self.res.verify_disk(record)
        else:
            await self.res.ensure_resident(tier, record, progress)
        return StoreReply({"model": self.model_dict(record, admin=True)})

    async def evict(
        self, caller: Caller, name: str, version: str | None, tier: str | None
    ) -> StoreReply:
        record = self.catalog.get(name, version)
        evicted: list[str] = []
        for t in [tier] if tier else list(MEMORY_TIERS):
            self._check_evictable(record, t)
            if t == "disk":
                if not self.res.disk.contains(record.digest):
                    continue
                if self.res.cpu.holds_file(record.digest):
                    # The cpu tier's copy is this very file (Note [page-cache copies]).
                    self._check_evictable(record, "cpu")
                    self.res.evict("cpu", self.res.ledgers["cpu"].residents[record.digest],
                                   "its disk file was evicted on request",
                                   cause="request")  # fmt: skip
                    evicted.append("cpu")
                self.res.evict_disk(record.digest, "evicted on request")
                evicted.append(t)
                continue
            resident = self.res.ledgers[t].residents.get(record.digest)
            if resident is not None:
                self.res.evict(t, resident, "evicted on request", cause="request")
                evicted.append(t)
        self._update_gauges()
        return StoreReply({"evicted": evicted, "model": self.model_dict(record, admin=True)})

    def _check_evictable(self, record: ModelRecord, tier: str) -> None:
        """Raise when the model's copy in ``tier`` is leased or pinned there."""
        leased = self.leases.count(tier, record.digest)
        if leased:
            raise ValidationError(
                f"model {record.key} has {leased} live lease(s) in the {tier} tier and stays "
                "until they are released"
            )
        if self.catalog.pinned_in(record.digest, tier):
            raise ValidationError(
                f"model {record.key} is pinned in the {tier} tier; unpin it first"
            )

    async def pin(self, caller: Caller, name: str, version: str | None, tier: str) -> StoreReply:
        record = self.catalog.get(name, version)
        if tier == "disk":
            await self.res.ensure_disk(record)
        else:
            await self.res.ensure_resident(tier, record)
        self.catalog.set_pins(record.name, record.version, record.pins | {tier})
        log.info("model %s pinned in the %s tier", record.key, tier)
        model = self.catalog.get(name, record.version)
        return StoreReply({"model": self.model_dict(model, admin=True)})

    def unpin(self, caller: Caller, name: str, version: str | None, tier: str | None) -> StoreReply:
        record = self.catalog.get(name, version)
        pins = record.pins - {tier} if tier else frozenset()
        self.catalog.set_pins(record.name, record.version, frozenset(pins))
        model = self.catalog.get(name, record.version)
        return StoreReply({"model": self.model_dict(model, admin=True)})

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
    ) -> StoreReply:
        """Add a model by Note [commit protocol]."""
        self.catalog.begin_add(name, version, source, access)
        crashpoint("add.intent")
        ingest = asyncio.ensure_future(
            self.res.ingest_with_room(source, name, version, fmt, sha256, progress)
        )
        try:
            manifest = await asyncio.shield(ingest)
            crashpoint("add.blob_placed")
            record = self._record_from_manifest(manifest, source=source, access=access)
            record = dataclasses.replace(record, name=name, version=version)
            self.catalog.commit_add(record)
        except BaseException:
            self.catalog.abort_add(name, version)
            ingest.add_done_callback(self._drop_abandoned)
            raise
        crashpoint("add.committed")
        self._manifests[manifest.digest] = manifest
        self.res.mark_verified(manifest.digest)
        self._update_gauges()
        log.info(
            "model %s added (%s, %s)", record.key, record.format, format_size(record.total_bytes)
        )
        return StoreReply({"model": self.model_dict(record, admin=True)})

    def _drop_abandoned(self, ingest: asyncio.Future[Manifest]) -> None:
        """A failed or cancelled add's ingest ended: delete its blob unless a row names it."""
        if ingest.cancelled() or ingest.exception() is not None:
            return
        digest = ingest.result().digest
        if not self.catalog.by_digest(digest):
            self.res.drop_disk_copy(digest, "its add failed before it committed")
            self._update_gauges()

    async def verify(
        self, caller: Caller, name: str | None, version: str | None, progress: Progress | None
    ) -> StoreReply:
        """Hash the disk copy of every model (or of ``name``, or of one version) again, whatever
        its stamp: bytes that changed without moving it (a disk's bit rot, a write through a
        mapping made before the last check) are found, and the damaged copy is deleted as any
        failed check deletes it (Note [disk re-verification] in trims.daemon.residency).

        One entry per layout: ``state`` "ok", "damaged" (with ``error``) or "absent" (not on
        disk: fetched and verified again on its next use). ``progress`` hears stage "verify"
        over the bytes of every layout on disk together."""
        records = self.catalog.all() if name is None else self._versions(name, version)
        layouts: dict[str, list[ModelRecord]] = {}
        for r in records:
            layouts.setdefault(r.digest, []).append(r)
        results: list[dict[str, Any]] = []
        on_disk = {d for d in layouts if self.res.disk.contains(d)}
        total = sum(layouts[d][0].total_bytes for d in on_disk)
        offset = 0
        for digest, named in layouts.items():
            entry: dict[str, Any] = {
                "models": [r.key for r in named],
                "digest": digest,
                "bytes": named[0].total_bytes,
                "state": "ok",
            }
            if digest not in on_disk:
                entry["state"] = "absent"
            else:
                report = None if progress is None else _offset(progress, offset, total)
                offset += named[0].total_bytes
                try:
                    await self.res.verify_disk(named[0], scrub=True, progress=report)
                except NotFound:  # removed or evicted while the scrub ran
                    entry["state"] = "absent"
                except CorruptModel as e:
                    self.res.drop_disk_copy(digest, f"verify found it damaged ({e.message})")
                    entry.update(state="damaged", error=e.message)
            results.append(entry)
        self._update_gauges()
        return StoreReply({"verified": results})

    def _versions(self, name: str, version: str | None) -> Sequence[ModelRecord]:
        """The row of ``name``:``version``, or every version of ``name``; NotFound if none."""
        if version:
            return [self.catalog.get(name, version)]
        records = [r for r in self.catalog.all() if r.name == name]
        if not records:
            raise not_found(name, None)
        return records

    def remove(self, caller: Caller, name: str, version: str | None, force: bool) -> StoreReply:
        records = self._versions(name, version)
        for r in records:
            leased = sum(self.leases.count(t, r.digest) for t in TIERS)
            if leased and not force:
                raise ValidationError(
                    f"model {r.key} has {leased} live lease(s); release them first or remove "
                    "with force (leased copies are freed when their last lease ends)"
                )
        for r in records:
            self.catalog.remove(r.name, r.version)
            crashpoint("rm.row_deleted")
            log.info("model %s removed from the store", r.key)
            if self.catalog.by_digest(r.digest):
                continue
            for t in MEMORY_TIERS:
                resident = self.res.ledgers[t].residents.get(r.digest)
                if resident is not None and not self.leases.count(t, r.digest):
                    self.res.evict(t, resident, f"model {r.key} was removed", cause="removed")
            if self.res.disk.contains(r.digest):
                self.res.disk.remove(r.digest)
                self.res.sync_disk_ledger()
                crashpoint("rm.blob_removed")
            self._manifests.pop(r.digest, None)
            self._degraded_log.pop(r.digest, None)
            self.res.forget(r.digest)
        self._remove_strays({r.name for r in records})
        self._update_gauges()
        return StoreReply({"removed": [r.key for r in records]})


def _offset(progress: Progress, offset: int, total: int) -> Progress:
    """``progress`` for one part of a longer operation: its bytes come after ``offset``."""

    def report(stage: str, done: int, _total: int | None) -> None:
        progress(stage, offset + done, total)

    return report
