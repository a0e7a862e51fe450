"""Crash safety of the catalog: kill the real daemon at every step of add and rm, restart it.

The daemon is started with the hidden ``--crash-point`` option, so it SIGKILLs itself at that
step of Note [commit protocol] (daemon/store.py). After the restart on the same store each model
is either absent or fully present (source, access list, right bytes), no stray blob or temp file
remains, and a uid outside the access list (a child running as ``nobody``) cannot acquire it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.rawclient import RawClient, as_nobody
from tests.fixtures.store import DaemonProcess
from trims.daemon.crashpoints import ADD_POINTS, REMOVE_POINTS
from trims.errors import CorruptModel, NotFound
from trims.protocol import recv_frame, send_frame

W = np.arange(4096, dtype=np.float32)
ACCESS = {"uids": [os.getuid()], "gids": [os.getgid()]}
#: Whether the model is present after a crash at each point.
SURVIVES = {
    "add.intent": False,
    "add.blob_renamed": False,
    "add.blob_placed": False,
    "add.committed": True,
    "rm.row_deleted": False,
    "rm.blob_removed": False,
}


def _die_during(daemon: DaemonProcess, op: str, **args: Any) -> None:
    """Send an admin request the daemon dies in; wait for its exit by SIGKILL."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(120)
        s.connect(str(daemon.admin_socket))
        send_frame(s, {"id": 1, "op": op, "args": args})
        with pytest.raises(ConnectionError):
            while True:
                message, fds = recv_frame(s)
                for fd in fds:
                    os.close(fd)
                assert "progress" in message, f"the daemon answered instead of dying: {message}"
    proc = daemon._proc
    assert proc is not None
    assert proc.wait(120) == -9
    daemon.kill()
    point = daemon.options.pop("crash_point")
    assert f"crash point {point} reached" in daemon.log.read_text()


def _store_files(daemon: DaemonProcess) -> tuple[list[str], list[str]]:
    disk = daemon.store_dir / "disk"
    blobs = sorted(p.name for p in (disk / "blobs").iterdir())
    temps = sorted(p.name for p in (disk / "tmp").iterdir())
    return blobs, temps


def _check_invariant(daemon: DaemonProcess, source: Path, present: bool) -> None:
    with RawClient(daemon.admin_socket) as admin:
        if not present:
            with pytest.raises(NotFound):
                admin.call("info", name="m")
            assert admin.result("list")["models"] == []
            assert _store_files(daemon) == ([], [])
        else:
            model = admin.result("info", name="m")["model"]
            assert model["source"] == str(source) and model["access"] == ACCESS
            digest = model["digest"]
            assert _store_files(daemon) == ([digest, f"{digest}.json"], [])
            for tier in ("disk", "cpu"):
                result, mapping = admin.acquire_map("m", tier=tier)
                try:
                    assert np.array_equal(np.frombuffer(mapping, np.float32, 4096), W)
                finally:
                    mapping.close()
                admin.result("release", lease=result["lease"])
    [listed, acquired] = as_nobody(daemon.socket, [("list", {}), ("acquire", {"name": "m"})])
    assert listed["result"]["models"] == []
    assert acquired["error"]["code"] == NotFound.code


@pytest.mark.parametrize("point", ADD_POINTS + REMOVE_POINTS)
def test_a_crash_at_any_step_leaves_the_model_absent_or_complete(
    shared_daemon: Callable[..., DaemonProcess], tmp_path: Path, point: str
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": W}, str(source))
    daemon = shared_daemon(socket_mode="666", crash_point=point)
    if point in REMOVE_POINTS:
        with RawClient(daemon.admin_socket) as admin:
            admin.result("add", name="m", source=str(source), access=ACCESS)
        _die_during(daemon, "remove", name="m")
    else:
        _die_during(daemon, "add", name="m", source=str(source), access=ACCESS)
    daemon.start()
    _check_invariant(daemon, source, SURVIVES[point])
    if not SURVIVES[point]:
        with RawClient(daemon.admin_socket) as admin:
            admin.result("add", name="m", source=str(source), access=ACCESS)
        _check_invariant(daemon, source, True)


def test_a_blob_of_a_changed_source_is_deleted_and_never_served(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": W}, str(source))
    daemon = start_daemon()
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="m", source=str(source), access=ACCESS)
        assert admin.result("evict", name="m", tier="disk")["evicted"] == ["disk"]
        save_file({"w": W + 1}, str(source))
        with pytest.raises(CorruptModel, match="source of m:1 changed"):
            admin.call("acquire", name="m", tier="disk")
        assert _store_files(daemon) == ([], [])
        assert admin.result("remove", name="m")["removed"] == ["m:1"]
    daemon.restart()
    with RawClient(daemon.admin_socket) as admin:
        assert admin.result("list")["models"] == []
        with pytest.raises(NotFound):
            admin.call("acquire", name="m")
    assert _store_files(daemon) == ([], [])
    assert "registered from the disk tier" not in daemon.log.read_text()


def test_recovery_deletes_a_blob_no_committed_entry_names(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A blob in the disk tier with a valid manifest but no catalog row (what an old daemon
    registered as an open model) is deleted at start, with its digest in the log."""
    from tests.fixtures.store import layout_bytes
    from trims.daemon.tiers.disk import DiskTier

    daemon = start_daemon()
    daemon.stop()
    manifest, data = layout_bytes("planted", {"w": W})
    disk = DiskTier(daemon.store_dir / "disk", 1 << 30)
    temp = disk.new_temp()
    temp.write_bytes(data)
    disk.commit(temp, manifest)
    daemon.start()
    with RawClient(daemon.socket) as client:
        assert client.result("list")["models"] == []
        with pytest.raises(NotFound):
            client.call("acquire", name="planted")
    assert _store_files(daemon) == ([], [])
    log = daemon.log.read_text()
    assert f"layout {manifest.digest} deleted from the disk tier: no committed catalog" in log
