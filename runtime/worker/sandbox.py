"""Confine the current worker process: memory limit, non-root user, die with its parent.

Order matters (see :func:`confine`): the memory limit is measured from the address space the
process already has (a zygote child inherits the preloaded frameworks' mappings, which must not
count against the function), privileges are dropped after everything that needs root, and the
parent-death signal is set last because changing credentials clears it.

Note [function code never runs as root]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A worker that starts as root always drops to an unprivileged user before it loads function
code: the ``run_as`` it was given, or else :func:`default_user` (a dedicated ``trims`` user
when the machine has one: no other service shares its uid or files; otherwise ``nobody``).
``run_as`` naming uid 0 or a user whose group is gid 0 is refused (:func:`resolve_unprivileged`).
The drop (:func:`drop_privileges`) clears the supplementary groups, sets gid and uid (real,
effective and saved), empties the capability bounding set first where it may (CAP_SETPCAP) and
sets ``no_new_privs`` so no setuid program or file capability can raise them again. Whatever
needs root happens before: connecting to the store socket (``before_drop``) and importing the
runtime's modules (:mod:`trims.runtime.worker.imports`). After the drop the worker proves it
(:func:`verify_unprivileged`): not uid/gid 0, no root group, ``setuid(0)`` refused, no
effective or permitted capabilities, and the store's admin socket refuses it; if any of these
holds the instance fails to start, before any function code is imported.

Note [what a worker inherits]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A worker starts with nothing of its parents' but what it was handed: its environment is
written down (Note [worker environment] in :mod:`trims.runtime.executors.base`), and before
the drop every descriptor but stdin, stdout, stderr (the instance's log) and the few a pooled
worker was handed is pointed at /dev/null (:func:`close_inherited_fds`); the zygote does the
same when it starts, keeping its socket to the executor. ``close_fds`` does not hold under
uvloop, the gateway's loop: a process it spawns inherits every inheritable descriptor of the
gateway and copies of its own stdin, stdout and stderr (the gateway's log, held by every
worker until this). A root zygote's imports open files too: ONNX Runtime opens its telemetry
database in root's home read-write at import. Descriptors are replaced rather than closed: a
library still holding the number then reads end-of-file and writes nowhere, where a closed
number, reused by the worker's next socket, would send the library's writes into it.

Note [an instance's processes end with it]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Function code may start processes, and a double fork with ``setsid`` leaves its worker's
process group and parentage: such a process outlived its instance and its function, still
holding a store connection and a model's mapping. Every worker is therefore a child subreaper
(``PR_SET_CHILD_SUBREAPER``, set by :func:`confine`): whatever its descendants orphan is
reparented to the worker, never to init, so the function's processes are always the worker's
descendants while it lives (one that ends before its worker stays a zombie of it, a pid
and no memory, until the worker ends: reaping with ``waitpid(-1)`` would steal the exit
status of a process the function waits for). When the worker ends it kills them
(:func:`end_children`, from ``run_worker``). A worker that cannot (killed, out of memory,
crashed) hands its children to the next subreaper up: the zygote is one too, and kills every
child that is not a worker (:mod:`trims.runtime.executors.zygote`, Note [leftovers]); a
spawned worker's executor kills the worker's descendants before it kills the worker
(:func:`kill_descendants`). Works unprivileged (no cgroup to create), with and without the
zygote. Not covered: a spawned worker that dies on its own, and the zygote's own SIGKILL (the
gateway killed): their orphans go to init.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pwd
import resource
import signal
import socket
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from trims.errors import TrimsError, ValidationError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
#: Users function code runs as when a root worker is given none; the first that exists wins.
DEFAULT_USERS = ("trims", "nobody")
_M_ARENA_MAX = -8
_ARENA = 64 << 20
#: Stack size of the worker's threads (Python's default is the 8 MiB RLIMIT_STACK).
THREAD_STACK = 8 << 20
#: Threads besides the handler pool (event loop helpers, the store client's callers).
_HELPER_THREADS = 4


@dataclass(frozen=True)
class Confinement:
    #: Bytes of address space the function may add on top of what the process maps at start.
    memory_bytes: int | None = None
    #: Threads the worker may run handlers on (their stacks are not counted as memory).
    threads: int = 1
    #: User name or uid to run as; None: :func:`default_user` when started as root, else the
    #: current user. Never root (Note [function code never runs as root]).
    run_as: str | None = None
    #: Parent pid to die with (SIGKILL when it exits); None: no such link.
    parent_pid: int | None = None


def address_space_bytes() -> int:
    """The process's current virtual memory size (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("VmSize missing from /proc/self/status")


