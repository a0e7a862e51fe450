"""Typed settings shared by the daemon, the runtime and the CLI.

Settings are frozen dataclasses built once in ``main()`` from argv and the environment
(``TRIMS_*``); nothing here reads the environment at import time. Each field says its unit,
default and why.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trims.errors import ValidationError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10, "ki": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20, "mi": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "gi": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40, "ti": 1 << 40,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """'8GiB' -> 8589934592, '500MB' -> 500000000, '0' -> 0; ints pass through."""
    if isinstance(text, int):
        if text < 0:
            raise ValidationError(f"size {text} must not be negative")
        return text
    m = _SIZE_RE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ValidationError(f"invalid size {text!r}: use a number with B, KiB, MiB, GiB or TiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def format_size(n: int) -> str:
    """8589934592 -> '8.0 GiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def runtime_dir(env: Mapping[str, str]) -> Path:
    """Where sockets live: $TRIMS_RUNTIME_DIR, else $XDG_RUNTIME_DIR/trims, else /tmp/trims-UID."""
    if env.get("TRIMS_RUNTIME_DIR"):
        return Path(env["TRIMS_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "trims"
    return Path(f"/tmp/trims-{os.getuid()}")


def data_dir(env: Mapping[str, str]) -> Path:
    """Where the store keeps its files: $TRIMS_STORE_DIR, else ~/.local/share/trims/store."""
    if env.get("TRIMS_STORE_DIR"):
        return Path(env["TRIMS_STORE_DIR"])
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "trims" / "store"


def default_socket(env: Mapping[str, str]) -> Path:
    """The store socket clients connect to: $TRIMS_SOCKET, else <runtime dir>/store.sock."""
    if env.get("TRIMS_SOCKET"):
        return Path(env["TRIMS_SOCKET"])
    return runtime_dir(env) / "store.sock"


def admin_socket_for(store_socket: Path) -> Path:
    """The admin socket sits beside the store socket: store.sock -> store.admin.sock."""
    return store_socket.with_name(store_socket.stem + ".admin" + store_socket.suffix)


EVICTION_POLICIES = ("lru", "lfu", "fifo", "never")


@dataclass(frozen=True)
class TierBudgets:
    """Byte budgets per tier; 0 disables a tier (gpu defaults to 0 where there is no GPU)."""

    #: Host memory for sealed memfds. Default 8 GiB: most nodes keep several models hot.
    cpu: int = 8 << 30
    #: Local disk for the content-addressed layouts. Default 64 GiB.
    disk: int = 64 << 30
    #: Device memory per GPU. Default 0 (off) so a CPU node never tries to use CUDA.
    gpu: int = 0


@dataclass(frozen=True)
class DaemonSettings:
    """Everything `trims daemon` needs; built once in its main()."""

    #: Directory of the catalog (SQLite) and the disk tier. Must be on a local filesystem.
    store_dir: Path
    #: The store socket (acquire/release/info/list/stats). Its admin twin sits beside it.
    socket_path: Path
    #: Mode of the store socket. 0660: the owner and the configured group may connect.
    socket_mode: int = 0o660
    #: Group that may connect to the store socket (name or gid); None keeps the daemon's group.
    socket_group: str | None = None
    budgets: TierBudgets = field(default_factory=TierBudgets)
    #: Eviction policy per tier, one of EVICTION_POLICIES. LRU suits serving traffic.
    eviction: str = "lru"
    #: S3 endpoint for s3:// sources (any S3-compatible store); None uses AWS defaults.
    s3_endpoint: str | None = None
    #: OTLP/HTTP endpoint for traces; None exports nothing.
    otlp_endpoint: str | None = None
    #: Address for the Prometheus /metrics endpoint ("host:port"); None disables it.
    metrics_address: str | None = None

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ValidationError(
                f"unknown eviction policy {self.eviction!r}; use one of {EVICTION_POLICIES}"
            )

    @property
    def admin_socket_path(self) -> Path:
        return admin_socket_for(self.socket_path)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` all at once: readers see the old file or the new one.

    The data goes to a temp file in the same folder (created if missing), is fsynced, then
    renamed over ``path``; on any failure the temp file is removed and ``path`` is untouched.
    """
    import tempfile

    raw = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
