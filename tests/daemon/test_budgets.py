"""Single-flight loads, byte budgets, eviction policies, pins and resource exhaustion."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.errors import ResourceExhausted, ValidationError


def _page_model(value: int) -> dict[str, np.ndarray]:
    """A model of exactly one page (4096 bytes)."""
    return {"w": np.full(1024, value, np.float32)}


FOUR = {name: _page_model(i) for i, name in enumerate("abcd")}


def _touch(client: RawClient, name: str) -> None:
    result, fds = client.call("acquire", name=name)
    for fd in fds:
        os.close(fd)
    client.result("release", lease=result["lease"])


def _resident(daemon: DaemonProcess) -> set[str]:
    models = daemon.request("list")["result"]["models"]
    return {m["name"] for m in models if "cpu" in m["tiers"]}


def test_32_concurrent_acquires_of_a_cold_model_cause_one_load(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    big = {"big": {"w": np.random.default_rng(0).random(8 << 20, np.float32)}}
    daemon = start_daemon(models=big)
    clients = [RawClient(daemon.socket) for _ in range(32)]
    barrier = threading.Barrier(len(clients))
    leases: list[str] = []
    errors: list[BaseException] = []

    def acquire(client: RawClient) -> None:
        try:
            barrier.wait()
            result, fds = client.call("acquire", name="big")
            for fd in fds:
                os.close(fd)
            leases.append(result["lease"])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=acquire, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert len(set(leases)) == 32
        stats = daemon.request("stats")["result"]
        assert stats["tiers"]["cpu"]["loads"] == 1
        assert stats["leases"] == 32
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize(("policy", "victim"), [("lru", "b"), ("lfu", "c"), ("fifo", "a")])
def test_eviction_policy_chooses_its_victim(
    start_daemon: Callable[..., DaemonProcess], policy: str, victim: str
) -> None:
    daemon = start_daemon(models=FOUR, cpu_budget="12KiB", eviction=policy)
    with RawClient(daemon.socket) as client:
        # loaded a < b < c; uses a=2 b=3 c=1; last used b < c < a
        for name in ("a", "b", "b", "b", "c", "a"):
            _touch(client, name)
        assert _resident(daemon) == {"a", "b", "c"}
        _touch(client, "d")
    assert _resident(daemon) == {"a", "b", "c", "d"} - {victim}
    stats = daemon.request("stats")["result"]["tiers"]["cpu"]
    assert stats["evictions"] == 1 and stats["used"] == 3 * 4096


def test_never_policy_and_leases_and_pins_exhaust_the_budget(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models=FOUR, cpu_budget="8KiB")
    with RawClient(daemon.socket) as client, RawClient(daemon.admin_socket) as admin:
        admin.result("pin", name="a")
        leased, fds = client.call("acquire", name="b")
        os.close(fds[0])
        with pytest.raises(ResourceExhausted) as info:
            client.call("acquire", name="c", strict=True)
        assert "8.0 KiB" in info.value.message and "4.0 KiB" in info.value.message
        assert info.value.details["needed"] == 4096
        assert client.result("hello")["protocol"] == 1
        with pytest.raises(ValidationError, match="pinned"):
            admin.result("evict", name="a", tier="cpu")
        with pytest.raises(ValidationError, match="lease"):
            admin.result("evict", name="b", tier="cpu")
        client.result("release", lease=leased["lease"])
        _touch(client, "c")
        assert _resident(daemon) == {"a", "c"}
        admin.result("unpin", name="a")
        assert admin.result("evict", name="a")["evicted"] == ["cpu"]
        assert _resident(daemon) == {"c"}

    never = start_daemon(models=FOUR, cpu_budget="4KiB", eviction="never")
    with RawClient(never.socket) as client:
        _touch(client, "a")
        with pytest.raises(ResourceExhausted, match="policy never"):
            client.call("acquire", name="b", strict=True)


def test_a_model_larger_than_the_budget_is_refused(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models={"a": {"w": np.zeros(2048, np.float32)}}, cpu_budget="4KiB")
    with RawClient(daemon.socket) as client:
        with pytest.raises(ResourceExhausted):
            client.call("acquire", name="a", strict=True)
        result, fds = client.call("acquire", name="a", tier="disk")
        os.close(fds[0])
        assert result["handle"] == {"kind": "file", "size": 8192}