def apply_memory_limit(extra_bytes: int, threads: int) -> int:
    """RLIMIT_AS = current VmSize + ``extra_bytes`` + reservations; returns the limit set.

    An address-space limit counts reservations that use no memory, so they are added on top:
    glibc gives each thread a 64 MiB malloc arena (capped here at one extra arena), and each of
    the ``threads`` the worker may start reserves a THREAD_STACK stack. What remains is about
    the function's real allocations.
    """
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 2)
    except (OSError, AttributeError):
        log.debug("mallopt unavailable; thread arenas count against the memory limit")
    threading.stack_size(THREAD_STACK)
    reserved = _ARENA + (threads + _HELPER_THREADS) * (THREAD_STACK + 4096)
    limit = address_space_bytes() + extra_bytes + reserved
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


def resolve_user(run_as: str) -> tuple[int, int]:
    """(uid, gid) of a user name or numeric uid."""
    try:
        entry = pwd.getpwuid(int(run_as)) if run_as.isdigit() else pwd.getpwnam(run_as)
    except (KeyError, ValueError) as e:
        raise ValidationError(f"run_as: no user {run_as!r} on this machine") from e
    return entry.pw_uid, entry.pw_gid


def resolve_unprivileged(run_as: str) -> tuple[int, int]:
    """(uid, gid) of ``run_as``; ValidationError if that is root or root's group."""
    uid, gid = resolve_user(run_as)
    if uid == 0 or gid == 0:
        what = "root" if uid == 0 else "a user in group root (gid 0)"
        raise ValidationError(
            f"run_as: {run_as!r} is {what}, and function code never runs as root; name an "
            f"unprivileged user (e.g. nobody) or leave --run-as unset for the default "
            f"({' if it exists, else '.join(DEFAULT_USERS)})",
            field="run_as",
        )
    return uid, gid


def default_user() -> str:
    """The user a root worker runs function code as when given none."""
    for name in DEFAULT_USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise ValidationError(
        f"no unprivileged user to run function code as: none of {', '.join(DEFAULT_USERS)} "
        "exists on this machine; create one (useradd --system trims) or pass --run-as USER"
    )


def effective_run_as(run_as: str | None) -> str | None:
    """The user function code runs as: ``run_as`` (checked), the default when this process is
    root, or None (a non-root process runs code as itself)."""
    if run_as is not None:
        resolve_unprivileged(run_as)
        return run_as
    return default_user() if os.geteuid() == 0 else None


def _prctl(option: int, arg: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, arg, 0, 0, 0))


def _drop_bounding_set() -> None:
    """Empty the capability bounding set (needs CAP_SETPCAP; a container may lack it, and the
    uid change plus no_new_privs already leave nothing to regain)."""
    try:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return
    for cap in range(last + 1):
        if _prctl(_PR_CAPBSET_DROP, cap) != 0:
            log.debug("capability bounding set left as is (no CAP_SETPCAP)")
            return


def drop_privileges(run_as: str) -> bool:
    """Become ``run_as`` for good; False when this process already is that user."""
    uid, gid = resolve_unprivileged(run_as)
    if os.getresuid() == (uid, uid, uid) and os.getresgid() == (gid, gid, gid):
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)
        return False
    _drop_bounding_set()
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if _prctl(_PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    return True


def _capabilities() -> dict[str, int]:
    caps: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("CapEff:", "CapPrm:")):
                key, value = line.split(":", 1)
                caps[key] = int(value.strip(), 16)
    return caps


