"""Bad input gets a clear error, closes at most the offending connection, and harms no one else."""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess, seed_layout
from trims.errors import (
    CorruptModel,
    NotFound,
    PermissionDenied,
    ValidationError,
)
from trims.protocol import HEADER, MAGIC, MAX_FRAME, PROTOCOL_VERSION, recv_frame, send_frame

W = np.arange(1024, dtype=np.float32)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the module: every test here leaves it as it found it."""
    root = tmp_path_factory.mktemp("bad-input")
    shared = DaemonProcess(root, {})
    seed_layout(shared.store_dir, "tiny", {"w": W})
    yield shared.start()
    shared.stop()


def _raw_exchange(path: Path, data: bytes) -> tuple[dict[str, Any] | None, bool]:
    """Send raw bytes; return the reply (if any) and whether the daemon then closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(path))
        s.sendall(data)
        try:
            reply, fds = recv_frame(s)
        except ConnectionError:
            return None, True
        for fd in fds:
            os.close(fd)
        try:
            closed = s.recv(1) == b""
        except TimeoutError:
            closed = False
        return reply, closed


def _frame(payload: bytes, magic: bytes = MAGIC, version: int = PROTOCOL_VERSION) -> bytes:
    return HEADER.pack(magic, version, 0, 0, len(payload)) + payload


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="garbage"),
        pytest.param(_frame(b"{}", magic=b"NOPE"), id="wrong-magic"),
        pytest.param(_frame(b"{}", version=99), id="wrong-version"),
        pytest.param(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 0, MAX_FRAME + 1), id="huge-length"),
        pytest.param(HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, 999, 2) + b"{}", id="many-fds"),
        pytest.param(_frame(b"\xff\xfe not json"), id="not-json"),
        pytest.param(_frame(b"[1, 2]"), id="not-an-object"),
        pytest.param(_frame(b'{"id": 1, "args": ' + b"[" * 5000 + b"}"), id="nested"),
        pytest.param(_frame(b'{"id": ' + b"7" * 5000 + b"}"), id="5000-digits"),
        pytest.param(_frame(b'{"id": 1, "op": "hello", "x": NaN}'), id="nan"),
    ],
)
def test_malformed_frames_close_only_that_connection(daemon: DaemonProcess, data: bytes) -> None:
    with RawClient(daemon.socket) as bystander:
        result, lease_fds = bystander.call("acquire", name="tiny")
        for fd in lease_fds:
            os.close(fd)
        reply, closed = _raw_exchange(daemon.socket, data)
        assert reply is not None and reply["ok"] is False
        assert reply["error"]["code"] == "protocol"
        assert closed
        assert bystander.result("stats")["leases"] == 1
        bystander.result("release", lease=result["lease"])


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        ({"id": 1, "op": "fly"}, "unknown operation"),
        ({"id": 1, "op": 7}, "unknown operation"),
        ({"id": "x", "op": "hello"}, "'id' must be an integer"),
        ({"id": 1, "op": "acquire", "args": []}, "must be a JSON object"),
        ({"id": 1, "op": "acquire", "args": {}}, "'name' is required"),
        ({"id": 1, "op": "acquire", "args": {"name": 5}}, "invalid model name"),
        ({"id": 1, "op": "acquire", "args": {"name": "../x"}}, "invalid model name"),
        ({"id": 1, "op": "acquire", "args": {"name": "a/../../etc"}}, "invalid model name"),
        ({"id": 1, "op": "acquire", "args": {"name": "tiny", "version": ["1"]}}, "version"),
        ({"id": 1, "op": "acquire", "args": {"name": "tiny", "tier": "tape"}}, "'tier'"),
        ({"id": 1, "op": "acquire", "args": {"name": "tiny", "digest": "zz"}}, "digest"),
        ({"id": 1, "op": "release", "args": {"lease": 3}}, "'lease'"),
    ],
)
def test_bad_requests_get_validation_errors_and_the_connection_stays(
    daemon: DaemonProcess, request_: dict[str, Any], error: str
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(str(daemon.socket))
        send_frame(s, request_)
        reply, _ = recv_frame(s)
        assert reply["ok"] is False and reply["error"]["code"] == "invalid"
        assert error in reply["error"]["message"]
        send_frame(s, {"id": 2, "op": "hello", "args": {}})
        assert recv_frame(s)[0]["ok"] is True


def test_unknown_model_and_lease(daemon: DaemonProcess) -> None:
    with RawClient(daemon.socket) as client:
        with pytest.raises(NotFound, match="nothere"):
            client.call("acquire", name="nothere")
        with pytest.raises(NotFound):
            client.call("release", lease="0" * 32)


def test_leases_cannot_be_released_by_another_connection(daemon: DaemonProcess) -> None:
    with RawClient(daemon.socket) as owner, RawClient(daemon.socket) as thief:
        result, fds = owner.call("acquire", name="tiny")
        os.close(fds[0])
        with pytest.raises(NotFound):
            thief.call("release", lease=result["lease"])
        owner.result("release", lease=result["lease"])


@pytest.mark.parametrize("op", ["add", "remove", "evict", "pin", "unpin", "load"])
def test_admin_ops_are_denied_on_the_store_socket(daemon: DaemonProcess, op: str) -> None:
    with RawClient(daemon.socket) as client:
        with pytest.raises(PermissionDenied, match=r"admin socket store\.admin\.sock"):
            client.call(op, name="tiny", source="/etc/passwd")
        assert client.result("hello")["admin"] is False
    assert oct(daemon.socket.stat().st_mode & 0o777) == "0o660"
    assert oct(daemon.admin_socket.stat().st_mode & 0o777) == "0o600"


def test_clients_never_learn_host_paths(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    daemon = start_daemon()
    source = tmp_path / "secret-dir" / "m.safetensors"
    source.parent.mkdir()
    save_file({"w": W}, str(source))
    with RawClient(daemon.admin_socket) as admin:
        assert admin.result("add", name="m", source=str(source))["model"]["source"] == str(source)
    with RawClient(daemon.socket) as client:
        replies = [client.result("info", name="m"), client.result("list"), client.result("stats")]
        result, fds = client.call("acquire", name="m")
        os.close(fds[0])
        replies.append(result)
    text = json.dumps(replies)
    assert "secret-dir" not in text and str(daemon.store_dir) not in text


def test_access_list_denies_other_uids(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    from safetensors.numpy import save_file

    daemon = start_daemon()
    source = tmp_path / "m.safetensors"
    save_file({"w": W}, str(source))
    me = os.getuid()
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="mine", source=str(source), access={"uids": [me]})
        admin.result("add", name="theirs", source=str(source), access={"uids": [me + 4242]})
        with pytest.raises(ValidationError, match="access"):
            admin.result("add", name="bad", source=str(source), access={"uids": ["root"]})
    with RawClient(daemon.socket) as client:
        _, fds = client.call("acquire", name="mine")
        os.close(fds[0])
        with pytest.raises(NotFound, match="model theirs is not in the store"):
            client.call("acquire", name="theirs")
        assert client.result("stats")["leases"] == 1


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_disk_copy_is_refused_as_corrupt(
    start_daemon: Callable[..., DaemonProcess], damage: str
) -> None:
    daemon = start_daemon(models={"tiny": {"w": W}, "ok": {"w": W + 1}})
    digest = daemon.request("info", name="tiny")["result"]["model"]["digest"]
    blob = daemon.store_dir / "disk" / "blobs" / digest
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        if damage == "flip":
            f.seek(100)
            f.write(b"\x01")
        else:
            f.truncate(1000)
    with RawClient(daemon.socket) as client:
        with pytest.raises(CorruptModel, match="add it again"):
            client.call("acquire", name="tiny", tier="cpu")
        assert not blob.exists()
        with pytest.raises(NotFound, match="add it again"):
            client.call("acquire", name="tiny", tier="disk")
        _, fds = client.call("acquire", name="ok")
        os.close(fds[0])
        assert client.result("stats")["tiers"]["cpu"]["models"] == 1


def test_many_connections_and_a_silent_one_do_not_block_others(daemon: DaemonProcess) -> None:
    idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(50)]
    try:
        for s in idle:
            s.connect(str(daemon.socket))
        idle[0].sendall(struct.pack("!4s", MAGIC))
        with RawClient(daemon.socket) as client:
            assert client.result("stats")["clients"] >= 51
    finally:
        for s in idle:
            s.close()
