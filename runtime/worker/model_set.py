"""The models of one instance: acquired through the store before init(ctx), released at exit.

Each acquisition holds a lease on the store; the lease keeps the daemon from freeing the memory
the instance maps, and it ends when released here or when the process dies (the daemon ties
leases to the connection).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace

from trims.errors import Unavailable
from trims.runtime.functions.spec import FunctionSpec

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("trims.worker")


@dataclass
class ModelSet:
    models: dict[str, Any] = field(default_factory=dict)
    client: Any = None

    def release_all(self) -> None:
        for key, model in self.models.items():
            try:
                model.close()
            except Exception:
                log.warning("releasing model %s failed; its lease ends with the process", key)
        self.models.clear()
        if self.client is not None:
            self.client.close()
            self.client = None

    def populate(self) -> None:
        """Fill the page tables of every store-mapped model now (a standby's prepare: Note
        [standby instances] in trims.runtime.gateway.pool), so its first request reads at
        warm speed; a model loaded from its source has nothing to populate."""
        for key, model in self.models.items():
            how = model.populate()
            log.debug("model %s: mapping populated for the standby (%s)", key, how or "nothing")


def connect_store(store_socket: Path | None, handed: socket.socket | None = None) -> Any:
    """A store client connected now (before the worker drops privileges, so a worker running
    as another user keeps a connection it could not open itself), or on ``handed``, a
    connection a process allowed to connect made for it (a pooled worker's zygote), greeted
    on first use. Unreachable -> not yet connected; the models then fall back to their
    sources."""
    from trims.runtime.client import StoreClient

    client = StoreClient(store_socket)
    if handed is not None:
        client.adopt(handed)
        return client
    try:
        client.connect()
    except Unavailable as e:
        log.warning("model store not reachable at start (%s); models load from their sources", e)
    return client


def acquire_models(spec: FunctionSpec, client: Any) -> ModelSet:
    """Open every model the spec lists (store first, the ref's ``source`` as fallback)."""
    out = ModelSet(client=client)
    if not spec.models:
        return out
    from trims.runtime.models import open_model

    try:
        for ref in spec.models:
            t0 = time.perf_counter()
            with _tracer.start_as_current_span(
                "model.acquire", attributes={"model": ref.name, "tier": ref.tier}
            ):
                out.models[ref.key] = open_model(
                    ref.name,
                    version=ref.version,
                    source=ref.source,
                    client=out.client,
                    tier=ref.tier,
                )
            log.info("model %s opened for %s in %.1f ms",
                     ref.name, spec.name, (time.perf_counter() - t0) * 1e3)  # fmt: skip
    except BaseException:
        out.release_all()
        raise
    return out
