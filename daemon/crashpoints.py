"""Named crash points for the crash-safety tests: SIGKILL the daemon at one chosen step.

The commit protocol (Note [commit protocol] in :mod:`trims.daemon.store`) calls
``crashpoint(name)`` after each of its steps. A daemon started with the hidden option
``--crash-point NAME`` (``DaemonSettings.crash_point``, armed once by :func:`arm` when the
store is created) kills itself with SIGKILL when it reaches that point, exactly as an OOM kill or
a power cut would stop it: no cleanup, no flush beyond what the step already made durable.
Unarmed (always, outside tests) a crash point is one comparison.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from trims.errors import ValidationError

log = logging.getLogger(__name__)

#: Every crash point, in protocol order (tests parametrize over these).
ADD_POINTS = ("add.intent", "add.blob_renamed", "add.blob_placed", "add.committed")
REMOVE_POINTS = ("rm.row_deleted", "rm.blob_removed")
POINTS = ADD_POINTS + REMOVE_POINTS

_armed: str | None = None


def arm(name: str | None) -> None:
    """Make ``crashpoint(name)`` kill this process (None disarms)."""
    global _armed
    if name is not None and name not in POINTS:
        raise ValidationError(f"unknown crash point {name!r}; known: {', '.join(POINTS)}")
    _armed = name
    if name is not None:
        log.warning("crash point %s armed: the daemon kills itself when it gets there", name)


def crashpoint(name: str) -> None:
    """SIGKILL this process if ``name`` is the armed crash point."""
    if name != _armed:
        return
    print(f"trims daemon crash point {name} reached", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
