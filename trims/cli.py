"""`trims` command line: a table of commands, each imported only when it runs.

Every command module exposes ``configure(parser)`` (add its arguments; import nothing heavy) and
``run(args) -> int`` (do the work). ``trims --help`` imports none of them, so it stays fast and
works without the optional frameworks.
"""

from __future__ import annotations

import argparse
import importlib
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


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not args or args[0] not in COMMANDS:
        if args and not args[0].startswith("-"):
            top.error(f"unknown command {args[0]!r}; choose from {', '.join(COMMANDS)}")
        top.parse_args(args)
        top.print_help()
        return 2
    name = args[0]
    module_name, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        print(f"trims {name}: cannot load {module_name}: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"trims {name}", description=help_)
    module.configure(parser)
    ns = parser.parse_args(args[1:])
    try:
        return int(module.run(ns) or 0)
    except TrimsError as e:
        print(f"trims {name}: error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
