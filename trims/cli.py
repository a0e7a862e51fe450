"""`trims` command line: a table of commands, each imported only when it runs.

Every command module exposes ``configure(parser)`` (add its arguments; import nothing heavy) and
``run(args) -> int`` (do the work). ``trims --help`` imports none of them, so it stays fast and
works without the optional frameworks.

No Python traceback reaches a user: a :class:`~trims.errors.TrimsError` is printed as its
message, an ``OSError`` (a file that is not there, a port in use) as one line naming the file,
anything else as one line saying it is a bug (``TRIMS_DEBUG=1`` shows the traceback). A closed
stdout (``trims models ls | head -3``) ends the command quietly with status 141, as a shell
reports a process killed by SIGPIPE (see "Note on SIGPIPE" in Python's ``signal`` docs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence

from trims import __version__
from trims.errors import TrimsError

#: command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "daemon": ("trims.daemon.cli", "run the node model-store daemon"),
    "models": ("trims.runtime.models_cli", "add, list, load, pin, evict and remove models"),
    "up": ("trims.runtime.up_cli", "run daemon + gateway + local executor on embedded defaults"),
    "gateway": ("trims.runtime.gateway_cli", "run the HTTP gateway"),
    "functions": ("trims.runtime.functions_cli", "deploy, list, delete and invoke functions"),
    "pipelines": ("trims.runtime.pipelines_cli", "deploy, list, delete and invoke pipelines"),
    "worker": ("trims.runtime.worker_cli", "run a function worker (used inside containers)"),
    "operator": ("trims.operators.cli", "run the Kubernetes operator"),
    "analyze": ("trims.evaluation.cli", "layer IR, lower-bound latency and brick analyses"),
    "trace": ("trims.evaluation.tracing.cli", "leveled across-stack trace of a model"),
    "evaluate": ("trims.evaluation.harness.cli", "evaluate models: manifests, scenarios, results"),
    "kernels": ("trims.kernels.cli", "GPU kernel studies (tcu, klap, transfer, als)"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="trims",
        description="trims: FaaS inference runtime with shared model weights.",
        epilog=f"commands:\n{lines}\n\nrun 'trims COMMAND --help' for a command's options",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="trims [-h] [--version] COMMAND ...",
    )
    parser.add_argument("--version", action="version", version=f"trims {__version__}")
    return parser


#: Exit status after stdout was closed under us: 128 + SIGPIPE, what a shell reports.
EXIT_BROKEN_PIPE = 141
#: Environment variable that lets unexpected errors show their traceback (for bug reports).
DEBUG_ENV = "TRIMS_DEBUG"


def build_parser(name: str) -> argparse.ArgumentParser:
    """The parser of command ``name`` (its module imported and configured)."""
    module_name, help_ = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"trims {name}", description=help_)
    module.configure(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(args)
    except BrokenPipeError:
        return _stdout_closed()


def _main(args: list[str]) -> int:
    top = _top_parser()
    if not args or args[0] not in COMMANDS:
        if args and not args[0].startswith("-"):
            top.error(f"unknown command {args[0]!r}; choose from {', '.join(COMMANDS)}")
        top.parse_args(args)
        top.print_help()
        return 2
    name = args[0]
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        print(f"trims {name}: cannot load {module_name}: {e}", file=sys.stderr)
        return 2
    try:
        ns = build_parser(name).parse_args(args[1:])
        code = int(module.run(ns) or 0)
        sys.stdout.flush()  # inside the try: a closed stdout is not an OSError to report
        return code
    except BrokenPipeError:
        raise
    except TrimsError as e:
        return _fail(name, e.message)
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(name, _os_error_text(e))
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(
            name,
            f"unexpected {type(e).__name__}: {e} (a bug in trims; run again with "
            f"{DEBUG_ENV}=1 to see where, and report it)",
        )


def _fail(name: str, message: str) -> int:
    with contextlib.suppress(OSError):
        print(f"trims {name}: error: {message}", file=sys.stderr)
    return 1


def _os_error_text(e: OSError) -> str:
    """``[Errno 2] No such file or directory: 'x'`` as ``x: no such file or directory``."""
    reason = e.strerror.lower() if e.strerror else str(e)
    if e.filename is not None:
        return f"{e.filename}: {reason}"
    return reason


def _stdout_closed() -> int:
    """Whoever read stdout stopped (``| head``): point stdout at /dev/null so the interpreter's
    final flush cannot raise again, and exit as a process killed by SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
