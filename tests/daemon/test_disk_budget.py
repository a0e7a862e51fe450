"""Disk-tier budget: blobs of models with a remote source are evicted by policy and re-fetched."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.errors import ResourceExhausted


class _QuietHandler(SimpleHTTPRequestHandler):
    #: Every path requested, in order (the tests count downloads with it).
    requested: list[str] = []

    def do_GET(self) -> None:
        self.requested.append(self.path)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def model_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An HTTP server on 127.0.0.1 serving a folder of model files."""
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", root
    server.shutdown()
    server.server_close()
    thread.join()


def _on_disk(admin: RawClient) -> set[str]:
    return {m["name"] for m in admin.result("list")["models"] if "disk" in m["tiers"]}


def _touch(client: RawClient, name: str) -> None:
    result, fds = client.call("acquire", name=name, tier="disk")
    os.close(fds[0])
    client.result("release", lease=result["lease"])


def test_remote_blobs_are_evicted_lru_and_fetched_again(
    start_daemon: Callable[..., DaemonProcess],
    model_server: tuple[str, Path],
    tmp_path: Path,
) -> None:
    url, served = model_server
    for i, name in enumerate("abcd"):
        save_file({"w": np.full(1024, i, np.float32)}, str(served / f"{name}.safetensors"))
    local = tmp_path / "local.safetensors"
    save_file({"w": np.full(1024, 9, np.float32)}, str(local))
    daemon = start_daemon(disk_budget="16KiB")
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="local", source=str(local))
        for name in "abc":
            admin.result("add", name=name, source=f"{url}/{name}.safetensors")
        _touch(admin, "a")
        _touch(admin, "c")
        _QuietHandler.requested.clear()
        admin.result("add", name="d", source=f"{url}/d.safetensors")
        assert _on_disk(admin) == {"local", "a", "c", "d"}
        assert _QuietHandler.requested == ["/d.safetensors"], "making room must not re-download"
        _touch(admin, "b")
        assert _on_disk(admin) == {"local", "b", "c", "d"}
        stats = admin.result("stats")["tiers"]["disk"]
        assert stats["evictions"] == 2 and stats["loads"] == 1 and stats["used"] == 16384
        admin.result("pin", name="b", tier="disk")
        admin.result("pin", name="c", tier="disk")
        admin.result("pin", name="d", tier="disk")
        save_file({"w": np.zeros(1024, np.float32)}, str(served / "e.safetensors"))
        with pytest.raises(ResourceExhausted, match="disk"):
            admin.result("add", name="e", source=f"{url}/e.safetensors")
        assert _on_disk(admin) == {"local", "b", "c", "d"}
        assert not any((daemon.store_dir / "disk" / "tmp").iterdir())
