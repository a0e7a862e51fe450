"""trims.cgroup: a process's memory limit, usage, peak and OOM kills, v1 and v2.

Fake cgroup trees under tmp_path for each layout the parser must read, then real cgroups
(tests/fixtures/cgroup.py) with a real child process inside, which reports what it sees.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.cgroup import Cgroup, MemoryCgroups, memory_cgroups
from trims.cgroup import MemoryCgroup, find_memory_cgroup, memory_cgroup

MiB = 1 << 20
GiB = 1 << 30
#: MemTotal of the fake machines: 16 GiB.
MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1000000 kB\n"
#: What v1 shows for "no limit": LONG_MAX rounded down to a 4 KiB page.
V1_NO_LIMIT = "9223372036854771712"

V1_MOUNTS = (
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
V2_MOUNTS = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def fake_tree(
    root: Path,
    *,
    cgroup: str,
    mountinfo: str,
    files: Mapping[str, str],
    meminfo: str | None = MEMINFO,
    pid: str = "self",
) -> Path:
    """A fake / under ``root``: /proc/<pid>/cgroup, /proc/self/mountinfo, /proc/meminfo and
    ``files`` (paths below root: contents)."""
    (root / "proc" / pid).mkdir(parents=True)
    (root / "proc" / pid / "cgroup").write_text(cgroup)
    if pid != "self":
        (root / "proc" / "self").mkdir()
    (root / "proc" / "self" / "mountinfo").write_text(mountinfo)
    if meminfo is not None:
        (root / "proc" / "meminfo").write_text(meminfo)
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v1_files(path: str, limit: str, **extra: str) -> dict[str, str]:
    d = f"/sys/fs/cgroup/memory{path}"
    return {
        f"{d}/memory.limit_in_bytes": limit,
        f"{d}/memory.usage_in_bytes": extra.get("usage", "1000\n"),
        f"{d}/memory.max_usage_in_bytes": extra.get("peak", "2000\n"),
        f"{d}/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill "
        + extra.get("oom", "0")
        + "\n",
    }


def test_v1_limit_usage_peak_and_oom_kills(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        cgroup="9:name=systemd:/\n4:memory:/pods/a\n0::/\n",
        mountinfo=V1_MOUNTS,
        files={
            **v1_files("", V1_NO_LIMIT),
            **v1_files("/pods", V1_NO_LIMIT),
            **v1_files("/pods/a", f"{512 * MiB}\n", usage="4096\n", peak="8192\n", oom="3"),
        },
    )
    assert memory_cgroup(root=root) == MemoryCgroup(
        limit_bytes=512 * MiB,
        usage_bytes=4096,
        peak_bytes=8192,
        oom_kills=3,
        version=1,
        path="/pods/a",
    )


def test_v1_nested_cgroup_without_a_limit_has_its_parents(tmp_path: Path) -> None:
    """v1 shows a child without a limit of its own as LONG_MAX: the parent's limit binds it;
    the smallest of the ancestors' limits wins, wherever it sits."""
    root = fake_tree(
        tmp_path,
        cgroup="4:memory:/outer/middle/inner\n",
        mountinfo=V1_MOUNTS,
        files={
            **v1_files("", V1_NO_LIMIT),
            **v1_files("/outer", f"{2 * GiB}"),
            **v1_files("/outer/middle", f"{768 * MiB}"),
            **v1_files("/outer/middle/inner", V1_NO_LIMIT),
        },
    )
    assert memory_cgroup(root=root).limit_bytes == 768 * MiB


def test_no_limit_anywhere_is_the_machines_memory(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        cgroup="4:memory:/a\n",
        mountinfo=V1_MOUNTS,
        files={**v1_files("", V1_NO_LIMIT), **v1_files("/a", str(1 << 62))},
    )
    got = memory_cgroup(root=root)
    assert got.limit_bytes == 16 * GiB and got.version == 1 and got.usage_bytes == 1000


def test_a_limit_above_the_machines_memory_is_capped_by_memtotal(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path, cgroup="4:memory:/a\n", mountinfo=V1_MOUNTS, files=v1_files("/a", f"{64 * GiB}")
    )
    assert memory_cgroup(root=root).limit_bytes == 16 * GiB


def v2_files(
    path: str, limit: str | None, *, controllers: str = "cpu io memory pids"
) -> dict[str, str]:
    d = f"/sys/fs/cgroup{path}"
    files = {f"{d}/cgroup.controllers": controllers + "\n"}
    if limit is not None:
        files |= {
            f"{d}/memory.max": limit + "\n",
            f"{d}/memory.current": "123456\n",
            f"{d}/memory.events": "low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n",
        }
    return files


