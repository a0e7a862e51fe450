"""The store scrub (`verify`) reads the device: rot under a served, cached model is found."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.blockdev import LoopExt4
from tests.fixtures.store import DaemonProcess, seed_layout
from trims.errors import CorruptModel, NotFound

MODEL = {"w": np.arange(1 << 20, dtype=np.float32)}


def test_a_scrub_finds_rot_beneath_a_served_model_and_keeps_serving_its_mappings(
    loop_ext4: LoopExt4,
) -> None:
    root = loop_ext4.mount / "daemon"
    root.mkdir()
    daemon = DaemonProcess(root, {"disk_budget": "32MiB"})
    manifest = seed_layout(daemon.store_dir, "m", MODEL)
    seed_layout(daemon.store_dir, "other", {"w": np.ones(1024, np.float32)})
    daemon.start()
    try:
        with RawClient(daemon.socket) as client:
            held, mapping = client.acquire_map("m")  # loaded: its bytes are cached now
            tensor = manifest.tensors[0]
            served = np.frombuffer(mapping, np.float32, tensor.nbytes // 4, tensor.offset)
            assert np.array_equal(served, MODEL["w"])
            with RawClient(daemon.admin_socket) as admin:
                states = {e["models"][0]: e["state"] for e in admin.result("verify")["verified"]}
                assert states == {"m:1": "ok", "other:1": "ok"}
                blob = daemon.store_dir / "disk" / "blobs" / manifest.digest
                loop_ext4.rot(blob, tensor.offset + tensor.nbytes // 2)
                verified = {e["models"][0]: e for e in admin.result("verify")["verified"]}
            assert verified["other:1"]["state"] == "ok"
            assert verified["m:1"]["state"] == "damaged"
            assert "damaged" in verified["m:1"]["error"]
            assert not blob.exists()
            # the instance that holds it keeps the bytes it was handed
            assert np.array_equal(served, MODEL["w"])
            del served
            mapping.close()
            client.result("release", lease=held["lease"])
            with pytest.raises((NotFound, CorruptModel), match="m:1 has no disk copy"):
                client.call("acquire", name="m")  # its only copy was damaged: not served
            _, fds = client.call("acquire", name="other")
            os.close(fds[0])
    finally:
        daemon.stop()