def verify_unprivileged(admin_socket: Path | None) -> None:
    """After a drop: TrimsError naming what still looks like root (the instance must not start).

    The admin socket (0600, the store's owner) must refuse a connection; a missing one is fine.
    """
    problems: list[str] = []
    if 0 in os.getresuid() or 0 in os.getresgid():
        problems.append(f"still uid/gid 0 (uids {os.getresuid()}, gids {os.getresgid()})")
    if 0 in os.getgroups():
        problems.append("still in group root")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        problems.append("setuid(0) succeeded")
    held = {k: v for k, v in _capabilities().items() if v}
    if held:
        problems.append("holds capabilities " + ", ".join(f"{k} {v:#x}" for k, v in held.items()))
    if admin_socket is not None and os.path.exists(admin_socket):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(admin_socket))
        except OSError:
            pass
        else:
            problems.append(f"can connect to the store's admin socket {admin_socket}")
        finally:
            sock.close()
    if problems:
        raise TrimsError(
            f"worker (uid {os.getuid()}) is not unprivileged after dropping privileges: "
            + "; ".join(problems)
            + "; function code is not run. Check the user given to --run-as and the mode of "
            "the admin socket (0600, owned by the daemon's user)"
        )


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent exits; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def confine(c: Confinement, before_drop: Callable[[], None] | None = None) -> str | None:
    """Apply ``c``; ``before_drop`` runs with the original privileges (e.g. to connect to a
    socket the target user may not open: the store socket stays usable, the admin one not).

    Returns the user the process dropped to (None: it kept its own, non-root, user).
    """
    run_as = effective_run_as(c.run_as)
    become_subreaper()
    if c.memory_bytes is not None:
        apply_memory_limit(c.memory_bytes, c.threads)
    if before_drop is not None:
        before_drop()
    dropped = run_as is not None and drop_privileges(run_as)
    if c.parent_pid is not None:
        die_with_parent(c.parent_pid)
    return run_as if dropped else None


def close_inherited_fds(keep: Collection[int] = ()) -> None:
    """Point every descriptor but 0, 1, 2 and ``keep`` at /dev/null (Note [what a worker
    inherits])."""
    keep = {0, 1, 2, *keep}
    # listdir's own descriptor is in the listing and closed by the time it returns: skipped
    # as not open (EBADF), like any number that closed since.
    found = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) not in keep]
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        for fd in found:
            if fd != null:
                with contextlib.suppress(OSError):
                    os.fstat(fd)
                    os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


def become_subreaper() -> None:
    """Orphans among this process's descendants become its children, not init's (Note [an
    instance's processes end with it])."""
    if _prctl(_PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def children_of(pid: int) -> set[int]:
    """The pids whose parent is ``pid`` (orphans it adopted as a subreaper included)."""
    found: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(child) for child in f.read().split())
    except FileNotFoundError:
        # A kernel without CONFIG_PROC_CHILDREN (or a thread that just ended): every
        # process's parent, from its stat line.
        return _children_by_stat(pid)
    return found


def _children_by_stat(pid: int) -> set[int]:
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(entry))
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


#: Rounds of killing a process tree: each round kills what the last one orphaned or what was
#: forked while it ran; a tree that still grows after this many is left to the next subreaper.
_KILL_ROUNDS = 50


def kill_descendants(pid: int) -> None:
    """SIGKILL every running descendant of ``pid`` (a live subreaper: what its killed children
    orphan comes back to it, and the next round kills that)."""
    for _ in range(_KILL_ROUNDS):
        tree, todo = [], [pid]
        while todo:
            for child in children_of(todo.pop()):
                tree.append(child)
                todo.append(child)
        running = [p for p in tree if _running(p)]
        if not running:
            return
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)


def end_children(keep: Collection[int] = ()) -> None:
    """In a subreaper: kill and reap every child but ``keep`` until none is left (killing one
    hands its own children to this process)."""
    me = os.getpid()
    for _ in range(_KILL_ROUNDS):
        children = children_of(me).difference(keep)
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
