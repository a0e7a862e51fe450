"""Suite-wide fixtures: the leak check, and the shared fixture plugins in tests/fixtures/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.store",
    "tests.fixtures.runtime",
    "tests.fixtures.unprivileged",
    "tests.fixtures.otlp",
    "tests.fixtures.postgres",
    "tests.fixtures.docker",
    "tests.fixtures.kube_api",
    "tests.fixtures.gateway",
    "tests.fixtures.cloud",
    "tests.fixtures.blockdev",
]


def _children(pid: int) -> set[int]:
    """Live (non-zombie) child processes of ``pid``, from /proc."""
    out: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
        if ppid == pid and state != "Z":
            out.add(int(entry.name))
    return out


def _memfds() -> set[str]:
    """Our own open descriptors that point at memfds."""
    out: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:"):
            out.add(f"{fd}->{target}")
    return out


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


@pytest.fixture(autouse=True)
def leak_check(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves child processes, memfds or /dev/shm entries behind.

    Modelled on PyTorch's leak checker. Fixtures of wider scope (a daemon shared by a module)
    started before the snapshot and are not counted. Mark a test ``no_leak_check`` to opt out
    with a reason in its docstring.
    """
    if request.node.get_closest_marker("no_leak_check"):
        yield
        return
    before = (_children(os.getpid()), _memfds(), _shm())
    yield
    import gc
    import time

    deadline = time.monotonic() + 5.0
    while True:
        gc.collect()
        after = (_children(os.getpid()), _memfds(), _shm())
        leaked = [a - b for a, b in zip(after, before, strict=True)]
        if not any(leaked) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    procs, fds, shm = leaked
    assert not procs, f"test left child processes running: {sorted(procs)}"
    assert not fds, f"test left memfd descriptors open: {sorted(fds)}"
    assert not shm, f"test left /dev/shm entries: {sorted(shm)}"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "no_leak_check: skip the leak check (say why)")
