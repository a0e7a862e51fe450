"""The daemon's CPU tier fits the memory it really has: its cgroup's limit, else the machine's.

The sizing rule from settings (half the limit by default; a configured budget above the limit
less the daemon's reserve is lowered to that, with one warning), then a real daemon started
inside a real memory cgroup (tests/fixtures/cgroup.py): its budget, its log and its
``trims_daemon_memory_*`` gauges, and how it gives memory back when the cgroup's other
processes need it (Note [memory pressure] in trims.daemon.pressure; the policy's cases are in
test_memory_pressure.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from tests.daemon.holders import Holder
from tests.daemon.rawclient import RawClient
from tests.fixtures.cgroup import Cgroup, MemoryCgroups, memory_cgroups
from tests.fixtures.gateway import wait_until
from tests.fixtures.store import seed_layout
from trims import daemon_process
from trims.cgroup import MemoryCgroup, find_memory_cgroup, memory_cgroup
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
    """Factory: ``daemon_in_cgroup(limit, models=None, **options)`` -> a ready `trims daemon`
    that runs in a new memory cgroup of ``limit`` bytes from its first instruction; stopped at
    teardown, before the cgroups go. ``models`` (name: tensors) are seeded into its store
    first and their blobs dropped from the page cache, so the daemon's own reads charge its
    cgroup, as for models it added itself."""
    started: list[daemon_process.Started] = []

    def start(
        limit: int, models: Mapping[str, Mapping[str, np.ndarray]] | None = None, **options: object
    ) -> daemon_process.Started:
        cgroup = cgroups.make(limit=limit)
        root = tmp_path / f"daemon{len(started)}"
        socket = root / "run" / "store.sock"
        socket.parent.mkdir(parents=True)
        for name, tensors in (models or {}).items():
            seed_layout(root / "store", name, tensors)
        for blob in (root / "store" / "disk").rglob("*"):
            if blob.is_file():
                fd = os.open(blob, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
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


#: A process of the daemon's cgroup that takes memory: argv[1] bytes, written, held until its
#: stdin closes (an instance's interpreter, framework and activations).
_BALLAST = "import sys; b = b'\\1' * int(sys.argv[1]); print('ready', flush=True); sys.stdin.read()"


def _in_cpu(daemon: daemon_process.Started) -> set[str]:
    with RawClient(Path(daemon.match["socket"])) as client:
        models = client.result("list")["models"]
    return {m["name"] for m in models if "cpu" in m["tiers"]}


@pytest.mark.parametrize("backing", ["memfd", "file"])
def test_under_memory_pressure_unleased_models_move_to_disk_and_leased_ones_stay(
    daemon_in_cgroup: Callable[..., daemon_process.Started], cgroups: MemoryCgroups, backing: str
) -> None:
    """512 MiB shared by the daemon (four 48 MiB models in its cpu tier, one leased by a
    client outside the cgroup) and another process that takes the cgroup past 90%: the
    least recently used unleased models leave memory until it is under 80%, the leased one
    stays and its client reads it, a demoted one is served again, and nothing is OOM-killed."""
    limit, size = 512 * MiB, 48 * MiB
    models = {
        f"m{i}": {"w": np.full(16, i, np.float32), "pad": np.full(size // 4, i, np.float32)}
        for i in range(4)
    }
    daemon = daemon_in_cgroup(limit, models, cpu_backing=backing, metrics_address="127.0.0.1:0")
    socket = Path(daemon.match["socket"])
    assert daemon.metrics_url is not None
    holder = Holder(socket, "m0")
    ballast: subprocess.Popen[str] | None = None
    try:
        with RawClient(socket) as client:
            for name in ("m1", "m2", "m3"):  # least recently used first
                result, fds = client.call("acquire", name=name)
                for fd in fds:
                    os.close(fd)
                client.result("release", lease=result["lease"])
        assert _in_cpu(daemon) == {"m0", "m1", "m2", "m3"}
        found = find_memory_cgroup(daemon.pid)
        assert found is not None
        before = memory_cgroup(daemon.pid)
        assert before.limit_bytes == limit and before.working_set_bytes is not None
        # the daemon charges its models: the ballast takes the cgroup to 93%
        assert before.working_set_bytes > 4 * size
        take = int(0.93 * limit) - before.working_set_bytes
        ballast = subprocess.Popen(
            cgroups.command(Cgroup(found.directory, found.path), [sys.executable, "-c", _BALLAST,
                                                                  str(take)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert ballast.stdout is not None and ballast.stdout.readline() == "ready\n"

        def relieved() -> bool:
            m = _scrape(str(daemon.metrics_url))
            return (
                m.get('trims_daemon_demotions_total{reason="memory_pressure",tier="cpu"}', 0) > 0
                and m["trims_daemon_memory_pressure"] == 0
            )

        assert wait_until(relieved, timeout_s=30), daemon.log.read_text()[-3000:]
        left = _in_cpu(daemon)
        demoted = [name for name in ("m1", "m2", "m3") if name not in left]
        assert "m0" in left and demoted == ["m1", "m2", "m3"][: len(demoted)]
        after = memory_cgroup(daemon.pid)
        assert after.working_set_bytes is not None and after.working_set_bytes < 0.8 * limit
        assert holder.ask("read")["values"] == [0.0] * 16
        # a demoted model is served again: its acquire loads it back (room under 90% now)
        with RawClient(socket) as client:
            result, mapping = client.acquire_map("m1")
            entry = next(t for t in result["manifest"]["tensors"] if t["name"] == "pad")
            pad = np.frombuffer(mapping, np.float32, entry["nbytes"] // 4, entry["offset"])
            assert (pad == 1).all()
            del pad
            mapping.close()
        assert "m1" in _in_cpu(daemon)
    finally:
        if ballast is not None:
            assert ballast.stdin is not None and ballast.stdout is not None
            ballast.stdin.close()
            ballast.wait(30)
            ballast.stdout.close()
        holder.close()
    final = memory_cgroup(daemon.pid)
    assert final.oom_kills == 0
    assert final.peak_bytes is not None and final.peak_bytes <= limit
