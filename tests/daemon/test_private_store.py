"""The store's files are the daemon's alone (Note [private store] in trims.daemon.private).

Finding 6 of issue 41: a store directory that already existed with mode 0755 was used as is,
and ``nobody`` read a restricted model's blob and the catalog straight from the disk while the
socket refused it the model. Each test replays that user against the real daemon.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.rawclient import RawClient, as_nobody
from tests.fixtures.store import DaemonProcess
from tests.fixtures.users import NOBODY, run_as
from trims.errors import NotFound, Unavailable


def _read(paths: list[str]) -> dict[str, str]:
    """Per path: the sha256 of its bytes (a folder: its entries), or the error reading it."""
    seen = {}
    for path in paths:
        try:
            if os.path.isdir(path):
                seen[path] = " ".join(sorted(os.listdir(path)))
            else:
                with open(path, "rb") as f:
                    seen[path] = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            seen[path] = errno.errorcode[e.errno or 0]
    return seen


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_loose_store_dir_is_made_private_so_nobody_cannot_read_a_restricted_blob(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon(socket_mode="666")
    source = tmp_path / "m.safetensors"
    save_file({"w": np.arange(4096, dtype=np.float32)}, str(source))
    with RawClient(daemon.admin_socket) as admin:
        added = admin.result("add", name="secret", source=str(source), access={"uids": [1000]})
    daemon.stop()
    # As an admin's mkdir under umask 022 or a Helm hostPath (DirectoryOrCreate) leaves them,
    # and the files as an older daemon wrote them.
    store = daemon.store_dir
    disk = store / "disk"
    for folder in (store, disk, disk / "blobs", disk / "tmp"):
        folder.chmod(0o755)
    for entry in (disk / "blobs").iterdir():
        entry.chmod(0o444)
    for entry in store.glob("catalog.sqlite*"):
        entry.chmod(0o644)
    daemon.start()

    blob = disk / "blobs" / added["model"]["digest"]
    catalog = store / "catalog.sqlite"
    seen = run_as(NOBODY, lambda: _read([str(blob), str(catalog), str(store)]))
    assert seen == {str(blob): "EACCES", str(catalog): "EACCES", str(store): "EACCES"}
    [reply] = as_nobody(daemon.socket, [("acquire", {"name": "secret"})])
    assert reply["error"]["code"] == NotFound.code
    assert _mode(store) == _mode(disk) == _mode(disk / "blobs") == 0o700
    assert _mode(catalog) == 0o600 and _mode(blob) == 0o400
    log = daemon.log.read_text()
    assert f"folder {store} was reachable by other users" in log
    assert f"file(s) in {disk / 'blobs'} were readable by other users" in log


def test_a_new_store_is_private_from_the_start(store_daemon: DaemonProcess, tmp_path: Path) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": np.ones(16, dtype=np.float32)}, str(source))
    with RawClient(store_daemon.admin_socket) as admin:
        digest = admin.result("add", name="m", source=str(source))["model"]["digest"]
    blobs = store_daemon.store_dir / "disk" / "blobs"
    assert _mode(blobs / digest) == _mode(blobs / f"{digest}.json") == 0o400
    assert _mode(store_daemon.store_dir / "catalog.sqlite") == 0o600
    assert "reachable by other users" not in store_daemon.log.read_text()


@pytest.mark.parametrize(
    ("folder", "complaint"),
    [
        ("store", "is not owned by the daemon's uid"),
        ("run", "can be changed by users other than the daemon's uid"),
    ],
)
def test_a_store_or_socket_folder_made_by_another_user_is_refused(
    start_daemon: Callable[..., DaemonProcess], folder: str, complaint: str
) -> None:
    """nobody makes the folder first (as in a shared /tmp); the daemon must not use it."""

    def squat(daemon: DaemonProcess) -> None:
        daemon.root.chmod(0o1777)
        path = str(daemon.root / folder)
        run_as(NOBODY, lambda: os.mkdir(path, 0o777))

    with pytest.raises(Unavailable, match=complaint) as info:
        start_daemon(prepare=squat)
    assert f"uid {NOBODY}" in info.value.message


def test_the_daemon_log_is_not_readable_by_others(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A log the launcher made under umask 022 is made owner-only by the daemon at start."""

    def loose_log(daemon: DaemonProcess) -> None:
        daemon.log.touch(mode=0o644)
        daemon.log.chmod(0o644)

    daemon = start_daemon(prepare=loose_log)
    assert _mode(daemon.log) == 0o600
    assert run_as(NOBODY, lambda: _read([str(daemon.log)])) == {str(daemon.log): "EACCES"}
    assert f"log file {daemon.log} was readable by other users" in daemon.log.read_text()
    fresh = start_daemon()
    assert _mode(fresh.log) == 0o600
