"""Can the user that function code runs as read that code? Checked as that user, not guessed.

A worker that drops to ``nobody`` and then finds its ``code_dir`` unreadable would fail with
Python's "No module named 'handler'" (the import system skips directories it cannot list),
which says nothing about permissions. So the code is checked twice, with one message:

* at deploy, by the executor (:func:`check_code_as`): a forked child takes the user's
  credentials and tries the paths itself (``os.access`` and ``open`` as that user are the
  honest answer; mode bits would miss ACLs, supplementary groups and read-only mounts);
* at instance start, by the worker after it dropped privileges (:func:`check_code`), for
  whatever changed since the deploy.

What is checked: the code directory (read and search, and the search bit on every ancestor,
since path lookup needs it) and each file or package directory of the handler's module that
exists there (a handler module from the installed packages, e.g. the benchmark functions, is
not in ``code_dir`` and is not checked).

The same forked check tells whether the user can read the interpreter's library and the trims
packages (:func:`unreadable_runtime`): a zygote-forked worker has what the zygote preloaded,
but any module imported after the drop must be readable by the user.
"""

from __future__ import annotations

import json
import os
import pwd
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trims.errors import ValidationError
from trims.runtime.functions.spec import FunctionSpec

__all__ = [
    "Blocked",
    "User",
    "check_code",
    "check_code_as",
    "find_blocked",
    "unreadable_runtime",
]


@dataclass(frozen=True)
class User:
    """Credentials a check runs with: what the worker will have after dropping privileges."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        try:
            name = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return f"uid {self.uid}"
        return f"{name} (uid {self.uid})"


@dataclass(frozen=True)
class Blocked:
    """A path the user cannot read; ``blocker`` is the ancestor lacking the search bit."""

    what: str
    path: str
    blocker: str | None = None

    def message(self, user: str) -> str:
        via = f" ({self.blocker} is not searchable by that user)" if self.blocker else ""
        fix = "chmod o+rx" if self.what != "handler module file" else "chmod o+r"
        return (
            f"{self.what} {self.path} is not readable by user {user} that function code runs "
            f"as{via}; make it readable ({fix}) or choose --run-as"
        )


def _module_paths(code_dir: str, module: str) -> list[tuple[str, str, bool]]:
    """(what, path, is_dir) of the files a module import would read under ``code_dir``."""
    out: list[tuple[str, str, bool]] = []
    parts = module.split(".")
    base = code_dir
    for i, part in enumerate(parts):
        package = os.path.join(base, part)
        out.append(("handler package directory", package, True))
        out.append(("handler module file", os.path.join(package, "__init__.py"), False))
        if i == len(parts) - 1:
            out.append(("handler module file", f"{package}.py", False))
        base = package
    return out


def _first_unsearchable(path: str) -> str | None:
    """The first ancestor of ``path`` (from / down) that the current user cannot search."""
    parts = Path(path).parts
    for i in range(1, len(parts)):
        ancestor = str(Path(*parts[:i]))
        if not os.access(ancestor, os.X_OK):
            return ancestor
    return None


def _readable(path: str, is_dir: bool, dir_fd: int | None) -> bool | None:
    """True/False as the current user; None when the path does not exist."""
    try:
        os.stat(path, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None
    except PermissionError:
        return False
    if is_dir:
        return os.access(path, os.R_OK | os.X_OK, dir_fd=dir_fd)
    try:
        fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
    except PermissionError:
        return False
    except OSError:
        return None
    os.close(fd)
    return True


def find_blocked(code_dir: str, module: str | None, dir_fd: int | None = None) -> Blocked | None:
    """As the current user: the first part of the function's code it cannot read, or None.

    ``dir_fd``: a descriptor of ``code_dir`` opened by the caller, for code that reaches the
    function as a bind mount (docker): its host ancestors do not matter then, so only the
    directory and what is in it are checked, relative to the descriptor.
    """
    mounted = dir_fd is not None
    top = _readable("." if mounted else code_dir, True, dir_fd)
    if top is None:
        return None
    if not top:
        return Blocked("code_dir", code_dir, None if mounted else _first_unsearchable(code_dir))
    if module is None:
        return None
    for what, path, is_dir in _module_paths(code_dir, module):
        ok = _readable(os.path.relpath(path, code_dir) if mounted else path, is_dir, dir_fd)
        if ok is False:
            return Blocked(what, path)
    return None


def _module_of(spec: FunctionSpec) -> str | None:
    return spec.handler.partition(":")[0] if spec.handler else None


def check_code(spec: FunctionSpec, user: str) -> None:
    """In the worker, after the drop: ValidationError if its own user cannot read the code."""
    if spec.code_dir is None:
        return
    blocked = find_blocked(spec.code_dir, _module_of(spec))
    if blocked is not None:
        raise ValidationError(blocked.message(user), field="code_dir")


def _as_user(user: User, check: str, args: Sequence[object]) -> object:
    """Run ``check`` (a name in this module) in a child with ``user``'s credentials only.

    The child runs no imports and no logging (it is forked from a process that may have
    threads): it changes ids, calls the check, writes the JSON result to a pipe and _exits.
    """
    fn = globals()[check]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgroups(list(user.groups))
            os.setresgid(user.gid, user.gid, user.gid)
            os.setresuid(user.uid, user.uid, user.uid)
            result = fn(*args)
            os.write(w, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with open(r, "rb") as f:
        while chunk := f.read(1 << 16):
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(f"the access check as uid {user.uid} failed in its child process")
    return json.loads(b"".join(chunks))


def _blocked_json(code_dir: str, module: str | None, dir_fd: int | None) -> list[str | None] | None:
    blocked = find_blocked(code_dir, module, dir_fd)
    return None if blocked is None else [blocked.what, blocked.path, blocked.blocker]


def check_code_as(spec: FunctionSpec, user: User, *, mounted: bool = False) -> None:
    """At deploy: ValidationError if ``user`` could not read the function's code.

    Needs the privilege to change ids (root); callers without it run code as themselves, and
    the worker's own check at start covers them.
    """
    if spec.code_dir is None or not os.path.isdir(spec.code_dir):
        return
    # A bind mount reaches the directory without its host path: open it here, check below it.
    dir_fd = os.open(spec.code_dir, os.O_PATH | os.O_DIRECTORY) if mounted else None
    try:
        result = _as_user(user, "_blocked_json", (spec.code_dir, _module_of(spec), dir_fd))
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    if result is not None:
        assert isinstance(result, list)
        what, path, blocker = result
        raise ValidationError(
            Blocked(str(what), str(path), blocker).message(user.label), field="code_dir"
        )


def _unreadable_json(paths: list[str]) -> list[str]:
    return [p for p in paths if not os.access(p, os.R_OK | os.X_OK)]


def runtime_paths() -> list[str]:
    """The directories imports come from: the interpreter's library and the trims packages."""
    import trims
    import trims.runtime

    found = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    found |= {str(Path(trims.__file__).parent), str(Path(trims.runtime.__file__).parent)}
    return sorted(p for p in found if os.path.isdir(p))


def unreadable_runtime(user: User) -> list[str]:
    """The :func:`runtime_paths` that ``user`` cannot read (needs root to change ids)."""
    result = _as_user(user, "_unreadable_json", (runtime_paths(),))
    assert isinstance(result, list)
    return [str(p) for p in result]
