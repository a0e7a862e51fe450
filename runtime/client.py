"""The store client: a synchronous, thread-safe connection to the node's model-store daemon.

Function code acquires models over the store socket and gets :class:`Lease` objects whose
buffers are private, copy-on-write mappings of the daemon's single copy (see
:mod:`trims.runtime.mapping`). Admin operations (add, remove, load, evict, pin, unpin) go over
the admin socket beside it, opened on first use.

Note [Leases belong to the connection]
--------------------------------------
The daemon ties every lease to the connection that acquired it and ends them all when that
connection closes (also when the process is killed). A lease whose connection is gone is
therefore already over at the daemon; :meth:`Lease.release` then only drops the mapping.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from trims.config import admin_socket_for, default_socket
from trims.errors import (
    ProtocolError,
    Unavailable,
    ValidationError,
    error_from_dict,
)
from trims.errors import Timeout as TrimsTimeout
from trims.layout import Manifest
from trims.protocol import Op, Progress, recv_frame, send_frame
from trims.runtime.mapping import HostMapping

log = logging.getLogger(__name__)

#: Operations that may run for minutes (downloads, conversion); the read timeout grows to this.
LONG_OP_TIMEOUT = 3600.0
HOST_HANDLES = ("memfd", "file")
CUDA_HANDLES = ("cuda_vmm", "cuda_ipc")


class _Connection:
    """One socket to one daemon endpoint; a lock serialises each request/response pair."""

    def __init__(self, path: Path, timeout: float, client_name: str) -> None:
        self.path = path
        self.timeout = timeout
        self.client_name = client_name
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        #: A socket already connected for this client by another process (:meth:`adopt`),
        #: greeted on first use.
        self.handed: socket.socket | None = None
        #: Bumped on every (re)connect; leases remember the generation they came from.
        self.generation = 0
        self.greeting: dict[str, Any] = {}
        self._next_id = 0

    def _unavailable(self, what: str, error: BaseException) -> Unavailable:
        return Unavailable(
            f"the trims daemon at {self.path} is not reachable ({what}: {error}); start it with "
            "`trims daemon` or point TRIMS_SOCKET at its socket",
            socket=str(self.path),
        )

    def _connect(self) -> socket.socket:
        sock, self.handed = self.handed, None
        if sock is not None and _closed_by_peer(sock):
            sock.close()
            sock = None
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except OSError as e:
                sock.close()
                raise self._unavailable("connect", e) from e
        self.sock = sock
        self.generation += 1
        try:
            hello = self._exchange(sock, Op.HELLO, {"client": self.client_name}, None, self.timeout)
        except BaseException:
            self._drop()
            raise
        self.greeting = hello[0]
        return sock

    def ensure(self) -> dict[str, Any]:
        """Connect now if not connected; the daemon's greeting."""
        with self.lock:
            if self.sock is None:
                self._connect()
            return self.greeting

    def adopt(self, sock: socket.socket) -> None:
        """Use ``sock``, connected to this endpoint by another process, for the next connection
        (instead of connecting: this process may not be allowed to)."""
        with self.lock:
            self._drop()
            self.handed = sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.handed is not None:
            self.handed.close()
            self.handed = None

    def close(self) -> None:
        with self.lock:
            self._drop()

    def request(
        self,
        op: Op,
        args: dict[str, Any],
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], list[int], int]:
        """Send one request and wait for its final reply: (result, fds, connection generation)."""
        with self.lock:
            if self.sock is not None and _closed_by_peer(self.sock):
                self._drop()
            sock = self.sock or self._connect()
            result, fds = self._exchange(sock, op, args, progress, timeout or self.timeout)
            return result, fds, self.generation

    def _exchange(
        self,
        sock: socket.socket,
        op: Op,
        args: dict[str, Any],
        progress: Progress | None,
        timeout: float,
    ) -> tuple[dict[str, Any], list[int]]:
        """One request/response; any failure of the stream itself drops the connection.

        An error *reply* keeps the connection (and so this client's leases); a broken,
        interrupted or out-of-step stream closes it, since the next frame could not be trusted.
        """
        self._next_id += 1
        rid = self._next_id
        sock.settimeout(timeout)
        try:
            send_frame(sock, {"id": rid, "op": str(op), "args": args})
            while True:
                message, fds = recv_frame(sock)
                if message.get("id") is None and isinstance(message.get("error"), dict):
                    # The daemon closes the connection with an unsolicited error (an idle
                    # connection without leases, a limit): nothing more will come on it.
                    for fd in fds:
                        os.close(fd)
                    self._drop()
                    raise error_from_dict(message["error"])
                if message.get("id") != rid:
                    for fd in fds:
                        os.close(fd)
                    raise ProtocolError(
                        f"the daemon at {self.path} answered request {message.get('id')!r} "
                        f"while {rid} was pending"
                    )
                if "progress" not in message:
                    break
                for fd in fds:
                    os.close(fd)
                _report(progress, message["progress"])
        except TimeoutError as e:
            self._drop()
            raise TrimsTimeout(
                f"the trims daemon at {self.path} did not answer {op} within {timeout:.0f} s; "
                "check that it is healthy (`trims models ls`) or raise the client timeout"
            ) from e
        except ProtocolError:
            self._drop()
            raise
        except (ConnectionError, OSError) as e:
            self._drop()
            raise self._unavailable(str(op), e) from e
        except BaseException:
            self._drop()
            raise
        if message.get("ok"):
            result = message.get("result")
            return (result if isinstance(result, dict) else {}), fds
        for fd in fds:
            os.close(fd)
        error = message.get("error")
        raise error_from_dict(error if isinstance(error, dict) else {})


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon has spoken or hung up on an idle connection between requests.

    Between requests nothing is due, so a readable socket means the daemon closed it (an idle
    connection without leases, Note [idle connections] in ``trims.daemon.connection``). Such a
    connection held no leases, so a fresh one loses nothing.
    """
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def _report(progress: Progress | None, body: Any) -> None:
    if progress is None or not isinstance(body, dict):
        return
    total = body.get("total")
    progress(
        str(body.get("stage", "")),
        int(body.get("done", 0)),
        int(total) if isinstance(total, int) else None,
    )


class Lease:
    """A model acquired from the store: its manifest and a private mapping of its buffer.

    Release it (or use it as a context manager) when the model is no longer needed; views
    built from it stay valid after release (see Note [Why a mapping outlives its lease]).
    """

    def __init__(
        self,
        client: StoreClient,
        lease_id: str,
        tier: str,
        manifest: Manifest,
        handle: dict[str, Any],
        host: HostMapping | None,
        device: Any | None,
        generation: int,
    ) -> None:
        self._client = client
        self.id = lease_id
        self.tier = tier
        self.manifest = manifest
        self.handle = handle
        self._host = host
        #: A :class:`trims.runtime.adapters.cuda.DeviceMapping` for GPU-tier leases.
        self.device = device
        self._generation = generation
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def _host_mapping(self) -> HostMapping:
        if self._host is None:
            raise ValidationError(
                f"lease {self.id} of {self.manifest.name} is in the {self.tier} tier and has no "
                "host buffer; use trims.runtime.adapters.torch.cuda_tensors, or acquire with "
                "tier='cpu'"
            )
        return self._host

    @property
    def mapping(self) -> HostMapping:
        return self._host_mapping()

    def buffer(self) -> memoryview:
        """The whole model buffer (MAP_PRIVATE: writes stay in this process)."""
        return self._host_mapping().buffer()

    def numpy(self) -> dict[str, np.ndarray[Any, Any]]:
        """Zero-copy NumPy views per tensor; writes are copy-on-write and private."""
        return self._host_mapping().numpy()

    def release(self) -> None:
        """End the lease at the daemon and drop this object's mapping. Idempotent."""
        if self._released:
            return
        self._released = True
        try:
            self._client._release_id(self.id, self._generation)
        finally:
            if self._host is not None:
                self._host.close()
            if self.device is not None:
                self.device.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        m = self.manifest
        return f"Lease({self.id!r}, {m.name}:{m.version}, tier={self.tier!r})"