def test_v2_max_inherits_the_parents_limit_and_peak_may_be_missing(tmp_path: Path) -> None:
    """The root cgroup has no memory.max; "max" is no limit; memory.peak exists only from
    Linux 5.19 (None here)."""
    root = fake_tree(
        tmp_path,
        cgroup="0::/system.slice/trims.service\n",
        mountinfo=V2_MOUNTS,
        files={
            **v2_files("", None),
            **v2_files("/system.slice", f"{3 * GiB}"),
            **v2_files("/system.slice/trims.service", "max"),
        },
    )
    assert memory_cgroup(root=root) == MemoryCgroup(
        limit_bytes=3 * GiB,
        usage_bytes=123456,
        peak_bytes=None,
        oom_kills=2,
        version=2,
        path="/system.slice/trims.service",
    )


def test_v2_peak_is_read_where_the_kernel_has_it(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        cgroup="0::/a\n",
        mountinfo=V2_MOUNTS,
        files={**v2_files("/a", f"{MiB}"), "/sys/fs/cgroup/a/memory.peak": "999\n"},
    )
    got = memory_cgroup(root=root)
    assert (got.limit_bytes, got.peak_bytes) == (MiB, 999)


def test_working_set_is_usage_less_inactive_file_pages(tmp_path: Path) -> None:
    """v1 counts the cgroup's descendants under ``total_inactive_file`` (its usage counts them
    too), v2 under ``inactive_file``; without memory.stat the working set is the usage."""
    stat_v1 = "inactive_file 1\ntotal_inactive_file 1000\nactive_file 7\n"
    v1 = fake_tree(
        tmp_path / "v1",
        cgroup="4:memory:/a\n",
        mountinfo=V1_MOUNTS,
        files={
            **v1_files("/a", f"{GiB}", usage="4096\n"),
            "/sys/fs/cgroup/memory/a/memory.stat": stat_v1,
        },
    )
    got = memory_cgroup(root=v1)
    assert (got.inactive_file_bytes, got.working_set_bytes) == (1000, 3096)
    v2 = fake_tree(
        tmp_path / "v2",
        cgroup="0::/a\n",
        mountinfo=V2_MOUNTS,
        files={**v2_files("/a", f"{GiB}"), "/sys/fs/cgroup/a/memory.stat": "inactive_file 456\n"},
    )
    assert memory_cgroup(root=v2).working_set_bytes == 123000
    bare = fake_tree(
        tmp_path / "bare", cgroup="0::/a\n", mountinfo=V2_MOUNTS, files=v2_files("/a", f"{GiB}")
    )
    got = memory_cgroup(root=bare)
    assert (got.inactive_file_bytes, got.working_set_bytes) == (None, 123456)


def test_v2_without_the_memory_controller_is_no_memory_cgroup(tmp_path: Path) -> None:
    """Hybrid machines mount v2 with no controllers (memory is bound to v1, or to nothing)."""
    root = fake_tree(
        tmp_path,
        cgroup="0::/a\n",
        mountinfo=V2_MOUNTS,
        files={**v2_files("", None, controllers="cpu io"), **v2_files("/a", None, controllers="")},
    )
    assert memory_cgroup(root=root) == MemoryCgroup(16 * GiB, None, None, None, None, None)


def test_v1_memory_wins_over_an_empty_v2_hierarchy(tmp_path: Path) -> None:
    """This machine's layout: v1 memory at /sys/fs/cgroup/memory, v2 at .../unified."""
    root = fake_tree(
        tmp_path,
        cgroup="4:memory:/job\n0::/\n",
        mountinfo=V1_MOUNTS,
        files={
            **v1_files("/job", f"{MiB}"),
            "/sys/fs/cgroup/unified/cgroup.controllers": "\n",
        },
    )
    assert (memory_cgroup(root=root).version, memory_cgroup(root=root).limit_bytes) == (1, MiB)


