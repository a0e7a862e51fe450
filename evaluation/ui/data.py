"""The results database as the UI reads it: opened read-only, on first use, off the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from trims.errors import NotFound
from trims.evaluation.db import ResultsDB, UnreadableEvaluation

__all__ = ["DatabaseMissing", "Results"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class DatabaseMissing(NotFound):
    """The results database does not exist (yet): list pages show it as an empty state."""

    code = "database_missing"


class Results:
    """One read-only :class:`ResultsDB`, opened when first needed (it may appear after the
    gateway starts) and queried in a worker thread so SQLite never blocks the event loop."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._db: ResultsDB | None = None
        self._lock = threading.Lock()
        self._logged: set[int] = set()

    def _open(self) -> ResultsDB:
        with self._lock:
            if self._db is None:
                try:
                    self._db = ResultsDB(self.url, readonly=True)
                except NotFound as e:
                    raise DatabaseMissing(
                        f"{e.message} (the gateway's --results-db; results appear once "
                        "trims evaluate run, trims trace or trims analyze wrote them)"
                    ) from e
            return self._db

    async def call(self, read: Callable[[ResultsDB], T]) -> T:
        """``read(db)`` in a worker thread."""

        def run() -> T:
            return read(self._open())

        return await asyncio.to_thread(run)

    def flag(self, unreadable: Sequence[UnreadableEvaluation]) -> list[UnreadableEvaluation]:
        """The rows a page leaves out, each logged the first time a page meets it (every page
        view shows them; the log says it once)."""
        for e in unreadable:
            if e.row_id not in self._logged:
                self._logged.add(e.row_id)
                log.warning("%s; the web UI leaves it out of its pages", e.message)
        return list(unreadable)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
