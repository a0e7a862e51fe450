"""Access lists without leaks, and what a client holding a disk-tier fd can and cannot do.

Other uids are real: a forked child drops to ``nobody`` (with chosen supplementary groups) and
talks to a real daemon whose store socket it can reach (``open_daemon``: a root dir mode 0755,
store socket mode 0666; the admin socket stays 0600).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.rawclient import RawClient, as_nobody
from tests.fixtures.store import DaemonProcess
from trims.errors import CorruptModel, NotFound, ValidationError

#: A group nobody is not in, given to the child as a supplementary group where a test says so.
GROUP = 4242
W = np.arange(4096, dtype=np.float32)


@pytest.fixture
def open_daemon(
    shared_daemon: Callable[..., DaemonProcess],
) -> Callable[..., DaemonProcess]:
    """A daemon whose store socket (mode 0666) every uid can reach."""
    return lambda **options: shared_daemon(socket_mode="666", **options)


def _source(tmp: Path, weights: np.ndarray = W) -> Path:
    path = tmp / "m.safetensors"
    save_file({"w": weights}, str(path))
    return path


def test_list_info_and_acquire_show_only_what_the_caller_may_acquire(
    open_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    daemon = open_daemon()
    source = str(_source(tmp_path))
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="open", source=source)
        admin.result("add", name="mine", source=source, access={"uids": [os.getuid()]})
        admin.result("add", name="grp", source=source, access={"gids": [GROUP]})
        listed = {m["name"]: m["access"] for m in admin.result("list")["models"]}
    assert listed == {
        "grp": {"uids": [], "gids": [GROUP]},
        "mine": {"uids": [os.getuid()], "gids": []},
        "open": {"uids": [], "gids": []},
    }

    requests: list[tuple[str, dict[str, Any]]] = [
        ("list", {}),
        ("info", {"name": "mine"}),
        ("info", {"name": "absent"}),
        ("acquire", {"name": "mine"}),
        ("acquire", {"name": "grp"}),
        ("acquire", {"name": "open"}),
    ]
    outsider = as_nobody(daemon.socket, requests)
    assert [m["name"] for m in outsider[0]["result"]["models"]] == ["open"]
    hidden, absent = outsider[1]["error"], outsider[2]["error"]
    assert hidden["code"] == absent["code"] == NotFound.code
    assert hidden["message"] == absent["message"].replace("absent", "mine")
    assert outsider[3]["error"] == hidden
    assert outsider[4]["error"]["code"] == NotFound.code
    assert outsider[5]["ok"] and outsider[5]["nfds"] == 1
    assert "mine" not in json.dumps(outsider[0]) and "digest" not in json.dumps(outsider[1:5])

    member = as_nobody(daemon.socket, requests, groups=[GROUP])
    assert [m["name"] for m in member[0]["result"]["models"]] == ["grp", "open"]
    assert "access" not in member[0]["result"]["models"][0]
    assert member[1]["error"]["code"] == NotFound.code
    assert member[4]["ok"] and member[4]["nfds"] == 1


@pytest.mark.parametrize(
    ("access", "field"),
    [
        ({"uids": [2**70]}, r"access\.uids\[0\]"),
        ({"gids": [0, 4294967295]}, r"access\.gids\[1\]"),
        ({"uids": [-1]}, r"access\.uids\[0\]"),
        ({"gids": [True]}, r"access\.gids\[0\]"),
    ],
)
def test_ids_are_32_bit_and_the_message_names_the_field(
    store_daemon: DaemonProcess, tmp_path: Path, access: dict[str, list[int]], field: str
) -> None:
    with RawClient(store_daemon.admin_socket) as admin:
        with pytest.raises(ValidationError, match=f"{field} = .* not a valid id"):
            admin.result("add", name="m", source=str(_source(tmp_path)), access=access)
        assert admin.result("list")["models"] == []
        assert list((store_daemon.store_dir / "disk" / "blobs").iterdir()) == []


def test_a_disk_fd_made_writable_and_written_is_detected_before_the_next_hand_out(
    store_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Root can fchmod the read-only fd of a disk acquire and write the blob; the daemon
    notices the changed stamp, re-hashes, deletes the blob and refuses it; the next acquire
    fetches the model again from its source."""
    with RawClient(store_daemon.admin_socket) as admin:
        digest = admin.result("add", name="m", source=str(_source(tmp_path)))["model"]["digest"]
    blob = store_daemon.store_dir / "disk" / "blobs" / digest
    with RawClient(store_daemon.socket) as client:
        result, fds = client.call("acquire", name="m", tier="disk")
        [fd] = fds
        try:
            os.fchmod(fd, 0o644)
            with open(f"/proc/self/fd/{fd}", "r+b") as f:
                f.seek(128)
                f.write(b"\x7f")
        finally:
            os.close(fd)
        client.result("release", lease=result["lease"])
        with pytest.raises(CorruptModel, match="deleted from the disk tier"):
            client.call("acquire", name="m", tier="disk")
        assert not blob.exists()
        result, mapping = client.acquire_map("m", tier="disk")
        try:
            assert np.array_equal(np.frombuffer(mapping, np.float32, 4096), W)
        finally:
            mapping.close()
    assert oct(blob.stat().st_mode & 0o777) == oct(0o400)