class StoreClient:
    """Talks to the node's trims daemon. Safe to share between threads."""

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        timeout: float = 60.0,
        client_name: str | None = None,
    ) -> None:
        path = Path(socket_path) if socket_path is not None else default_socket(os.environ)
        self.socket_path = path
        self.admin_socket_path = admin_socket_for(path)
        name = client_name or f"trims-client pid={os.getpid()}"
        self._store = _Connection(path, timeout, name)
        self._admin = _Connection(self.admin_socket_path, timeout, name)
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def connect(self) -> dict[str, Any]:
        """Connect now (normally done on first use); returns the daemon's greeting."""
        if self._closed:
            raise Unavailable(f"this StoreClient for {self.socket_path} was closed; open a new one")
        return self._store.ensure()

    def adopt(self, sock: socket.socket) -> None:
        """Take over ``sock``, a connection to the store socket that a process allowed to
        connect made for this one (a pooled worker's zygote: Note [warm pool] in
        :mod:`trims.runtime.executors.zygote`); the daemon is greeted on it on first use. A
        connection the daemon closes later is replaced by one this process makes itself."""
        if self._closed:
            raise Unavailable(f"this StoreClient for {self.socket_path} was closed; open a new one")
        sock.settimeout(self._store.timeout)
        self._store.adopt(sock)

    def close(self) -> None:
        """Close both sockets; the daemon ends this client's leases. Mappings stay valid."""
        self._closed = True
        self._store.close()
        self._admin.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _call(
        self,
        op: Op,
        args: dict[str, Any],
        *,
        admin: bool = False,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        result, fds, _ = self._request(op, args, admin=admin, progress=progress, timeout=timeout)
        for fd in fds:
            os.close(fd)
        return result

    def _request(
        self,
        op: Op,
        args: dict[str, Any],
        *,
        admin: bool = False,
        progress: Progress | None = None,
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], list[int], int]:
        if self._closed:
            raise Unavailable(f"this StoreClient for {self.socket_path} was closed; open a new one")
        conn = self._admin if admin else self._store
        return conn.request(op, {k: v for k, v in args.items() if v is not None}, progress, timeout)

    # -- function-facing operations ----------------------------------------------------------

    def acquire(
        self,
        name: str,
        version: str | None = None,
        *,
        digest: str | None = None,
        tier: str = "cpu",
        device: str | None = None,
    ) -> Lease:
        """Lease a model and map it. ``tier`` is "cpu" (default), "gpu" or "disk"."""
        args = {"name": name, "version": version, "digest": digest, "tier": tier, "device": device}
        result, fds, generation = self._request(Op.ACQUIRE, args)
        lease_id = str(result.get("lease", ""))
        try:
            manifest = Manifest.from_dict(result.get("manifest") or {})
            handle = result.get("handle") or {}
            kind = handle.get("kind")
            host = device_mapping = None
            if kind in HOST_HANDLES:
                if len(fds) != 1:
                    raise ProtocolError(f"acquire of {name}: a {kind} handle needs one descriptor")
                host = HostMapping.from_fd(
                    fds.pop(),
                    int(handle.get("size", 0)),
                    manifest,
                    populate=handle.get("populate") is not False,
                )
            elif kind in CUDA_HANDLES:
                from trims.runtime.adapters import cuda

                device_mapping = cuda.DeviceMapping.import_handle(handle, fds, manifest)
                fds.clear()
            else:
                raise ProtocolError(f"acquire of {name}: unknown handle kind {kind!r}")
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._release_id(lease_id, generation)
            raise
        lease = Lease(
            self,
            lease_id,
            str(result.get("tier", tier)),
            manifest,
            handle,
            host,
            device_mapping,
            generation,
        )
        log.debug("model %s:%s acquired from the %s tier", manifest.name, manifest.version, tier)
        return lease

    @contextmanager
    def lease(self, name: str, version: str | None = None, **kwargs: Any) -> Iterator[Lease]:
        """``with client.lease("resnet") as lease:`` acquires and releases."""
        lease = self.acquire(name, version, **kwargs)
        try:
            yield lease
        finally:
            lease.release()

    def release(self, lease: Lease | str) -> None:
        if isinstance(lease, Lease):
            lease.release()
        else:
            self._call(Op.RELEASE, {"lease": lease})

    def _release_id(self, lease_id: str, generation: int) -> None:
        """Release at the daemon unless the connection that held the lease is gone."""
        if not lease_id or self._closed or generation != self._store.generation:
            return
        try:
            self._call(Op.RELEASE, {"lease": lease_id})
        except Unavailable:
            log.info("lease %s ended with the daemon connection; nothing to release", lease_id)

    def info(self, name: str, version: str | None = None, *, admin: bool = False) -> dict[str, Any]:
        """One model; ``admin`` asks over the admin socket, which adds source and access list."""
        args = {"name": name, "version": version}
        return dict(self._call(Op.INFO, args, admin=admin).get("model") or {})

    def list(self, *, admin: bool = False) -> list[dict[str, Any]]:
        """The models this client may acquire (all of them, with access lists, if ``admin``)."""
        return list(self._call(Op.LIST, {}, admin=admin).get("models") or [])

    def stats(self) -> dict[str, Any]:
        return self._call(Op.STATS, {})

    # -- admin operations (admin socket) -----------------------------------------------------

    def add(
        self,
        name: str,
        source: str | Path,
        *,
        version: str | None = None,
        fmt: str | None = None,
        sha256: str | None = None,
        access: Mapping[str, Sequence[int]] | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """Ingest a model from a local path or an http(s):// / s3:// URL.

        ``access`` ({"uids": [...], "gids": [...]}, numeric ids) limits who may see and acquire
        it; None leaves it open to everyone who can reach the store socket.
        """
        text = str(source)
        if "://" not in text:
            text = str(Path(text).expanduser().resolve())
        args = {
            "name": name,
            "source": text,
            "version": version,
            "format": fmt,
            "sha256": sha256,
            "access": None if access is None else {k: list(v) for k, v in access.items()},
        }
        result = self._call(Op.ADD, args, admin=True, progress=progress, timeout=LONG_OP_TIMEOUT)
        return dict(result.get("model") or {})

    def remove(self, name: str, version: str | None = None, *, force: bool = False) -> Any:
        args = {"name": name, "version": version, "force": force or None}
        return self._call(Op.REMOVE, args, admin=True).get("removed")

    def load(
        self,
        name: str,
        version: str | None = None,
        *,
        tier: str = "cpu",
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        args = {"name": name, "version": version, "tier": tier}
        result = self._call(Op.LOAD, args, admin=True, progress=progress, timeout=LONG_OP_TIMEOUT)
        return dict(result.get("model") or {})

    def verify(
        self,
        name: str | None = None,
        version: str | None = None,
        *,
        progress: Progress | None = None,
    ) -> Any:
        """Hash the disk copies of every model (or of ``name``) again; one entry per layout
        with its ``state``: "ok", "damaged" (deleted; ``error`` says why) or "absent"."""
        args = {"name": name, "version": version}
        result = self._call(Op.VERIFY, args, admin=True, progress=progress, timeout=LONG_OP_TIMEOUT)
        return [dict(e) for e in result.get("verified") or []]  # list[dict[str, Any]]

    def evict(self, name: str, version: str | None = None, *, tier: str | None = None) -> Any:
        args = {"name": name, "version": version, "tier": tier}
        return self._call(Op.EVICT, args, admin=True).get("evicted")

    def pin(self, name: str, version: str | None = None, *, tier: str | None = None) -> Any:
        args = {"name": name, "version": version, "tier": tier}
        return dict(self._call(Op.PIN, args, admin=True).get("model") or {})

    def unpin(self, name: str, version: str | None = None, *, tier: str | None = None) -> Any:
        args = {"name": name, "version": version, "tier": tier}
        return dict(self._call(Op.UNPIN, args, admin=True).get("model") or {})
