"""The memory a process may really use: its memory cgroup's limit, usage, peak and OOM kills.

A node's memory is what the process's memory cgroup allows, not what ``/proc/meminfo`` says
the machine has: in a container, a pod or a ``systemd`` slice the kernel kills the process
(an OOM kill) at the cgroup's limit, however much the machine holds. The daemon and the
gateway size their defaults from :func:`memory_cgroup` (see DESIGN.md, "Memory is a budget
the node really has").

Where the files are::

    /proc/<pid>/cgroup    v1: "4:memory:/a/b"     v2: "0::/a/b"
    /proc/self/mountinfo  where the hierarchy is mounted, and which of its cgroups is the
                          mount's root (in a container, often the container's own cgroup)
    v1  <mount>/a/b/memory.limit_in_bytes, memory.usage_in_bytes,
                    memory.max_usage_in_bytes, memory.oom_control ("oom_kill N"),
                    memory.stat ("total_inactive_file N")
    v2  <mount>/a/b/memory.max ("max" or bytes), memory.current, memory.peak (Linux 5.19+),
                    memory.events ("oom_kill N"), memory.stat ("inactive_file N"); memory
                    only where cgroup.controllers lists it

The effective limit is the smallest limit of the cgroup and every ancestor visible under the
mount (a cgroup without a limit of its own is bound by its parent's, and the files show only
its own), and never more than ``MemTotal``. "max" in v2, and in v1 any value of at least 2^62
(the kernel shows "no limit" as LONG_MAX rounded down to a page), mean no limit.

Nothing here raises: on a machine without cgroups (or without the files) the fields are None.
Every path is taken under ``root`` so that tests can give a fake tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "UNLIMITED_AT",
    "CgroupDir",
    "MemoryCgroup",
    "find_cgroup",
    "find_memory_cgroup",
    "mem_total",
    "memory_cgroup",
]

#: A v1 limit at least this large means "no limit" (the kernel writes LONG_MAX rounded down to
#: a page, 9223372036854771712 with 4 KiB pages; no machine has 4 EiB).
UNLIMITED_AT = 1 << 62

#: Per version: the limit, usage, peak and events file, and the events file's OOM-kill key.
_FILES = {
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes",
        "memory.oom_control"),
    2: ("memory.max", "memory.current", "memory.peak", "memory.events"),
}  # fmt: skip
#: Per version: the ``memory.stat`` key of the inactive file pages of the cgroup and its
#: descendants, as its usage counts them (v1's ``inactive_file`` is the cgroup's own).
_INACTIVE_FILE = {1: "total_inactive_file", 2: "inactive_file"}


@dataclass(frozen=True)
class CgroupDir:
    """Where a process's memory cgroup is."""

    #: 1 or 2.
    version: int
    #: The cgroup as ``/proc/<pid>/cgroup`` names it, e.g. ``/kubepods/pod1/abc``.
    path: str
    #: The directory of its files.
    directory: Path
    #: The hierarchy's mount point: the topmost ancestor this process can see.
    mount: Path


@dataclass(frozen=True)
class MemoryCgroup:
    """A process's memory as its cgroup accounts it, read once; None where unknown."""

    #: Bytes the process may use: the smallest limit of its cgroup and its ancestors, at most
    #: MemTotal; MemTotal where no cgroup limits it; None only where neither can be read.
    limit_bytes: int | None
    #: Bytes the cgroup charges now (its processes' memory and page cache, shmem included).
    usage_bytes: int | None
    #: Most bytes the cgroup ever charged (v2 needs Linux 5.19 for ``memory.peak``).
    peak_bytes: int | None
    #: Processes the kernel killed for memory in the cgroup (v1 needs Linux 4.13).
    oom_kills: int | None
    #: 1 or 2; None without a memory cgroup.
    version: int | None
    #: The cgroup as ``/proc/<pid>/cgroup`` names it; None without a memory cgroup.
    path: str | None
    #: Bytes of the usage that are file pages nobody touched lately (``memory.stat``): the
    #: kernel reclaims them before it OOM-kills anything.
    inactive_file_bytes: int | None = None

    @property
    def working_set_bytes(self) -> int | None:
        """Usage less inactive file pages (what the kubelet and ``docker stats`` report): the
        memory the cgroup cannot give back without killing or swapping; None where unknown."""
        if self.usage_bytes is None:
            return None
        return max(0, self.usage_bytes - (self.inactive_file_bytes or 0))


