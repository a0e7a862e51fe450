"""Confine the current worker process: memory limit, non-root user, die with its parent.

Order matters (see :func:`confine`): the memory limit is measured from the address space the
process already has (a zygote child inherits the preloaded frameworks' mappings, which must not
count against the function), privileges are dropped after everything that needs root, and the
parent-death signal is set last because changing credentials clears it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pwd
import resource
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from trims.errors import ValidationError

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
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
    #: User name or uid to run as; None keeps the current user.
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


def drop_privileges(run_as: str) -> None:
    uid, gid = resolve_user(run_as)
    if os.getuid() == uid:
        return
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent exits; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def confine(c: Confinement, before_drop: Callable[[], None] | None = None) -> None:
    """Apply ``c``; ``before_drop`` runs with the original privileges (e.g. to connect to a
    socket the target user may not open: the store socket stays usable, the admin one not)."""
    if c.memory_bytes is not None:
        apply_memory_limit(c.memory_bytes, c.threads)
    if before_drop is not None:
        before_drop()
    if c.run_as is not None:
        drop_privileges(c.run_as)
    if c.parent_pid is not None:
        die_with_parent(c.parent_pid)
