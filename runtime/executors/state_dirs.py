"""An executor's own state directory (instance sockets and logs), and the sweep of dead ones.

Note [stale state directories]: an executor given no ``state_dir`` makes one under the temporary
directory (``trims-local-*``, ``trims-docker-*``) and removes it when it closes. A gateway that
is killed (SIGKILL, OOM killer, power loss) never closes, and its directory stayed: instance
logs with whatever functions printed, sockets of workers long dead, one directory per killed
gateway (59 had piled up on the development machine). So the directory holds a lock: its maker
creates ``.owner`` in it and keeps an exclusive ``flock`` on it for as long as the process
lives (the descriptor is close-on-exec, so no zygote or worker inherits it; the kernel drops
the lock when the process dies, however it dies). Whenever an executor makes a new directory it
first removes every directory of its prefix whose ``.owner`` it can lock: nobody holds it, so
its maker is gone.

Only what this process's user made is removed: the directory may belong to us or to the user
functions run as (the local executor hands it to that user), but ``.owner`` must be ours, a
regular file, not a link: the function user cannot create a file owned by root, so a function
cannot make the sweep remove anything. A directory without ``.owner`` (made before this
change, or by someone else) is left alone, as is every path that is not a real directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

#: The lock file in an executor's own state directory.
OWNER = ".owner"


class OwnedDir:
    """A state directory this process made and holds the lock of (until :meth:`remove`)."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd: int | None = lock_fd

    def remove(self) -> None:
        """Delete the directory, then let go of its lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def make_owned_dir(prefix: str) -> OwnedDir:
    """Sweep the dead directories of ``prefix`` (Note [stale state directories]), then make a
    new one and take its lock."""
    sweep_stale(prefix)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    # Locked under another name, then renamed: another executor's sweep never finds an
    # unlocked .owner in a directory whose maker is alive.
    fd = os.open(path / ".owner.new", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(path / ".owner.new", path / OWNER)
    return OwnedDir(path, fd)


def sweep_stale(prefix: str, parent: Path | None = None) -> list[Path]:
    """Remove the directories ``parent/prefix*`` whose maker died; the paths removed."""
    root = Path(parent or tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError as e:
        log.debug("cannot list %s for stale state directories: %s", root, e)
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        path = Path(entry.path)
        if _dead(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d state directories of executors that died: %s",
                 len(removed), ", ".join(str(p) for p in removed))  # fmt: skip
    return removed


def _dead(path: Path) -> bool:
    """Whether ``path`` is a directory one of this user's executors made and no process holds."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        fd = os.open(path / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False  # no lock file (older, or not ours), or not ours to read
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its maker is alive
        return True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
