"""What the gateway's memory cgroup holds, and what one function instance costs in it.

The gateway, its zygotes and the local executor's workers are one process tree in one memory
cgroup (containers and pods are charged to cgroups of their own). Where that cgroup has a
limit below the machine's memory, the kernel OOM-kills at the limit, so the node's instance
budget (:mod:`trims.runtime.gateway.budget`) admits a new instance only while the cgroup's
working set plus the instance's expected cost stays under a high watermark of the limit.

The working set is the cgroup's usage less its inactive file pages (what the kubelet and
``docker stats`` report): page cache that nobody has touched lately is reclaimed before the
kernel kills anything, so counting it would refuse instances on a node that has room.

An instance's cost is its private memory (USS: ``Private_*`` of ``/proc/<pid>/smaps_rollup``):
pages a forked worker still shares with its zygote and the store's weights (the daemon's memfd,
mapped, charged to the cgroup that loaded them) are not its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trims.cgroup import find_memory_cgroup, mem_total, memory_cgroup

__all__ = ["MemoryReading", "MemorySource", "cgroup_memory", "private_bytes"]

#: Per cgroup version: the ``memory.stat`` key of the inactive file pages (v1 reports the
#: cgroup's own as ``inactive_file`` and with its descendants as ``total_inactive_file``).
_INACTIVE_FILE = {1: "total_inactive_file", 2: "inactive_file"}
#: The ``smaps_rollup`` fields that make up a process's private memory.
_PRIVATE_FIELDS = ("Private_Clean:", "Private_Dirty:", "Private_Hugetlb:")


@dataclass(frozen=True)
class MemoryReading:
    """The memory the gateway's cgroup uses and may use, bytes."""

    #: The working set: usage less inactive file pages.
    usage_bytes: int
    #: The effective limit (the smallest of the cgroup's and its ancestors').
    limit_bytes: int


#: Reads the gateway's memory now; None where no limit binds it.
MemorySource = Callable[[], MemoryReading | None]


def cgroup_memory(pid: int | None = None, *, root: Path = Path("/")) -> MemoryReading | None:
    """The working set and limit of the memory cgroup of ``pid`` (default: this process);
    None without a memory cgroup, or where its limit is not below the machine's memory (no
    cgroup limits it: the node keeps the behaviour of an unlimited one)."""
    cgroup = memory_cgroup(pid, root=root)
    total = mem_total(root=root)
    limit, usage = cgroup.limit_bytes, cgroup.usage_bytes
    if limit is None or usage is None or total is None or limit >= total:
        return None
    found = find_memory_cgroup(pid, root=root)
    inactive = 0
    if found is not None:
        inactive = _stat(found.directory / "memory.stat", _INACTIVE_FILE[found.version])
    return MemoryReading(usage_bytes=max(0, usage - inactive), limit_bytes=limit)


def private_bytes(pid: int, *, root: Path = Path("/")) -> int | None:
    """The private memory (USS) of process ``pid``, bytes; None where it cannot be read (it
    ended, or belongs to a user this process may not inspect)."""
    try:
        text = (root / "proc" / str(pid) / "smaps_rollup").read_text()
    except (OSError, UnicodeDecodeError):
        return None
    total = 0
    for line in text.splitlines():
        if line.startswith(_PRIVATE_FIELDS):
            fields = line.split()
            try:
                total += int(fields[1]) * 1024  # kB
            except (IndexError, ValueError):
                return None
    return total


def _stat(path: Path, key: str) -> int:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