def memory_cgroup(pid: int | None = None, *, root: Path = Path("/")) -> MemoryCgroup:
    """The memory cgroup of ``pid`` (default: this process), its effective limit and usage."""
    total = mem_total(root=root)
    found = find_memory_cgroup(pid, root=root)
    if found is None:
        return MemoryCgroup(total, None, None, None, None, None)
    limit_file, usage_file, peak_file, events_file = _FILES[found.version]
    limits = [n for d in _up_to_mount(found) if (n := _limit(d / limit_file)) is not None]
    if total is not None:
        limits.append(total)
    return MemoryCgroup(
        limit_bytes=min(limits, default=None),
        usage_bytes=_int(found.directory / usage_file),
        peak_bytes=_int(found.directory / peak_file),
        oom_kills=_oom_kills(found.directory / events_file),
        version=found.version,
        path=found.path,
        inactive_file_bytes=_keyed(found.directory / "memory.stat", _INACTIVE_FILE[found.version]),
    )


def find_memory_cgroup(pid: int | None = None, *, root: Path = Path("/")) -> CgroupDir | None:
    """Where the memory cgroup of ``pid`` (default: this process) is; None without one.

    A v1 ``memory`` hierarchy wins over v2 (a controller belongs to one hierarchy at a time,
    so where v1 has it, v2 does not); v2 counts only where the cgroup's ``cgroup.controllers``
    lists ``memory``.
    """
    found = find_cgroup(1, pid, root=root)
    if found is not None:
        return found
    found = find_cgroup(2, pid, root=root)
    if found is not None:
        controllers = _read(found.directory / "cgroup.controllers") or ""
        if "memory" in controllers.split():
            return found
    return None


def find_cgroup(
    version: int, pid: int | None = None, *, root: Path = Path("/")
) -> CgroupDir | None:
    """The cgroup of ``pid`` (default: this process) in the v1 ``memory`` hierarchy
    (``version`` 1) or in the v2 hierarchy (2, whatever its controllers); None where that
    hierarchy is not mounted or the process is in none."""
    text = _read(root / "proc" / ("self" if pid is None else str(pid)) / "cgroup")
    path = None
    for line in (text or "").splitlines():
        hierarchy, controllers, rest = [*line.split(":", 2), "", ""][:3]
        v1_memory = "memory" in controllers.split(",")
        if (version == 1 and v1_memory) or (version == 2 and (hierarchy, controllers) == ("0", "")):
            path = rest
    if path is None:
        return None
    mounts = [
        m
        for m in _cgroup_mounts(root)
        if (version == 1 and m[2] == "cgroup" and "memory" in m[3])
        or (version == 2 and m[2] == "cgroup2")
    ]
    return _locate(version, path, mounts)


def mem_total(*, root: Path = Path("/")) -> int | None:
    """The machine's memory from ``/proc/meminfo`` (bytes); None where it cannot be read."""
    for line in (_read(root / "proc" / "meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        if name == "MemTotal":
            fields = rest.split()
            try:
                return int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
            except (IndexError, ValueError):
                return None
    return None


#: One cgroup mount: its mount point (under root), the cgroup that is its root, the filesystem
#: type and the mount's super options (v1 names its controllers there).
_Mount = tuple[Path, str, str, list[str]]


def _cgroup_mounts(root: Path) -> list[_Mount]:
    mounts: list[_Mount] = []
    for line in (_read(root / "proc" / "self" / "mountinfo") or "").splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        mount_point = _unescape(fields[4])
        mounts.append(
            (root / mount_point.lstrip("/"), _unescape(fields[3]), tail[0], tail[2].split(","))
        )
    return mounts


def _locate(version: int, path: str, mounts: list[_Mount]) -> CgroupDir | None:
    """The directory of cgroup ``path`` under one of ``mounts``.

    A mount shows the hierarchy from its root cgroup down: ``path`` less that root, under the
    mount point. Where ``path`` is not below the root (in a container without a cgroup
    namespace: its cgroup lies outside what the container mounted) or its directory is not
    there, the mount point itself is the process's cgroup as far as it can see.
    """
    for mount_point, mount_root, _, _ in mounts:
        base = mount_root.rstrip("/")
        if path == base or path.startswith(base + "/"):
            directory = mount_point / path[len(base) :].lstrip("/")
            if directory.is_dir():
                return CgroupDir(version, path, directory, mount_point)
    if mounts and mounts[0][0].is_dir():
        return CgroupDir(version, path, mounts[0][0], mounts[0][0])
    return None


def _up_to_mount(found: CgroupDir) -> list[Path]:
    """The cgroup's directory and each parent up to the mount point, in that order."""
    chain = [found.directory]
    while chain[-1] != found.mount and found.mount in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _limit(path: Path) -> int | None:
    text = _read(path)
    if text is None or text.strip() == "max":
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if 0 <= value < UNLIMITED_AT else None


def _int(path: Path) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text.strip())
    except ValueError:
        return None


def _oom_kills(path: Path) -> int | None:
    return _keyed(path, "oom_kill")


def _keyed(path: Path, key: str) -> int | None:
    """The value of ``key`` in a flat-keyed file of "key value" lines; None if absent."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _unescape(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash in paths as octal (``\040``)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