def test_container_whose_mount_root_is_its_own_cgroup(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup names the host's path while the container's
    mount shows only its own cgroup (mountinfo's root field); with one it names "/"."""
    mounts = "700 690 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
    files = v1_files("", f"{256 * MiB}")
    without_ns = fake_tree(
        tmp_path / "a", cgroup="4:memory:/docker/abc\n", mountinfo=mounts, files=files
    )
    got = memory_cgroup(root=without_ns)
    assert (got.limit_bytes, got.path) == (256 * MiB, "/docker/abc")
    with_ns = fake_tree(
        tmp_path / "b",
        cgroup="0::/\n",
        mountinfo="800 790 0:40 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        files=v2_files("", f"{128 * MiB}"),
    )
    assert memory_cgroup(root=with_ns).limit_bytes == 128 * MiB


def test_a_path_the_mount_does_not_show_falls_back_to_the_mount_point(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        cgroup="4:memory:/elsewhere/x\n",
        mountinfo=V1_MOUNTS,
        files=v1_files("", f"{100 * MiB}"),
    )
    assert memory_cgroup(root=root).limit_bytes == 100 * MiB


def test_mount_points_are_read_from_mountinfo_not_assumed(tmp_path: Path) -> None:
    r"""A hierarchy mounted somewhere unusual, with a space (``\040``) in the path."""
    root = fake_tree(
        tmp_path,
        cgroup="7:cpu,memory:/a\n",
        mountinfo="50 1 0:50 / /mnt/my\\040cg rw - cgroup none rw,cpu,memory\n",
        files={"/mnt/my cg/a/memory.limit_in_bytes": f"{42 * MiB}"},
    )
    got = memory_cgroup(root=root)
    assert (got.limit_bytes, got.usage_bytes, got.oom_kills) == (42 * MiB, None, None)


def test_another_process_is_read_by_pid(tmp_path: Path) -> None:
    root = fake_tree(
        tmp_path,
        cgroup="4:memory:/b\n",
        mountinfo=V1_MOUNTS,
        files=v1_files("/b", f"{5 * MiB}"),
        pid="4242",
    )
    assert memory_cgroup(4242, root=root).limit_bytes == 5 * MiB
    assert memory_cgroup(4243, root=root).version is None


def test_no_cgroups_and_no_proc_never_raise(tmp_path: Path) -> None:
    assert memory_cgroup(root=tmp_path) == MemoryCgroup(None, None, None, None, None, None)
    root = fake_tree(tmp_path / "m", cgroup="garbage\n", mountinfo="junk line\n", files={})
    assert memory_cgroup(root=root) == MemoryCgroup(16 * GiB, None, None, None, None, None)
    bad = fake_tree(
        tmp_path / "x",
        cgroup="4:memory:/a\n",
        mountinfo=V1_MOUNTS,
        files={
            "/sys/fs/cgroup/memory/a/memory.limit_in_bytes": "lots\n",
            "/sys/fs/cgroup/memory/a/memory.oom_control": "oom_kill many\n",
        },
        meminfo="MemTotal: x kB\n",
    )
    assert memory_cgroup(root=bad) == MemoryCgroup(None, None, None, None, 1, "/a")


# Real cgroups: a child process inside reports what it sees.

REPORT = (
    "import dataclasses, json, sys; from trims.cgroup import memory_cgroup; "
    "print(json.dumps(dataclasses.asdict(memory_cgroup())), flush=True); sys.stdin.read()"
)


@pytest.fixture(params=[1, 2], ids=["v1", "v2"])
def cgroups(request: pytest.FixtureRequest) -> Iterator[MemoryCgroups]:
    with memory_cgroups(request.param) as made:
        yield made


@contextlib.contextmanager
def child_in(cgroups: MemoryCgroups, cgroup: Cgroup) -> Iterator[tuple[dict[str, Any], int]]:
    """A Python child started inside ``cgroup``: what its memory_cgroup() said, and its pid;
    it waits (on its stdin) until the block ends, so it can be read from outside too."""
    with subprocess.Popen(
        cgroups.command(cgroup, [sys.executable, "-c", REPORT]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            line = proc.stdout.readline()
            assert line, f"the child exited with status {proc.wait()} before it reported"
            yield json.loads(line), proc.pid
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)


def test_a_process_in_a_real_cgroup_sees_its_limit(cgroups: MemoryCgroups) -> None:
    cgroup = cgroups.make(limit=512 * MiB)
    with child_in(cgroups, cgroup) as (seen, pid):
        assert seen["version"] == cgroups.version and seen["path"] == cgroup.path
        assert seen["limit_bytes"] == 512 * MiB
        # the interpreter that answered is charged to the cgroup
        assert 0 < seen["usage_bytes"] <= 512 * MiB
        assert seen["oom_kills"] == 0
        outside = memory_cgroup(pid)
        assert (outside.path, outside.limit_bytes) == (cgroup.path, 512 * MiB)
        found = find_memory_cgroup(pid)
        assert found is not None and found.directory == cgroup.directory
    assert memory_cgroup().limit_bytes != 512 * MiB


def test_a_nested_real_cgroup_is_bound_by_its_parent(cgroups: MemoryCgroups) -> None:
    parent = cgroups.make(limit=512 * MiB)
    unlimited = cgroups.make(parent=parent)
    with child_in(cgroups, unlimited) as (seen, _):
        assert seen["path"] == unlimited.path and seen["limit_bytes"] == 512 * MiB
    tighter = cgroups.make(limit=256 * MiB, parent=parent)
    with child_in(cgroups, tighter) as (seen, _):
        assert seen["limit_bytes"] == 256 * MiB
    looser = cgroups.make(limit=GiB, parent=parent)
    with child_in(cgroups, looser) as (seen, _):
        assert seen["limit_bytes"] == 512 * MiB
