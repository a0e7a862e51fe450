"""Fair shares for the socket server: connection slots per uid, a shared read budget, per-peer logs.

Three small pieces, each owned by :class:`trims.daemon.server.Server`:

* :class:`ConnectionSlots` counts the open connections of one socket, in total and per uid, and
  says which limit (if any) refuses a new one. The store socket and the admin socket each get
  their own, so a flood on the store socket never takes the admin socket's slots.
* :class:`ReadBudget` bounds the bytes of partially read request frames across all connections;
  a connection reserves before it reads and waits while the budget is spent.
* :class:`PeerLog` rate-limits log lines about one uid (a token bucket per uid) and logs a
  "suppressed N" summary once the burst is over, so a misbehaving client cannot flood the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ConnectionSlots", "PeerLog", "ReadBudget"]

#: Buckets kept per PeerLog before full (idle) ones are dropped; bounds its memory.
_MAX_BUCKETS = 4096


class ConnectionSlots:
    """Open connections of one socket: at most ``total``, and at most ``per_uid`` per uid."""

    def __init__(self, total: int, per_uid: int | None) -> None:
        self.total = total
        self.per_uid = per_uid
        self._open: Counter[int] = Counter()
        self._count = 0

    def refusal(self, uid: int) -> str | None:
        """The limit a new connection of ``uid`` would break ("total", "per_uid"), else None."""
        if self._count >= self.total:
            return "total"
        if self.per_uid is not None and self._open[uid] >= self.per_uid:
            return "per_uid"
        return None

    def take(self, uid: int) -> None:
        self._open[uid] += 1
        self._count += 1

    def give(self, uid: int) -> None:
        self._open[uid] -= 1
        if self._open[uid] <= 0:
            del self._open[uid]
        self._count -= 1

    def __len__(self) -> int:
        return self._count


class ReadBudget:
    """Bytes that connections may hold in read buffers, all together.

    Note [read budget]
    ~~~~~~~~~~~~~~~~~~
    A connection reserves one read chunk before each ``recv`` and keeps reserved exactly the
    bytes of the partial frame its decoder still buffers, so ``used`` bounds the daemon's read
    buffers at any moment. When the budget is spent, readers wait (their sockets fill and the
    kernel pushes back on the senders) instead of the daemon growing. A connection waiting for
    budget in the middle of a frame is still subject to the read timeout, which ends the
    slowest partial frames and so frees budget: the wait cannot last forever.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def reserve(self, nbytes: int) -> int:
        """Wait until ``nbytes`` (at most the whole budget) fit, take them; the bytes taken."""
        nbytes = min(nbytes, self.limit)
        while self.used + nbytes > self.limit:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes``; every waiter re-checks whether its reservation fits now."""
        if nbytes <= 0:
            return
        self.used -= nbytes
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


@dataclass
class _Bucket:
    tokens: float
    stamp: float
    suppressed: int = 0
    flush: asyncio.TimerHandle | None = None


class PeerLog:
    """Log lines about one peer uid, at most ``burst`` per ``interval`` seconds per uid.

    Lines over the limit are counted, not written; a summary line "suppressed N ..." follows
    once the uid may log again (when its next line is allowed, or after ``interval`` seconds
    at the latest).
    """

    def __init__(
        self,
        logger: logging.Logger,
        burst: int,
        interval: float,
        on_suppressed: Callable[[], None] = lambda: None,
    ) -> None:
        self._log = logger
        self.burst = burst
        self.interval = interval
        self._on_suppressed = on_suppressed
        self._buckets: dict[int, _Bucket] = {}

    def log(self, level: int, uid: int, message: str, *args: object) -> None:
        """Log ``message % args`` about ``uid`` at ``level`` if its bucket allows."""
        if not self._log.isEnabledFor(level):
            return
        now = time.monotonic()
        bucket = self._bucket(uid, now)
        if bucket.tokens < 1:
            bucket.suppressed += 1
            self._on_suppressed()
            if bucket.flush is None:
                bucket.flush = self._schedule_flush(uid)
            return
        bucket.tokens -= 1
        self._summarize(uid, bucket)
        self._log.log(level, message, *args)

    def warning(self, uid: int, message: str, *args: object) -> None:
        self.log(logging.WARNING, uid, message, *args)

    def _bucket(self, uid: int, now: float) -> _Bucket:
        bucket = self._buckets.get(uid)
        if bucket is None:
            if len(self._buckets) >= _MAX_BUCKETS:
                self._prune(now)
            bucket = self._buckets[uid] = _Bucket(float(self.burst), now)
        rate = self.burst / self.interval
        bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        return bucket

    def _prune(self, now: float) -> None:
        rate = self.burst / self.interval
        for uid, b in list(self._buckets.items()):
            if not b.suppressed and b.tokens + (now - b.stamp) * rate >= self.burst:
                del self._buckets[uid]

    def _schedule_flush(self, uid: int) -> asyncio.TimerHandle | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        return loop.call_later(self.interval, self._flush, uid)

    def _flush(self, uid: int) -> None:
        bucket = self._buckets.get(uid)
        if bucket is not None:
            bucket.flush = None
            self._summarize(uid, bucket)

    def _summarize(self, uid: int, bucket: _Bucket) -> None:
        if not bucket.suppressed:
            return
        self._log.warning(
            "suppressed %d more log line(s) about uid %d (at most %d per %.0f s per uid)",
            bucket.suppressed,
            uid,
            self.burst,
            self.interval,
        )
        bucket.suppressed = 0
        if bucket.flush is not None:
            bucket.flush.cancel()
            bucket.flush = None

    def close(self) -> None:
        """Write the pending summaries and cancel their timers (at daemon shutdown)."""
        for uid, bucket in list(self._buckets.items()):
            self._summarize(uid, bucket)
