"""Acquires the cpu tier cannot hold are served from the disk tier (Note [degraded acquires]
in trims.daemon.store), with a real daemon: the bytes, the lease, the metric, the log, strict."""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.errors import ResourceExhausted

#: Three models of one page (4096 bytes) each, every byte of each its own.
PAGES = {name: {"w": np.full(1024, i + 1, np.float32)} for i, name in enumerate("abc")}


def _degraded(daemon: DaemonProcess, reason: str) -> float:
    """trims_daemon_acquires_degraded_total{tier="cpu", reason} as the daemon exports it."""
    assert daemon.metrics_url is not None
    with urllib.request.urlopen(daemon.metrics_url, timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "trims_daemon_acquires_degraded_total" and sample.labels == {
                "tier": "cpu",
                "reason": reason,
            }:
                return sample.value
    return 0.0


def _leases(daemon: DaemonProcess) -> list[tuple[str, str]]:
    """(model:version, tier) of every live lease."""
    table = daemon.request("stats", admin=True)["result"]["lease_table"]
    return sorted((lease["model"], lease["tier"]) for lease in table)


def test_a_cpu_tier_full_of_leased_models_serves_the_disk_file(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models=PAGES, cpu_budget="8KiB", metrics_address="127.0.0.1:0")
    with RawClient(daemon.socket) as holder, RawClient(daemon.socket) as client:
        held = []
        for name in "ab":  # idle instances' leases: nothing in the tier can be evicted
            result, fds = holder.call("acquire", name=name)
            os.close(fds[0])
            held.append(result["lease"])
        result, mapping = client.acquire_map("c")
        try:
            assert result["tier"] == "disk" and result["degraded_from"] == "cpu"
            assert result["handle"]["kind"] == "file"
            assert hashlib.sha256(mapping).hexdigest() == result["manifest"]["digest"]
            assert (np.frombuffer(mapping, np.float32) == 3).all()
        finally:
            mapping.close()
        assert _leases(daemon) == [("a:1", "cpu"), ("b:1", "cpu"), ("c:1", "disk")]
        assert _degraded(daemon, "budget") == 1

        with pytest.raises(ResourceExhausted, match="cannot fit"):
            client.call("acquire", name="c", strict=True)
        assert _degraded(daemon, "budget") == 1

        again, fds = client.call("acquire", name="c")
        os.close(fds[0])
        assert again["tier"] == "disk"
        assert _degraded(daemon, "budget") == 2
        lines = [line for line in daemon.log.read_text().splitlines() if "served from" in line]
        assert len(lines) == 1, "one line per model and minute"
        assert "model c:1 served from the disk tier instead of the cpu tier" in lines[0]

        client.result("release", lease=result["lease"])
        client.result("release", lease=again["lease"])
        assert _leases(daemon) == [("a:1", "cpu"), ("b:1", "cpu")]
        assert "cpu" not in daemon.request("info", name="c")["result"]["model"]["tiers"]

        # once a lease ends the cpu tier holds c again
        holder.result("release", lease=held[0])
        result, fds = client.call("acquire", name="c")
        os.close(fds[0])
        assert result["tier"] == "cpu" and "degraded_from" not in result
        client.result("release", lease=result["lease"])
        holder.result("release", lease=held[1])
    assert _leases(daemon) == []


def test_a_model_larger_than_the_cpu_tier_is_served_from_disk_unless_strict(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    big = {"big": {"w": np.arange(4096, dtype=np.float32)}}
    daemon = start_daemon(models=big, cpu_budget="4KiB", metrics_address="127.0.0.1:0")
    with RawClient(daemon.socket) as client:
        with pytest.raises(ResourceExhausted):
            client.call("acquire", name="big", strict=True)
        result, mapping = client.acquire_map("big")
        try:
            assert (result["tier"], result["degraded_from"]) == ("disk", "cpu")
            assert hashlib.sha256(mapping).hexdigest() == result["manifest"]["digest"]
        finally:
            mapping.close()
        client.result("release", lease=result["lease"])
    assert _degraded(daemon, "budget") == 1
    assert _leases(daemon) == []


def test_a_disabled_cpu_tier_serves_the_disk_file(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(models=PAGES, cpu_budget="0", metrics_address="127.0.0.1:0")
    with RawClient(daemon.socket) as client:
        result, fds = client.call("acquire", name="a")
        os.close(fds[0])
        assert (result["tier"], result["degraded_from"]) == ("disk", "cpu")
        with pytest.raises(ResourceExhausted, match="disabled"):
            client.call("acquire", name="a", strict=True)
        client.result("release", lease=result["lease"])
    assert _degraded(daemon, "disabled") == 1
    assert _leases(daemon) == []


def test_strict_must_be_a_boolean(store_daemon: DaemonProcess) -> None:
    reply = store_daemon.request("acquire", name="a", strict="yes")
    assert reply["error"]["code"] == "invalid"
    assert "'strict' must be true or false" in reply["error"]["message"]
