"""The generated admin token: created on a gateway's first start, reused on later ones.

A gateway started without a tokens file is not open to everyone who can reach it: it keeps
one admin token in ``<state dir>/auth/admin-token`` (the way Jupyter keeps its server token)
and refuses deploys without it. The CLIs of the same user read the file, so ``trims functions
deploy`` works without copying secrets around; any other user gets 401 and a message that
names the file.

Note [admin token file]: the file is created at most once and never readable by others.
  * The ``auth`` folder is created with mode 0700 and must be owned by this uid with no
    group/other bits; a folder someone else could write to would let them swap the file.
  * The secret is written to a temp file (mkstemp: O_EXCL, mode 0600), fsynced, and
    ``os.link``-ed to its final name. link fails when the name exists, so two gateways
    starting at once agree on one token: the loser drops its temp file and reads the winner's.
  * Reading opens with O_NOFOLLOW and checks owner and mode, so a symlink or a file others
    can read is refused with what to fix rather than trusted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import tempfile
from pathlib import Path

from trims.errors import ValidationError
from trims.runtime.settings import Token

__all__ = ["ADMIN_TOKEN_NAME", "admin_token_path", "ensure_admin_token", "read_token_file"]

log = logging.getLogger(__name__)

#: The generated token's name in logs and errors (never its secret).
ADMIN_TOKEN_NAME = "generated-admin"


def admin_token_path(state_dir: Path) -> Path:
    """Where the admin token of a gateway with this state directory lives."""
    return state_dir / "auth" / "admin-token"


def _private_folder(folder: Path) -> None:
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValidationError(
            f"{folder} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(it is {stat.filemode(info.st_mode)}, uid {info.st_uid}); fix it with "
            f"`chmod 700 {folder}` or remove it so the gateway creates it"
        )


def read_token_file(path: Path) -> str:
    """The secret in ``path``; ValidationError (one line) when it is missing or unsafe."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ValidationError(f"no token file at {path}") from None
    except OSError as e:
        raise ValidationError(f"cannot read token file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValidationError(f"token file {path} is not a regular file; remove it")
        if info.st_uid == os.getuid() and info.st_mode & 0o077:
            raise ValidationError(
                f"token file {path} is readable by others (mode "
                f"{stat.filemode(info.st_mode)}); run `chmod 600 {path}` or remove it"
            )
        secret = f.read(4096).decode(errors="replace").strip()
    if not secret:
        raise ValidationError(f"token file {path} is empty; remove it so the gateway makes one")
    return secret


def ensure_admin_token(state_dir: Path) -> Token:
    """The admin token of ``state_dir``, created on first use (see Note [admin token file])."""
    path = admin_token_path(state_dir)
    _private_folder(path.parent)
    if not path.exists():
        fd, tmp = tempfile.mkstemp(prefix=".admin-token.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
            log.info("admin token created in %s (mode 0600)", path)
        except FileExistsError:
            log.info("admin token %s was created by another gateway; using it", path)
        finally:
            os.unlink(tmp)
    return Token(read_token_file(path), frozenset({"admin"}), ADMIN_TOKEN_NAME)
