"""The store client against a real `trims daemon` on temp sockets, with real client processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures.store import DaemonProcess
from trims.daemon.tiers.cpu import shmem_huge_pages
from trims.errors import NotFound, PermissionDenied, Unavailable, ValidationError
from trims.runtime.client import StoreClient

safetensors_numpy = pytest.importorskip("safetensors.numpy")

WEIGHTS = {
    "layer.weight": np.arange(64 * 64, dtype=np.float32).reshape(64, 64),
    "layer.bias": np.linspace(-1, 1, 64, dtype=np.float32),
    "steps": np.array([7], dtype=np.int64),
}

#: A second process: acquire, report what it sees, then wait for a line on stdin.
PEER = """
import sys, numpy as np
from trims.runtime.client import StoreClient
with StoreClient(sys.argv[1]) as c, c.acquire("mlp") as lease:
    w = lease.numpy()["layer.weight"]
    inode = next(l.split()[4] for l in open("/proc/self/maps")
                 if "memfd:trims" in l or "/disk/blobs/" in l)
    print(float(w[0, 0]), float(w[1, 1]), inode, flush=True)
    sys.stdin.readline()
"""


def _model_inode() -> str:
    """The inode of the model's mapping: the daemon's memfd or its disk-tier blob."""
    with open("/proc/self/maps") as f:
        return next(
            line.split()[4] for line in f if "memfd:trims" in line or "/disk/blobs/" in line
        )


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.safetensors"
    safetensors_numpy.save_file(WEIGHTS, str(path))
    return path


@pytest.fixture
def client(store_daemon: DaemonProcess, model_file: Path) -> Iterator[StoreClient]:
    with StoreClient(store_daemon.socket) as c:
        c.add("mlp", model_file)
        yield c


def test_acquire_maps_the_model(client: StoreClient) -> None:
    with client.acquire("mlp") as lease:
        # --cpu-backing auto: the disk file for a root daemon without shmem huge pages
        expected = "file" if os.geteuid() == 0 and not shmem_huge_pages() else "memfd"
        assert lease.tier == "cpu" and lease.handle["kind"] == expected
        assert lease.manifest.name == "mlp" and lease.manifest.version == "1"
        views = lease.numpy()
        for name, array in WEIGHTS.items():
            np.testing.assert_array_equal(views[name], array)
        assert client.stats()["leases"] == 1
    assert lease.released
    assert client.stats()["leases"] == 0


def test_the_mapping_is_populated_unless_the_handle_says_not_to(client: StoreClient) -> None:
    with client.acquire("mlp") as lease:
        assert lease.mapping.wait_populated(30)
        if lease.handle.get("populate") is False:
            assert lease.mapping.populated is None  # no thread was started
        else:
            assert lease.mapping.populated in ("populate_read", "touched")


def test_disk_tier_leases_map_the_verified_file(client: StoreClient) -> None:
    with client.acquire("mlp", tier="disk") as lease:
        assert lease.handle["kind"] == "file"
        np.testing.assert_array_equal(lease.numpy()["layer.bias"], WEIGHTS["layer.bias"])


def test_processes_share_pages_and_writes_stay_private(
    client: StoreClient, store_daemon: DaemonProcess
) -> None:
    with client.acquire("mlp") as lease:
        mine = lease.numpy()["layer.weight"]
        mine[0, 0] = -1.0
        peer = subprocess.Popen(
            [sys.executable, "-c", PEER, str(store_daemon.socket)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert peer.stdout is not None and peer.stdin is not None
            first, diagonal, inode = peer.stdout.readline().split()
            peer.stdin.write("\n")
            peer.stdin.flush()
        finally:
            assert peer.wait(30) == 0
        assert float(first) == 0.0, "a write in one process leaked into another"
        assert float(diagonal) == float(WEIGHTS["layer.weight"][1, 1])
        assert mine[0, 0] == -1.0
        assert inode == _model_inode(), "the peer mapped a different copy of the model"


def test_mappings_survive_the_daemon_and_the_client_reconnects(
    client: StoreClient, store_daemon: DaemonProcess
) -> None:
    lease = client.acquire("mlp")
    bias = lease.numpy()["layer.bias"]
    store_daemon.kill()
    np.testing.assert_array_equal(bias, WEIGHTS["layer.bias"])
    with pytest.raises(Unavailable, match=str(store_daemon.socket)):
        client.list()
    lease.release()
    store_daemon.start()
    with client.acquire("mlp") as again:
        np.testing.assert_array_equal(again.numpy()["layer.bias"], WEIGHTS["layer.bias"])
    assert client.stats()["leases"] == 0


def test_errors_are_rebuilt_with_their_class(client: StoreClient) -> None:
    with pytest.raises(NotFound):
        client.acquire("no-such-model")
    with pytest.raises(ValidationError):
        client.acquire("../etc/passwd")
    with pytest.raises(ValidationError, match="tier"):
        client.acquire("mlp", tier="tape")


def test_admin_ops_need_the_admin_socket(store_daemon: DaemonProcess, tmp_path: Path) -> None:
    # A client given only the store socket (as in a container) cannot reach the admin one.
    store_only = tmp_path / "only" / "store.sock"
    store_only.parent.mkdir()
    store_only.symlink_to(store_daemon.socket)
    with StoreClient(store_only) as c:
        assert c.list() == []
        with pytest.raises(Unavailable, match=r"store\.admin\.sock"):
            c.evict("mlp")
    reply = store_daemon.request("evict", name="mlp")
    assert reply["error"]["code"] == PermissionDenied.code


def test_no_daemon_is_unavailable_and_says_what_to_do(tmp_path: Path) -> None:
    with StoreClient(tmp_path / "none.sock") as c, pytest.raises(Unavailable) as info:
        c.acquire("mlp")
    assert "none.sock" in str(info.value) and "trims daemon" in str(info.value)


def test_add_reports_progress(store_daemon: DaemonProcess, model_file: Path) -> None:
    seen: list[tuple[str, int, int | None]] = []
    with StoreClient(store_daemon.socket) as c:
        model = c.add("mlp", model_file, version="2", progress=lambda *a: seen.append(a))
    assert model["version"] == "2" and model["format"] == "safetensors"
    assert seen and seen[-1][1] == seen[-1][2], seen


def test_admin_round_trip(client: StoreClient) -> None:
    assert client.load("mlp")["tiers"] == ["cpu", "disk"]
    assert client.pin("mlp")["pins"] == ["cpu"]
    with pytest.raises(ValidationError, match="pinned"):
        client.evict("mlp", tier="cpu")
    assert client.unpin("mlp")["pins"] == []
    assert client.evict("mlp", tier="cpu") == ["cpu"]
    assert client.info("mlp")["tiers"] == ["disk"]
    assert client.remove("mlp") == ["mlp:1"]
    assert client.list() == []


def test_threads_share_one_client(client: StoreClient) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(5):
                with client.acquire("mlp") as lease:
                    assert lease.numpy()["steps"][0] == 7
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert client.stats()["leases"] == 0


@pytest.mark.gpu
def test_gpu_tier_gives_cuda_tensors(
    start_daemon: Callable[..., DaemonProcess], model_file: Path
) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the GPU-tier import runs on GPU nodes only")
    from trims.runtime.adapters import torch as torch_adapter

    daemon = start_daemon(gpu_budget="1GiB")
    with StoreClient(daemon.socket) as c:
        c.add("mlp", model_file)
        with c.acquire("mlp", tier="gpu") as lease:
            assert lease.handle["kind"] in ("cuda_vmm", "cuda_ipc")
            tensors = torch_adapter.cuda_tensors(lease)
            for name, array in WEIGHTS.items():
                assert tensors[name].is_cuda
                assert torch.equal(tensors[name].cpu(), torch.from_numpy(array))


def test_a_connection_the_daemon_closed_for_idleness_is_replaced(
    start_daemon: Callable[..., DaemonProcess], model_file: Path
) -> None:
    """The daemon closes lease-less idle connections; the client's next call reconnects."""
    import select

    daemon = start_daemon(idle_timeout=0.3)
    with StoreClient(daemon.socket) as c:
        greeting = c.connect()
        sock = c._store.sock
        assert sock is not None
        readable, _, _ = select.select([sock], [], [], 30.0)
        assert readable, "the daemon did not close the idle connection"
        assert c.list() == []
        assert c._store.sock is not sock and c._store.greeting["pid"] == greeting["pid"]
        c.add("mlp", model_file)
        with c.acquire("mlp") as lease:
            # a connection holding a lease is never closed for idleness
            readable, _, _ = select.select([c._store.sock], [], [], 1.0)
            assert not readable
            assert lease.numpy()["steps"][0] == 7


def test_an_adopted_connection_is_greeted_on_first_use_and_replaced_once_closed(
    start_daemon: Callable[..., DaemonProcess], model_file: Path
) -> None:
    """A connection another process made (a pooled worker's zygote) serves the client; one the
    daemon has closed before the first call is dropped and the client connects itself."""
    import select
    import socket

    daemon = start_daemon(idle_timeout=0.3)
    with StoreClient(daemon.socket) as admin:
        admin.add("mlp", model_file)
    handed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handed.connect(str(daemon.socket))
    with StoreClient(daemon.socket) as c:
        c.adopt(handed)
        assert c._store.sock is None  # not greeted yet
        with c.acquire("mlp") as lease:
            assert c._store.sock is handed
            assert lease.numpy()["steps"][0] == 7
    assert handed.fileno() == -1  # closed with the client

    closed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    closed.connect(str(daemon.socket))
    with StoreClient(daemon.socket) as c:
        c.adopt(closed)
        readable, _, _ = select.select([closed], [], [], 30.0)
        assert readable, "the daemon did not close the idle connection"
        assert c.list()[0]["name"] == "mlp"
        assert c._store.sock is not None and c._store.sock is not closed
        assert closed.fileno() == -1
