"""What the daemon, the runtime and the CLI share: sizes, default paths, atomic writes.

Nothing here reads the environment at import time: functions take ``env``. Settings only the
daemon uses live in :mod:`trims.daemon.settings`; the gateway's in
:mod:`trims.runtime.settings`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
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


def results_db(env: Mapping[str, str]) -> str:
    """The results database evaluations, traces and layer analyses share by default:
    $TRIMS_RESULTS_DB (a SQLite path or SQLAlchemy URL), else
    $XDG_DATA_HOME/trims/results.sqlite (~/.local/share/trims/results.sqlite), never a file
    in the working directory."""
    if env.get("TRIMS_RESULTS_DB"):
        return env["TRIMS_RESULTS_DB"]
    base = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "trims" / "results.sqlite")


def default_socket(env: Mapping[str, str]) -> Path:
    """The store socket clients connect to: $TRIMS_SOCKET, else <runtime dir>/store.sock."""
    if env.get("TRIMS_SOCKET"):
        return Path(env["TRIMS_SOCKET"])
    return runtime_dir(env) / "store.sock"


def admin_socket_for(store_socket: Path) -> Path:
    """The admin socket sits beside the store socket: store.sock -> store.admin.sock."""
    return store_socket.with_name(store_socket.stem + ".admin" + store_socket.suffix)


def write_atomic(path: Path, data: bytes | str, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` all at once: readers see the old file or the new one.

    The data goes to a temp file in the same folder (created if missing), is fsynced, then
    renamed over ``path``; on any failure the temp file is removed and ``path`` is untouched.
    ``mode``: the file's permission bits (default: owner-only, 0600, as ``mkstemp`` makes it),
    set before the rename, so the file never appears with other bits.
    """
    import tempfile

    raw = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
