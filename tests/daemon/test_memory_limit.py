"""The daemon's CPU tier fits the memory it really has: its cgroup's limit, else the machine's.

The sizing rule from settings (half the limit by default; a configured budget above the limit
less the daemon's reserve is lowered to that, with one warning), then a real daemon started
inside a real memory cgroup (tests/fixtures/cgroup.py): its budget, its log and its
``trims_daemon_memory_*`` gauges.
"""

from __future__ import annotations

import argparse
import logging
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.cgroup import MemoryCgroups, memory_cgroups
from trims import daemon_process
from trims.cgroup import MemoryCgroup, memory_cgroup
from trims.daemon.cli import build_settings, configure
from trims.daemon.settings import DAEMON_MEMORY_RESERVE, cpu_budget_ceiling

MiB = 1 << 20
GiB = 1 << 30


def _settings_within(limit: int | None, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    configure(parser)
    memory = MemoryCgroup(limit, None, None, None, 1 if limit else None, "/job")
    settings, _, _ = build_settings(parser.parse_args(list(argv)), {}, memory=memory)
    return settings.budgets.cpu


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_default_cpu_budget_is_half_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="trims.daemon.cli")
    assert _settings_within(2 * GiB) == GiB
    assert "cpu tier budget 1.0 GiB: 50% of the 2.0 GiB this daemon may use" in caplog.text
    assert _settings_within(512 * MiB) == 256 * MiB
    assert not _warnings(caplog)


def test_configured_budget_above_the_limit_is_clamped_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _settings_within(2 * GiB, "--cpu-budget", "4GiB") == 2 * GiB - DAEMON_MEMORY_RESERVE
    (warning,) = _warnings(caplog)
    assert "--cpu-budget 4.0 GiB is more than this daemon may use" in warning
    assert "memory limit is 2.0 GiB" in warning and "using 1.8 GiB" in warning
    caplog.clear()
    # below the ceiling, the operator's choice stands, above the default share too
    assert _settings_within(2 * GiB, "--cpu-budget", "1.5GiB") == int(1.5 * GiB)
    assert _settings_within(2 * GiB, "--cpu-budget", "0") == 0
    assert not _warnings(caplog)


def test_small_limits_keep_a_quarter_for_the_daemon() -> None:
    assert cpu_budget_ceiling(512 * MiB) == 384 * MiB
    assert cpu_budget_ceiling(8 * GiB) == 8 * GiB - DAEMON_MEMORY_RESERVE


def test_unknown_limit_keeps_the_fallback_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    assert _settings_within(None) == 8 * GiB
    assert _settings_within(None, "--cpu-budget", "100GiB") == 100 * GiB
    assert all("cannot read this daemon's memory limit" in w for w in _warnings(caplog))


def test_without_a_cgroup_limit_the_default_follows_the_machine() -> None:
    """This process's own view (no limit of ours here: MemTotal, or the machine's cgroup)."""
    parser = argparse.ArgumentParser()
    configure(parser)
    settings, _, _ = build_settings(parser.parse_args([]), {})
    limit = memory_cgroup().limit_bytes
    assert limit is not None and settings.budgets.cpu == limit // 2


# A real daemon inside a real memory cgroup.


@pytest.fixture
def cgroups() -> Iterator[MemoryCgroups]:
    with memory_cgroups(1) as made:
        yield made


@pytest.fixture
def daemon_in_cgroup(
    cgroups: MemoryCgroups, tmp_path: Path
) -> Iterator[Callable[..., daemon_process.Started]]:
    """Factory: ``daemon_in_cgroup(limit, **options)`` -> a ready `trims daemon` that runs in
    a new memory cgroup of ``limit`` bytes from its first instruction; stopped at teardown,
    before the cgroups go."""
    started: list[daemon_process.Started] = []

    def start(limit: int, **options: object) -> daemon_process.Started:
        cgroup = cgroups.make(limit=limit)
        root = tmp_path / f"daemon{len(started)}"
        socket = root / "run" / "store.sock"
        socket.parent.mkdir(parents=True)
        argv = daemon_process.daemon_command(socket, store_dir=root / "store", options=options)
        daemon = daemon_process.launch(
            cgroups.command(cgroup, argv),
            root / "daemon.log",
            daemon_process.DAEMON_READY,
            env=daemon_process.without_trims_env(),
            name="the store daemon",
        )
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


def _cpu_budget(daemon: daemon_process.Started) -> int:
    with RawClient(Path(daemon.match["socket"])) as client:
        return int(client.result("stats")["tiers"]["cpu"]["budget"])


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        lines = response.read().decode().splitlines()
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))
    }


def test_daemon_in_a_cgroup_sizes_its_budget_and_reports_the_limit(
    daemon_in_cgroup: Callable[..., daemon_process.Started],
) -> None:
    daemon = daemon_in_cgroup(512 * MiB, metrics_address="127.0.0.1:0")
    assert _cpu_budget(daemon) == 256 * MiB
    log = daemon.log.read_text()
    assert "cpu tier budget 256.0 MiB: 50% of the 512.0 MiB this daemon may use" in log
    assert daemon.metrics_url is not None
    m = _scrape(daemon.metrics_url)
    assert m["trims_daemon_memory_limit_bytes"] == 512 * MiB
    # the daemon's interpreter at least, and never past the limit
    assert 16 * MiB < m["trims_daemon_memory_usage_bytes"] <= 512 * MiB
    assert m['trims_tier_bytes_budget{tier="cpu"}'] == 256 * MiB


def test_daemon_in_a_cgroup_clamps_a_budget_above_its_limit(
    daemon_in_cgroup: Callable[..., daemon_process.Started],
) -> None:
    daemon = daemon_in_cgroup(512 * MiB, cpu_budget="1GiB")
    assert _cpu_budget(daemon) == 384 * MiB
    warnings = [line for line in daemon.log.read_text().splitlines() if " WARNING " in line]
    assert len(warnings) == 1, warnings
    assert "--cpu-budget 1.0 GiB is more than this daemon may use" in warnings[0]
    assert "memory limit is 512.0 MiB" in warnings[0] and "using 384.0 MiB" in warnings[0]
