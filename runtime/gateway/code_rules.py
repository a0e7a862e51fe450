"""What code a deploy may point at: the ``code_dir`` and ``handler`` rules checked on this host.

The parser (``trims.runtime.functions.spec``) already holds ``code_dir`` to an absolute path
without ``..``; here, where the files are, the gateway checks that it is a directory that may
hold function code and that the handler's module is a file in it:

* ``code_dir`` exists and is a directory; once symlinks are resolved it is not ``/`` and not
  at or under a system directory (``/etc``, ``/proc``, ``/sys``, ``/dev``, ``/boot``,
  ``/var/lib/trims``) nor the gateway's state directory or the store's directory;
  with ``code_roots`` set it lies under one of them.
* the handler's module (``pkg.mod`` of ``pkg.mod:fn``) is ``pkg/mod.py`` or
  ``pkg/mod/__init__.py`` inside ``code_dir``, so ``os:getcwd`` or ``subprocess:run`` are
  refused, and so is a module named like one of the standard library's (the worker has it
  imported already, so a file of that name would not be the one run). The project's own
  benchmark functions (``trims.kernels.*``, ``trims.evaluation.*``) are the one
  exception: they come with the installed package and need no code_dir.
* a function with an ``image`` and no code_dir runs its handler from the image, and on the
  kubernetes executor code_dir is a path in the image: there is no file on this host to check.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

from trims.errors import ValidationError
from trims.runtime.functions.spec import FunctionSpec

__all__ = ["PROJECT_HANDLER_PREFIXES", "SYSTEM_DIRS", "check_code"]

#: Directories (and everything under them) that never hold function code.
SYSTEM_DIRS = tuple(Path(p) for p in ("/etc", "/proc", "/sys", "/dev", "/boot", "/var/lib/trims"))
#: Handler modules that come with trims itself: the benchmark functions.
PROJECT_HANDLER_PREFIXES = ("trims.kernels.", "trims.evaluation.")


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_code(
    spec: FunctionSpec,
    *,
    protected: Iterable[Path] = (),
    roots: Iterable[Path] = (),
    on_host: bool = True,
) -> None:
    """Raise ValidationError (naming the field) unless the spec's code may be deployed here.

    ``on_host`` False (executors whose code_dir is a path in an image, e.g. kubernetes) checks
    only the handler's module name: the files are not on this host.
    """
    module = spec.handler.partition(":")[0] if spec.handler else None
    if module is not None and module.split(".")[0] in sys.stdlib_module_names:
        raise ValidationError(
            f"handler: module {module!r} is a standard library module; the handler module must "
            "be a file in code_dir with a name of its own (e.g. handler:handler)",
            field="handler",
        )
    if not on_host:
        return
    if spec.code_dir is None:
        if module is None or spec.image is not None:
            return
        if module.startswith(PROJECT_HANDLER_PREFIXES):
            return
        raise ValidationError(
            f"handler: module {module!r} must be a file in code_dir; set code_dir to the "
            "directory holding it (only trims.kernels.* and trims.evaluation.* come with trims)",
            field="handler",
        )
    code_dir = _code_dir(Path(spec.code_dir), protected, tuple(roots))
    if module is None or spec.image is not None:
        return
    parts = module.split(".")
    base = code_dir.joinpath(*parts)
    for candidate in (base.with_name(parts[-1] + ".py"), base / "__init__.py"):
        resolved = candidate.resolve()
        if candidate.is_file() and _under(resolved, code_dir):
            return
    if module.startswith(PROJECT_HANDLER_PREFIXES):
        return
    raise ValidationError(
        f"handler: the handler module must be a file in code_dir; {module!r} is neither "
        f"{'/'.join(parts)}.py nor {'/'.join(parts)}/__init__.py in {code_dir}",
        field="handler",
    )


def _code_dir(path: Path, protected: Iterable[Path], roots: tuple[Path, ...]) -> Path:
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise ValidationError(
            f"code_dir: {path} {what} on the gateway's host; deploy a directory holding the "
            "handler module",
            field="code_dir",
        )
    resolved = path.resolve()
    refused = [*SYSTEM_DIRS, *(p.resolve() for p in protected)]
    if resolved == Path("/") or any(_under(resolved, folder) for folder in refused):
        raise ValidationError(
            f"code_dir: {path} is (or is under) a system or trims directory; put the function "
            "code in a directory of its own",
            field="code_dir",
        )
    if roots and not any(_under(resolved, root.resolve()) for root in roots):
        shown = ", ".join(str(r) for r in roots)
        raise ValidationError(
            f"code_dir: {path} is outside the gateway's code roots ({shown}); move the code "
            "under one of them",
            field="code_dir",
        )
    return resolved
