"""Residency: which copy of each layout sits in which tier, and how copies get there and go.

Owns the tiers (cpu, gpu, disk), their byte ledgers and eviction, and the single-flight loads
(Note [single-flight loads]). The store's operations ask it to make a copy resident, then lease
that copy; nothing is evicted while a lease or pin holds it (Note [lease keeps memory alive]).
Blocking work (copying into a memfd, hashing, converting, downloading) runs in threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from trims.config import format_size
from trims.daemon.catalog import Catalog, ModelRecord
from trims.daemon.eviction import Resident, TierLedger
from trims.daemon.leases import LeaseTable
from trims.daemon.metrics import DaemonMetrics
from trims.daemon.pressure import MemoryPressure, MemorySource
from trims.daemon.settings import DaemonSettings
from trims.daemon.tiers import chunks
from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.cpu import CpuTier
from trims.daemon.tiers.disk import DiskTier, Stamp
from trims.daemon.tiers.gpu import GpuTier
from trims.daemon.tiers.memory import MemoryTier
from trims.errors import CorruptModel, NotFound, ResourceExhausted, Unavailable
from trims.layout import Manifest
from trims.protocol import Progress
from trims.telemetry import tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

MEMORY_TIERS = ("cpu", "gpu")
TIERS = ("gpu", "cpu", "disk")
#: Loads tried for one acquire when concurrent loads keep evicting the fresh copy.
_LOAD_ATTEMPTS = 3


class Residency:
    """The tiers and what is resident in each, within their budgets."""

    def __init__(
        self,
        settings: DaemonSettings,
        metrics: DaemonMetrics,
        catalog: Catalog,
        leases: LeaseTable,
        *,
        policies: dict[str, str],
        gpu: GpuTier | None,
        memory: MemorySource | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.catalog = catalog
        self.leases = leases
        #: Chunk digests of verified layouts, for every tier (Note [chunk digests]).
        self.chunks = ChunkDigests()
        self.disk = DiskTier(settings.store_dir / "disk", settings.budgets.disk, self.chunks)
        self.gpu = gpu
        if gpu is not None:
            gpu.pool = self.chunks
        self.cpu = CpuTier(settings.cpu_backing, pool=self.chunks)
        self.tiers: dict[str, MemoryTier] = {"cpu": self.cpu}
        if gpu is not None:
            self.tiers["gpu"] = gpu
        budgets = {"cpu": settings.budgets.cpu, "gpu": settings.budgets.gpu if gpu else 0}
        self.ledgers = {
            t: TierLedger(t, budgets[t], policies.get(t, settings.eviction)) for t in MEMORY_TIERS
        }
        #: The disk tier's usage figures; blobs of models with a remote source are evictable
        #: (they can be fetched again), others are the only copy and stay.
        self.disk_ledger = TierLedger(
            "disk", settings.budgets.disk, policies.get("disk", settings.eviction)
        )
        self.loads: dict[str, int] = {t: 0 for t in TIERS}
        self.evictions: dict[str, int] = {t: 0 for t in TIERS}
        #: Bytes hashed to verify copies, by the tier they were verified for.
        self.hashed: dict[str, int] = {t: 0 for t in TIERS}
        self._loading: dict[tuple[str, str], asyncio.Task[None]] = {}
        #: Disk blobs verified this run, with the stamp they were verified under
        #: (Note [disk re-verification]).
        self._verified: dict[str, Stamp] = {}
        #: Demotes CPU-tier copies where the cgroup's memory runs short (Note [memory
        #: pressure] in trims.daemon.pressure); None: off.
        self.pressure: MemoryPressure | None = None
        high = settings.memory_high_watermark
        if memory is not None and high is not None:
            self.pressure = MemoryPressure(memory, high, settings.memory_low_watermark)
        #: Whether this pressure's "nothing left to demote" was logged (once per episode).
        self._stuck_logged = False
        metrics.memory_pressure.set(0)
        for t, ledger in (*self.ledgers.items(), ("disk", self.disk_ledger)):
            metrics.bytes_budget.labels(t).set(ledger.budget)
            metrics.hashed_bytes.labels(t)  # exported as 0 until something is hashed
            metrics.damaged.labels(t)

    def close(self) -> None:
        for tier in self.tiers.values():
            tier.close()
        self.chunks.close()

    def recall_chunks(self, digest: str, size: int) -> None:
        """Bring the saved chunk digests of ``digest`` into memory before it is hashed (Note
        [chunk digests] in trims.daemon.tiers.chunks)."""
        if self.chunks.get(digest, size) is not None:
            return
        saved = self.catalog.chunk_digests(
            digest, chunks.CHUNK, chunks.chunk_count(size), chunks.DIGEST_BYTES
        )
        if saved is not None:
            self.chunks.learn(digest, saved)

    def save_chunks(self) -> None:
        """Save the chunk digests computed since the last call in the catalog."""
        for digest, digests in self.chunks.take_unsaved().items():
            self.catalog.save_chunk_digests(digest, chunks.CHUNK, digests)

    def resident_tiers(self, digest: str) -> list[str]:
        tiers = [t for t in MEMORY_TIERS if digest in self.ledgers[t].residents]
        if self.disk.contains(digest):
            tiers.append("disk")
        return tiers

    def update_gauges(self) -> None:
        m = self.metrics
        for t, ledger in self.ledgers.items():
            m.bytes_used.labels(t).set(ledger.used)
            m.models_resident.labels(t).set(len(ledger.residents))
        m.bytes_used.labels("disk").set(self.disk.used_bytes())
        m.models_resident.labels("disk").set(len(self.disk.digests()))

    def forget(self, digest: str) -> None:
        """The digest's disk copy is gone or replaced: verify it again before serving."""
        self._verified.pop(digest, None)
        self.chunks.forget(digest)

    def mark_verified(self, digest: str) -> None:
        """A commit of ``digest`` just finished: the blob is verified if that commit placed it
        (hashed) and it has not changed since; a commit that found the blob already on disk
        hashed only its own temp file, so the blob keeps whatever check it had."""
        placed = self.disk.take_placed(digest)
        if placed is not None and placed == self.disk.stamp(digest):
            self._verified[digest] = placed
            self.count_hashed("disk", placed.size)
        self.save_chunks()

    def count_hashed(self, tier: str, n: int) -> None:
        """``n`` bytes were hashed to verify a copy for ``tier``."""
        self.hashed[tier] += n
        self.metrics.hashed_bytes.labels(tier).inc(n)

    def drop_disk_copy(self, digest: str, reason: str) -> None:
        """Delete a blob that must never be served (failed a check, or no committed row names
        it); a no-op when it is already gone. Fail closed: log it with the digest and why."""
        self._verified.pop(digest, None)
        resident = self.ledgers["cpu"].residents.get(digest)
        if resident is not None and self.cpu.holds_file(digest):
            self.evict(
                "cpu", resident, f"it is the disk file being deleted: {reason}", cause="changed"
            )
        if self.disk.contains(digest) or self.disk.path(digest).exists():
            try:
                self.disk.remove(digest)
            except NotFound:
                pass
            log.warning("layout %s deleted from the disk tier: %s", digest, reason)
        self.sync_disk_ledger()

    # Note [single-flight loads]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The first request for a (tier, digest) that is not resident puts, in
    # self._loading: a task of its own that does the load; it and every request that arrives
    # meanwhile await that task, shielded, so a requester that disconnects cancels neither the
    # load nor the others' wait. When the load ends the task hands its result or error to all
    # of them, and the entry goes. So 32 concurrent acquires of a cold model cause one copy,
    # one digest check, one load count.

    async def single_flight(self, key: tuple[str, str], load: Callable[[], Any]) -> None:
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

    async def ensure_disk(self, record: ModelRecord) -> None:
        """The layout is in the disk tier: fetched again from the source if it was removed."""
        if self.disk.contains(record.digest):
            return

        async def fetch() -> None:
            if not record.source:
                raise NotFound(
                    f"model {record.key} has no disk copy and no known source; add it again"
                )
            log.info("model %s has no disk copy; fetching it again from its source", record.key)
            manifest = await self.ingest_with_room(
                record.source, record.name, record.version, record.format or None, None, None
            )
            if manifest.digest != record.digest:
                if not self.catalog.by_digest(manifest.digest):
                    self.drop_disk_copy(
                        manifest.digest,
                        f"fetched for {record.key} but its source changed (the catalog expects "
                        f"{record.digest[:12]}); it is not served",
                    )
                raise CorruptModel(
                    f"the source of {record.key} changed: it now has digest "
                    f"{manifest.digest[:12]}, the catalog expects {record.digest[:12]}; "
                    "add it again under a new version"
                )
            self.loads["disk"] += 1
            self.metrics.loads.labels("disk").inc()

        await self.single_flight(("disk", record.digest), fetch)

    async def ingest_with_room(
        self,
        source: str,
        name: str,
        version: str,
        fmt: str | None,
        sha256: str | None,
        progress: Progress | None,
    ) -> Manifest:
        """Ingest into the disk tier, evicting by policy before the commit when it does not fit.

        The eviction runs on the event loop (which owns the ledgers) while the ingest thread
        waits for it, so a remote source is downloaded once even when room must be made.
        """
        from trims.daemon.ingest import DownloadLimits, ingest

        loop = asyncio.get_running_loop()

        async def evict_for(needed: int) -> None:
            self.sync_disk_ledger()
            for victim in self.disk_ledger.plan(needed, self._disk_evictable):
                self.evict_disk(victim.digest, f"needed {format_size(needed)} for {name}")

        def make_room(needed: int) -> None:
            asyncio.run_coroutine_threadsafe(evict_for(needed), loop).result()

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
            max_bytes=self.settings.budgets.disk,
            make_room=make_room,
            limits=DownloadLimits(
                stall_timeout=self.settings.download_stall_timeout,
                deadline=self.settings.download_deadline,
            ),
        )
        self.sync_disk_ledger()
        return manifest

    def sync_disk_ledger(self) -> None:
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
            and not self.cpu.holds_file(r.digest)
        )

    def evict_disk(self, digest: str, reason: str) -> None:
        with _tracer.start_as_current_span("evict") as span:
            span.set_attribute("trims.tier", "disk")
            span.set_attribute("trims.digest", digest)
            size = self.disk.path(digest).stat().st_size
            self.disk.remove(digest)
            self._verified.pop(digest, None)
            self.sync_disk_ledger()
            self.evictions["disk"] += 1
            self.metrics.evictions.labels("disk").inc()
            names = ", ".join(r.key for r in self.catalog.by_digest(digest)) or "?"
            log.info(
                "model %s evicted from disk tier (%s; %s freed; fetched again on use)",
                names,
                reason,
                format_size(size),
            )
            self.update_gauges()

    def _evictable(self, tier: str) -> Callable[[Resident], bool]:
        def ok(r: Resident) -> bool:
            return self.leases.count(tier, r.digest) == 0 and not self.catalog.pinned_in(
                r.digest, tier
            )

        return ok

    def evict(self, tier: str, resident: Resident, reason: str, *, cause: str) -> None:
        """Free a memory tier's copy; the layout stays on disk. ``reason`` is for the log,
        ``cause`` the metric's reason (trims_daemon_demotions_total)."""
        with _tracer.start_as_current_span("evict") as span:
            span.set_attribute("trims.tier", tier)
            span.set_attribute("trims.digest", resident.digest)
            self.tiers[tier].free(resident.digest)
            del self.ledgers[tier].residents[resident.digest]
            self.evictions[tier] += 1
            self.metrics.evictions.labels(tier).inc()
            self.metrics.demotions.labels(tier, cause).inc()
            names = ", ".join(r.key for r in self.catalog.by_digest(resident.digest)) or "?"
            log.info(
                "model %s evicted from %s tier (%s; %s freed)",
                names,
                tier,
                reason,
                format_size(resident.size),
            )
            self.update_gauges()

    async def ensure_resident(
        self, tier: str, record: ModelRecord, progress: Progress | None = None
    ) -> Resident:
        """The resident copy, loaded if needed. On return no await has happened since it was
        seen resident, so the caller can lease it before anything else can evict it."""
        ledger = self.ledgers[tier]
        for _ in range(_LOAD_ATTEMPTS):
            resident = ledger.residents.get(record.digest)
            if resident is not None and tier == "cpu" and not self.cpu.current(record.digest):
                self._verified.pop(record.digest, None)
                self.evict(
                    tier, resident, "its disk file changed since it was verified", cause="changed"
                )
                resident = None
            if resident is not None:
                return resident
            await self._load_into(tier, record, progress)
        raise ResourceExhausted(
            f"model {record.key} was evicted from the {tier} tier by other loads "
            f"{_LOAD_ATTEMPTS} times before it could be leased; the tier is too small for the "
            "working set: raise its budget",
            tier=tier,
            reason="budget",
            budget=ledger.budget,
            needed=record.total_bytes,
        )

    async def _load_into(self, tier: str, record: ModelRecord, progress: Progress | None) -> None:
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
                await self.ensure_disk(record)
                size = record.total_bytes
                victims, demoted = self._room(tier, record)
                for victim in victims:
                    self.evict(
                        tier,
                        victim,
                        f"budget {format_size(ledger.budget)}, "
                        f"needed {format_size(size)} for {record.key}",
                        cause="budget",
                    )
                for victim in demoted:
                    self.evict(
                        tier,
                        victim,
                        f"memory pressure: loading {record.key} ({format_size(size)}) would "
                        "take the node past its high watermark",
                        cause="memory_pressure",
                    )
                ledger.reserved += size
                started = time.monotonic()
                self.recall_chunks(record.digest, size)
                try:
                    loaded = await asyncio.to_thread(
                        self.tiers[tier].load,
                        record.digest,
                        self.disk.path(record.digest),
                        size,
                        record.key,
                        progress,
                        self._verified.get(record.digest),
                    )
                except CorruptModel as e:
                    self.metrics.damaged.labels(tier).inc()
                    self.drop_disk_copy(
                        record.digest,
                        f"loading {record.key} into the {tier} tier failed its digest check "
                        f"({e.message})",
                    )
                    raise
                finally:
                    ledger.reserved -= size
                    self.save_chunks()
                ledger.add(record.digest, size)
                if loaded.stamp is not None:
                    self._verified[record.digest] = loaded.stamp
                self.count_hashed(tier, loaded.hashed)
                self.loads[tier] += 1
                self.metrics.loads.labels(tier).inc()
                self.metrics.load_duration.labels(tier).observe(time.monotonic() - started)
                self.update_gauges()

        await self.single_flight((tier, record.digest), load)

    def _room(self, tier: str, record: ModelRecord) -> tuple[list[Resident], list[Resident]]:
        """The copies a load of ``record`` into ``tier`` evicts: for the tier's budget, then
        for memory (Note [memory pressure] in trims.daemon.pressure); ResourceExhausted, with
        nothing evicted, where either cannot make room."""
        ledger, size = self.ledgers[tier], record.total_bytes
        evictable = self._evictable(tier)
        try:
            victims = ledger.plan(size, evictable)
        except ResourceExhausted:
            self.metrics.loads_refused.labels(tier, "budget").inc()
            raise
        if tier != "cpu" or self.pressure is None:
            return victims, []
        try:
            demoted = self.pressure.room_for(size, ledger, evictable, victims, record.key)
        except ResourceExhausted as e:
            self.metrics.loads_refused.labels(tier, "memory").inc()
            # the acquire that asked logs it, rate-limited (Note [degraded acquires] in
            # trims.daemon.store), or its caller gets the error
            log.debug("model %s not loaded: %s", record.key, e.message)
            raise
        finally:
            self.metrics.memory_pressure.set(int(self.pressure.pressed))
        return victims, demoted

    def relieve_pressure(self) -> None:
        """One check of the cgroup's memory: at or above the high watermark, demote unleased
        CPU-tier copies until the working set is under the low one (Note [memory pressure]
        in trims.daemon.pressure)."""
        if self.pressure is None:
            return
        was_pressed = self.pressure.pressed
        relief = self.pressure.check(self.ledgers["cpu"], self._evictable("cpu"))
        if relief is not None:
            reading = relief.reading
            where = (
                f"working set {format_size(reading.working_set_bytes)} of the "
                f"{format_size(reading.limit_bytes)} limit, high watermark "
                f"{self.pressure.high:.0%}"
            )
            for victim in relief.victims:
                self.evict("cpu", victim, f"memory pressure: {where}", cause="memory_pressure")
            if relief.victims:
                self.pressure.after(self.pressure.source())
            elif not self._stuck_logged:
                self._stuck_logged = True
                log.warning(
                    "memory pressure: %s, and no copy in the cpu tier can be demoted (%d "
                    "leased or pinned, %s): loads into the cpu tier that need memory are "
                    "refused until leases end or the node's other processes free memory",
                    where,
                    len(relief.held),
                    format_size(sum(r.size for r in relief.held)),
                )
        if not self.pressure.pressed:
            self._stuck_logged = False
            if was_pressed:
                log.info("memory pressure over: the working set is under the low watermark")
        self.metrics.memory_pressure.set(int(self.pressure.pressed))

    async def watch_memory(self) -> None:
        """Check the cgroup's memory every ``memory_check_interval`` seconds until cancelled;
        a check that fails is logged and the next one runs."""
        while True:
            try:
                self.relieve_pressure()
            except Exception:
                log.exception("memory pressure check failed; the next runs in %.1f s",
                              self.settings.memory_check_interval)  # fmt: skip
            await asyncio.sleep(self.settings.memory_check_interval)

    # Note [disk re-verification]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A blob is mode 0400 in a 0700 store dir, but a client that is root (or the daemon's
    # uid) can fchmod the read-only fd a "disk" acquire hands out and write the file; nothing
    # stops root, so we detect it. When a blob is verified we remember its Stamp (inode,
    # size, mtime, ctime; the kernel sets ctime on every write, truncate, chmod or rename and
    # userspace cannot set it back). Before each hand-out of the file (verify_disk, then
    # open_verified for tier "disk") the current stamp is compared, and the whole digest is
    # recomputed whenever it differs; open_verified also checks the fd it opened against that
    # stamp, so a swap between the check and the open is caught. A blob that fails is
    # deleted (DiskTier.verify) and the acquire fails with CorruptModel; the next acquire
    # fetches it again from its source when the model has one. Promotion to a memory tier
    # hashes every byte it copies (CpuTier/GpuTier.load), which is stronger than the stamp
    # check, and deletes the blob the same way when that hash fails; a load that found the
    # stamp unchanged across its copy records it as verified too. A change made after a
    # hand-out is visible to holders of that fd until the next check: see docs/store.md.
    #
    # Note [trusted re-loads]
    # ~~~~~~~~~~~~~~~~~~~~~~~
    # The one load that does not hash is the CPU tier's page-cache backing (Note [page-cache
    # copies] in trims.daemon.tiers.pagecache) of a blob whose stamp is the one this daemon
    # verified it under (at commit, at a disk check, or at an earlier load): there the copy
    # *is* the disk file, which the disk tier already serves on that same stamp check, and
    # which is checked again at every hand-out (CpuTier.current). Hashing it once more would
    # prove nothing those checks do not, and cost the whole hash (about 530 ms per 512 MiB on
    # our test machine) on every re-load of a model evicted from memory. A sealed memfd and
    # GPU memory are copies served to every tenant long after the file may have changed, and
    # whoever can write the blob (root, or a non-root daemon's own uid) can change its bytes
    # without moving ctime through a writable mapping made before the last check; so those
    # copies always hash what they copy. ``stats`` and ``trims_verified_bytes`` count the
    # bytes hashed per tier.

    async def verify_disk(
        self, record: ModelRecord, *, scrub: bool = False, progress: Progress | None = None
    ) -> None:
        """Check the disk file against its digest before serving it: once, and again whenever
        its stamp changed since (Note [disk re-verification]); with ``scrub``, now, reading
        the device past the page cache (Note [scrub reads the device] in
        trims.daemon.tiers.disk). ``progress`` hears of a hash this call starts (not one it
        joins)."""
        stamp = self.disk.stamp(record.digest)
        if not scrub and stamp is not None and self._verified.get(record.digest) == stamp:
            return

        async def verify() -> None:
            self._verified.pop(record.digest, None)
            self.recall_chunks(record.digest, record.total_bytes)
            try:
                verified = await asyncio.to_thread(
                    partial(self.disk.verify, record.digest, progress, direct=scrub)
                )
            except CorruptModel:
                self.metrics.damaged.labels("disk").inc()
                raise
            finally:
                self.sync_disk_ledger()
                self.save_chunks()
            self._verified[record.digest] = verified
            self.count_hashed("disk", verified.size)

        await self.single_flight(("scrub" if scrub else "verify", record.digest), verify)

    async def open_verified(self, record: ModelRecord) -> int:
        """A read-only fd of the verified disk blob (Note [disk re-verification])."""
        for _ in range(2):
            await self.ensure_disk(record)
            await self.verify_disk(record)
            try:
                fd = os.open(self.disk.path(record.digest), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError as e:
                raise NotFound(f"model {record.key} was removed while it was acquired") from e
            if Stamp.of(os.fstat(fd)) == self._verified.get(record.digest):
                return fd
            os.close(fd)
        raise CorruptModel(
            f"the disk copy of {record.key} keeps changing while it is verified; find what "
            "writes to the store directory, then remove the model and add it again"
        )
