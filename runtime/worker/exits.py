"""How a worker process ended, in words: exit codes the worker uses and their descriptions.

The executor sees only a wait status; the worker chooses distinctive exit codes for the endings
it knows about so the executor can tell the gateway (and the client's 502) what happened.
"""

from __future__ import annotations

import signal

from trims.config import format_size

#: init(ctx) raised, a model could not be acquired, or the handler could not be imported.
EXIT_INIT_FAILED = 113
#: A handler hit the instance's memory limit (MemoryError); the instance is not reusable.
EXIT_OUT_OF_MEMORY = 114


def describe_returncode(code: int, *, memory_bytes: int | None = None, detail: str = "") -> str:
    """A returncode (negative = killed by that signal) as a reason."""
    suffix = f": {detail}" if detail else ""
    limit = f" (limit {format_size(memory_bytes)})" if memory_bytes else ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL and memory_bytes:
            return f"killed by {name} (possibly out of memory{limit}){suffix}"
        return f"killed by {name}{suffix}"
    if code == EXIT_INIT_FAILED:
        return f"init failed{suffix}"
    if code == EXIT_OUT_OF_MEMORY:
        return f"out of memory{limit}{suffix}"
    return f"exited with code {code}{suffix}"
