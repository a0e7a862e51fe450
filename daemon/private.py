"""The daemon's files on disk belong to its user alone: folders 0700, files 0600 or 0400.

Note [private store]
~~~~~~~~~~~~~~~~~~~~
The sockets decide who may acquire a model (its access list), but the store directory holds
the same bytes (disk-tier blobs) and the catalog (names, sources, access lists). A local user
who can search it reads a restricted model straight from the disk. So the daemon keeps every
folder of its store 0700 and every file in them 0600 (the catalog and its journals) or 0400
(blobs and manifests), all owned by its uid:

- what it creates it creates with those modes (never what the umask leaves);
- at start, a folder or file it finds owned by its uid with group or other bits is tightened
  to owner-only, and a warning names it: a Helm ``hostPath`` with ``DirectoryOrCreate`` and an
  admin's ``mkdir`` under umask 022 both make 0755;
- one owned by another uid is refused with a :class:`~trims.errors.ValidationError` naming the
  path, its owner and mode: that user could read or replace what the daemon stores, and only
  an administrator can hand it over.

Tightening cannot close a descriptor someone opened while the mode was loose, so the warning
says that what was stored may have been read. A symlinked store dir is followed: its target is
what is checked.

The socket folder cannot be private: clients of other uids must search it to reach the store
socket (the sockets' own modes decide who may connect). :func:`socket_folder` only makes sure
nobody but the daemon's user (or root) can replace what is in it, and :func:`private_log`
keeps the daemon's log, which names models, sources and clients, to the daemon's user.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from trims.errors import ValidationError

__all__ = ["private_dir", "private_file", "private_files", "private_log", "socket_folder"]

log = logging.getLogger(__name__)

#: Bits of group and others: what a private folder or file must not have.
_OTHERS = 0o077


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"


def _own(path: Path, st: os.stat_result, kind: str, fix: str) -> None:
    """Refuse ``path`` unless the daemon's uid owns it."""
    uid = os.geteuid()
    if st.st_uid != uid:
        raise ValidationError(
            f"{kind} {path} ({_describe(st)}) is not owned by the daemon's uid {uid}: its owner "
            f"could read or replace what the daemon keeps there; {fix}"
        )


def _tighten(path: Path, st: os.stat_result) -> bool:
    """Clear the group and other bits of ``path``; whether there were any."""
    if not st.st_mode & _OTHERS:
        return False
    os.chmod(path, stat.S_IMODE(st.st_mode) & ~_OTHERS)
    return True


def private_dir(path: Path) -> None:
    """Make ``path`` a folder of the daemon's uid with mode 0700 (Note [private store]).

    Missing: created 0700 (its parents as the umask makes them). Owned by the daemon's uid
    with looser bits: tightened, with a warning. Owned by another uid or not a folder:
    ValidationError saying what to do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise ValidationError(f"{path} is not a folder; choose another --store-dir")
    _own(path, st, "folder", f"run `chown -R {os.geteuid()} {path}` or choose another --store-dir")
    if _tighten(path, st):
        log.warning(
            "folder %s was reachable by other users (%s); made it 0700. What it held may have "
            "been read: check who had access",
            path,
            _describe(st),
        )


def _check_file(path: Path) -> bool:
    """Refuse ``path`` unless it is a file of the daemon's uid; tighten it; whether it was."""
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise ValidationError(
            f"{path} is not a regular file; remove it (the daemon keeps only files there)"
        )
    _own(path, st, "file", f"remove it or run `chown {os.geteuid()} {path}`")
    return _tighten(path, st)


def private_file(path: Path, mode: int) -> None:
    """Make ``path`` a file of the daemon's uid without group or other bits: created empty with
    ``mode`` when missing; tightened, with a warning, when looser (Note [private store])."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
    except FileExistsError:
        if _check_file(path):
            log.warning("file %s was readable by other users; made it owner-only", path)


def private_files(folder: Path) -> None:
    """Check every entry of ``folder`` as a file of the daemon's uid and tighten the loose
    ones, with one warning for them all (Note [private store])."""
    tightened = sum(_check_file(entry) for entry in folder.iterdir())
    if tightened:
        log.warning(
            "%d file(s) in %s were readable by other users; made them owner-only", tightened, folder
        )


def socket_folder(path: Path) -> None:
    """Make ``path`` (the sockets' folder) one that only the daemon's uid or root can change.

    Missing: created 0755 (clients search it to reach the store socket). The daemon's own with
    group or other write bits and no sticky bit: those are cleared, with a warning. Another
    uid's, or root's and writable by others without the sticky bit: ValidationError, since its
    owner or anyone could replace the socket with their own or read the daemon's log beside it."""
    path.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = path.stat()
    uid = os.geteuid()
    # In a sticky folder (/tmp) only an entry's owner may remove or rename it.
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if st.st_uid not in (uid, 0) or (st.st_uid != uid and st.st_mode & stat.S_IWOTH and not sticky):
        raise ValidationError(
            f"socket folder {path} ({_describe(st)}) can be changed by users other than the "
            f"daemon's uid {uid}: they could replace the socket with their own; remove it so "
            "the daemon makes it, or choose another --socket"
        )
    if st.st_uid == uid and st.st_mode & 0o022 and not sticky:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022)
        log.warning(
            "socket folder %s was writable by other users (%s); cleared their write bits",
            path,
            _describe(st),
        )


def private_log() -> None:
    """Make the daemon's stdout and stderr owner-only where they are files of its uid.

    The log names models, their sources and clients (Note [private store]); a launcher that
    appended it to a file made under umask 022 left it readable by everyone."""
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not st.st_mode & _OTHERS:
            continue
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_OTHERS)
        log.warning(
            "log file %s was readable by other users (%s); made it owner-only",
            os.readlink(f"/proc/self/fd/{fd}"),
            _describe(st),
        )
