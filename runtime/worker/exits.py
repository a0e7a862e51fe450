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


#: The line a worker writes (its log's last words, a pod's termination message) when init fails.
INIT_FAILED_PREFIX = "init failed:"


def init_failure(text: str) -> str:
    """The reason on the last ``init failed: <reason>`` line of ``text`` (a log tail, a
    termination message), or ""."""
    for line in reversed(text.splitlines()):
        _, found, reason = line.partition(INIT_FAILED_PREFIX)
        if found:
            return reason.strip()
    return ""


def describe_container_end(
    exit_code: int, *, oom_killed: bool, memory_limit: int | None, init_text: str = ""
) -> str:
    """A container's (or pod container's) end as a reason, for the docker and kubernetes
    executors alike: the kernel's OOM kill, else the exit code, where the container's PID 1
    reports 128 + N for a worker killed by signal N; ``init_text`` is where the worker's
    ``init failed:`` line may be (its log tail, the pod's termination message)."""
    if oom_killed:
        limit = f" (container limit {format_size(memory_limit)})" if memory_limit else ""
        return f"out of memory{limit}: the kernel OOM-killed the container"
    detail = init_failure(init_text) if exit_code == EXIT_INIT_FAILED else ""
    if exit_code > 128:
        return describe_returncode(-(exit_code - 128), memory_bytes=memory_limit, detail=detail)
    return describe_returncode(exit_code, memory_bytes=memory_limit, detail=detail)
