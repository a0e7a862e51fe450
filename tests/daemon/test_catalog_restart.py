"""The catalog persists: a restarted daemon serves what is on disk without the source."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.errors import AlreadyExists, NotFound, ValidationError

W = np.arange(4096, dtype=np.float32)


def test_restart_serves_added_models_without_their_source(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": W}, str(source))
    daemon = start_daemon()
    with RawClient(daemon.admin_socket) as admin:
        added = admin.result(
            "add", name="m", version="2", source=str(source), access={"gids": [os.getgid()]}
        )["model"]
        stages = {p["stage"] for p in admin.progress}
        assert stages and stages <= {"download", "convert", "verify", "load"}, admin.progress
        with pytest.raises(AlreadyExists):
            admin.result("add", name="m", version="2", source=str(source))
        admin.result("pin", name="m", tier="cpu")
    source.unlink()
    (daemon.store_dir / "disk" / "tmp" / "left-over.part").write_bytes(b"half")
    daemon.restart()
    assert not (daemon.store_dir / "disk" / "tmp" / "left-over.part").exists()
    with RawClient(daemon.socket) as client:
        info = client.result("info", name="m")["model"]
        assert info["digest"] == added["digest"] and info["version"] == "2"
        assert info["pins"] == ["cpu"]
        result, mapping = client.acquire_map("m")
        entry = result["manifest"]["tensors"][0]
        assert np.array_equal(np.frombuffer(mapping, np.float32, 4096, entry["offset"]), W)
        mapping.close()
        assert client.result("stats")["tiers"]["disk"]["loads"] == 0


def test_remove_keeps_leased_memory_until_the_last_lease_ends(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models={"m": {"w": W}})
    with RawClient(daemon.socket) as client, RawClient(daemon.admin_socket) as admin:
        result, mapping = client.acquire_map("m")
        with pytest.raises(ValidationError, match="live lease"):
            admin.result("remove", name="m")
        assert admin.result("remove", name="m", force=True)["removed"] == ["m:1"]
        with pytest.raises(NotFound):
            client.call("acquire", name="m")
        stats = client.result("stats")["tiers"]
        assert stats["cpu"]["models"] == 1 and stats["disk"]["models"] == 0
        assert np.frombuffer(mapping, np.float32, 4096)[5] == 5.0
        client.result("release", lease=result["lease"])
        assert client.result("stats")["tiers"]["cpu"]["models"] == 0
        assert np.frombuffer(mapping, np.float32, 4096)[5] == 5.0
        mapping.close()


def test_a_model_evicted_from_disk_is_fetched_again_from_its_source(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    source = tmp_path / "m.safetensors"
    save_file({"w": W}, str(source))
    daemon = start_daemon()
    with RawClient(daemon.admin_socket) as admin:
        admin.result("add", name="m", source=str(source))
        assert admin.result("evict", name="m", tier="disk")["evicted"] == ["disk"]
        assert admin.result("info", name="m")["model"]["tiers"] == []
        admin.progress.clear()
        admin.result("load", name="m", tier="cpu")
        assert {"load", "verify"} <= {p["stage"] for p in admin.progress}
        assert admin.progress[-1] == {"stage": "verify", "done": 16384, "total": 16384}
        stats = admin.result("stats")["tiers"]
        assert stats["disk"]["loads"] == 1 and stats["cpu"]["loads"] == 1
