"""Zero-copy sharing through the real daemon: one copy (a sealed memfd, or the verified disk file
in the page cache), many MAP_PRIVATE mappings."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable

import numpy as np
import pytest

from tests.daemon.holders import Holder
from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess

W = np.arange(16, dtype=np.float32)
MODELS = {"tiny": {"w": W, "b": np.ones(3, np.int64)}}


@pytest.mark.parametrize("backing", ["memfd", "file"])
def test_two_processes_map_the_same_copy(
    start_daemon: Callable[..., DaemonProcess], backing: str
) -> None:
    daemon = start_daemon(models=MODELS, cpu_backing=backing)
    with Holder(daemon.socket, "tiny") as a, Holder(daemon.socket, "tiny") as b:
        assert a.started["values"] == b.started["values"] == W.tolist()
        maps_a, maps_b = a.ask("maps"), b.ask("maps")
        assert len(maps_a["inodes"]) == 1 and maps_a["inodes"] == maps_b["inodes"]
        assert maps_a["shared_kb"] >= 4 and maps_b["shared_kb"] >= 4
        stats = daemon.request("stats")["result"]
        assert stats["leases"] == 2
        assert stats["tiers"]["cpu"]["loads"] == 1 and stats["tiers"]["cpu"]["models"] == 1


def test_writes_are_private_and_the_memfd_is_sealed(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models=MODELS, cpu_backing="memfd")
    with Holder(daemon.socket, "tiny") as writer, Holder(daemon.socket, "tiny") as reader:
        assert writer.ask("write 7")["values"] == [7.0] * len(W)
        assert reader.ask("read")["values"] == W.tolist()
        with Holder(daemon.socket, "tiny") as late:
            assert late.started["values"] == W.tolist()
    with RawClient(daemon.socket) as client:
        result, fds = client.call("acquire", name="tiny")
        fd = fds[0]
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            for seal in (fcntl.F_SEAL_WRITE, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SHRINK):
                assert seals & seal
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            assert os.fstat(fd).st_size == result["handle"]["size"]
        finally:
            os.close(fd)


def test_kill_9_of_a_client_ends_its_leases(start_daemon: Callable[..., DaemonProcess]) -> None:
    daemon = start_daemon(models=MODELS)
    with Holder(daemon.socket, "tiny") as holder, RawClient(daemon.socket) as other:
        assert other.result("stats")["leases"] == 1
        holder.kill()
        while other.result("stats")["leases"]:
            pass
        assert other.result("hello")["protocol"] == 1


def test_clients_outlive_a_killed_daemon_and_a_restart_recovers(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models=MODELS)
    with Holder(daemon.socket, "tiny") as holder:
        holder.ask("write 3")
        daemon.kill()
        assert holder.ask("read")["values"] == [3.0] * len(W)
        daemon.start()
        assert holder.ask("read")["values"] == [3.0] * len(W)
        with Holder(daemon.socket, "tiny") as fresh:
            assert fresh.started["values"] == W.tolist()
    models = daemon.request("list")["result"]["models"]
    assert [m["name"] for m in models] == ["tiny"]
    assert "source" not in models[0]


def test_a_lease_names_the_process_that_acquired_it_on_a_passed_on_connection(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """A connection made by one process and used by another (the zygote's hand-over to a
    pooled worker) lists the acquiring process (Note [request sender])."""
    daemon = start_daemon(models=MODELS)
    with RawClient(daemon.socket) as client, RawClient(daemon.admin_socket) as admin:
        held, fds = client.call("acquire", name="tiny")  # this process: no hand-over
        os.close(fds[0])
        acquired_r, acquired_w = os.pipe()
        looked_r, looked_w = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child only acquires on the inherited socket
            try:
                _, child_fds = client.call("acquire", name="tiny")
                os.close(child_fds[0])
                os.write(acquired_w, b"1")
                os.read(looked_r, 1)  # keep the lease until the parent has looked
            finally:
                os._exit(0)
        try:
            assert os.read(acquired_r, 1) == b"1"
            table = admin.result("stats")["lease_table"]
            by_pid = {row["pid"]: row for row in table}
            assert set(by_pid) == {os.getpid(), child}
            assert by_pid[child]["connected_pid"] == by_pid[os.getpid()]["pid"] == os.getpid()
            assert by_pid[child]["uid"] == os.getuid()
        finally:
            os.write(looked_w, b"1")
            os.waitpid(child, 0)
            for fd in (acquired_r, acquired_w, looked_r, looked_w):
                os.close(fd)
        client.result("release", lease=held["lease"])
