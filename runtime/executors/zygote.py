"""The zygote: a process that has imported the heavy frameworks once and forks workers on request.

A cold instance forked from it pays neither interpreter start nor ``import torch``: the child
inherits the imported modules copy-on-write and goes straight to the worker's main.

Protocol (newline-delimited JSON over a socketpair; the executor holds the other end)::

    zygote -> executor  {"event": "ready", "pid", "preloaded": [...]}           once, after imports
    executor -> zygote  {"op": "fork", "id", "argv", "env", "cwd", "log"}      start a worker
    zygote -> executor  {"event": "forked", "id", "pid"} | {"event": "error", "id", "message"}
    executor -> zygote  {"op": "signal", "pid", "signal"}                      to its process group
    zygote -> executor  {"event": "exit", "pid", "status"}                     raw wait status

Note [fork safety]: the invariants that keep a fork of this process a working worker.

* The zygote never runs framework code: imports only. OpenMP and other thread pools that
  torch creates on first use do not survive ``fork``; a child that inherited a half-initialised
  pool would deadlock on its first matmul. (Importing numpy starts OpenBLAS's pool, which
  re-initialises itself in the child through its ``pthread_atfork`` handlers; the zygote's
  own loop is single-threaded.)
* The zygote is the parent of every worker, so it reaps them (SIGCHLD -> ``waitpid``) and
  reports each exit status: there are no zombies, and a pid it signals is always its own live
  (or not yet reaped) child, never a recycled one.
* When the executor goes away (EOF on the socket, or its death via PR_SET_PDEATHSIG), the
  zygote kills every worker's process group, reaps them and exits.

Note [zygote imports as root]: the zygote runs as the executor's user (root on a node) and its
children drop to the unprivileged ``run_as`` user. It imports every module a worker needs
(:data:`trims.runtime.worker.imports.WORKER_MODULES`) so that a worker never has to read the
project's files after the drop: they may sit where that user cannot read them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from trims.errors import Unavailable

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# --- zygote side (a separate process: python -m trims.runtime.executors.zygote) ------------


def _preload(modules: Sequence[str]) -> list[str]:
    """The frameworks, then everything a worker imports (Note [zygote imports as root])."""
    from trims.runtime.worker.imports import WORKER_MODULES, preimport

    return preimport([*modules, *(m for m in WORKER_MODULES if m not in modules)])


class _ZygoteServer:
    """The zygote process's side: reads fork and signal requests, forks, reaps, reports."""

    def __init__(self, sock: socket.socket, parent_pid: int) -> None:
        self.sock = sock
        self.parent_pid = parent_pid
        self.children: set[int] = set()
        self.buf = b""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.sel = selectors.DefaultSelector()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def serve(self, preloaded: list[str]) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # Blocked, not ignored: a child inherits the mask, so a SIGTERM sent to a worker before
        # it has reset its signals stays pending and is acted on, where an ignored one is lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.send({"event": "ready", "pid": os.getpid(), "preloaded": preloaded})
        try:
            while True:
                for key, _ in self.sel.select():
                    if key.fileobj is self.sock:
                        if not self._read_requests():
                            return
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self.wake_r, 4096)
                self._reap()
        finally:
            self._shutdown()

    def _read_requests(self) -> bool:
        data = self.sock.recv(1 << 16)
        if not data:
            return False
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            self._handle(json.loads(line))
        return True

    def _handle(self, req: dict[str, Any]) -> None:
        if req["op"] == "fork":
            try:
                pid = os.fork()
            except OSError as e:
                self.send({"event": "error", "id": req["id"], "message": f"fork failed: {e}"})
                return
            if pid == 0:
                self._child(req)
            # The child also calls setpgid; doing it here too closes the race with a signal
            # sent to its group before the child got that far (the shells' job-control idiom).
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)
            self.children.add(pid)
            self.send({"event": "forked", "id": req["id"], "pid": pid})
        elif req["op"] == "signal":
            pid = int(req["pid"])
            if pid in self.children:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, int(req["signal"]))

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            with contextlib.suppress(OSError):
                self.send({"event": "exit", "pid": pid, "status": status})

    def _shutdown(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.children.clear()

    def _child(self, req: dict[str, Any]) -> None:
        """In the forked child: become a clean worker process, run it, never return."""
        rc = 1
        try:
            signal.set_wakeup_fd(-1)
            self.sel.close()
            self.sock.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
            for sig in (signal.SIGCHLD, *_STOP_SIGNALS):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            os.setpgid(0, 0)
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.chdir(req["cwd"])
            os.environ.clear()
            os.environ.update(req["env"])
            _reseed()
            rc = _run_worker_argv(req["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(rc)


def _reseed() -> None:
    """Forked children would share the zygote's random state; give each its own."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


@functools.cache
def _worker_parser() -> argparse.ArgumentParser:
    """Built once in the zygote (see zygote_main) so each child skips argparse's set-up."""
    from trims.runtime import worker_cli

    parser = argparse.ArgumentParser(prog="trims worker")
    worker_cli.configure(parser)
    return parser


def _run_worker_argv(argv: list[str]) -> int:
    from trims.runtime import worker_cli
    from trims.runtime.worker.runner import run_worker

    args = _worker_parser().parse_args(argv)
    if args.log_level:
        os.environ["TRIMS_LOG_LEVEL"] = args.log_level
    return run_worker(worker_cli.settings_from_args(args))


def zygote_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trims.runtime.executors.zygote")
    parser.add_argument("--fd", type=int, required=True, help="socket to the executor")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--preload", default="numpy,torch,onnxruntime")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    from trims.runtime.worker.sandbox import die_with_parent

    die_with_parent(args.parent_pid)
    preloaded = _preload([m for m in args.preload.split(",") if m])
    _worker_parser()
    _ZygoteServer(sock, args.parent_pid).serve(preloaded)
    return 0


# --- executor side -------------------------------------------------------------------------


class ZygoteChild:
    """A worker forked by the zygote; ``wait`` returns a returncode (negative = signal)."""

    def __init__(self, zygote: ZygoteHandle, pid: int) -> None:
        self.pid = pid
        self._zygote = zygote
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _set_status(self, status: int) -> None:
        code = os.waitstatus_to_exitcode(status)
        self.returncode = code
        if not self._exited.done():
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._zygote.signal(self.pid, sig)


class ZygoteHandle:
    """The executor's side: starts the zygote process and asks it to fork and signal workers."""

    def __init__(
        self, process: asyncio.subprocess.Process, reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:  # fmt: skip
        self.process = process
        self._reader = reader
        self._writer = writer
        self._next_id = 1
        self._forks: dict[int, asyncio.Future[int]] = {}
        self._children: dict[int, ZygoteChild] = {}
        self._early_exits: dict[int, int] = {}
        self.preloaded: list[str] = []
        self._events: asyncio.Task[None] | None = None
        self.error: str | None = None
        self._closing = False

    @classmethod
    async def start(
        cls, *, python: str, preload: Sequence[str], env: Mapping[str, str], timeout: float = 120.0
    ) -> ZygoteHandle:
        ours, theirs = socket.socketpair()
        t0 = time.perf_counter()
        try:
            process = await asyncio.create_subprocess_exec(
                python, "-m", "trims.runtime.executors.zygote",
                "--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid()),
                "--preload", ",".join(preload),
                pass_fds=(theirs.fileno(),), env=dict(env), start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        zygote = cls(process, reader, writer)
        try:
            ready = json.loads(await asyncio.wait_for(reader.readline(), timeout) or b"null")
        except TimeoutError:
            ready = None
        if not isinstance(ready, dict) or ready.get("event") != "ready":
            await zygote.close()
            raise Unavailable(
                f"zygote process did not start (exit code {process.returncode}); see the log above"
            )
        zygote.preloaded = list(ready["preloaded"])
        zygote._events = asyncio.get_running_loop().create_task(
            zygote._read_events(), name="zygote-events"
        )
        log.info("zygote %d ready in %.2f s with %s preloaded", process.pid,
                 time.perf_counter() - t0, ", ".join(zygote.preloaded))  # fmt: skip
        return zygote

    async def _read_events(self) -> None:
        while True:
            line = await self._reader.readline()
            if not line:
                break
            event = json.loads(line)
            kind = event.get("event")
            if kind == "forked":
                fut = self._forks.pop(event["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(int(event["pid"]))
            elif kind == "error":
                fut = self._forks.pop(event["id"], None)
                if fut is not None and not fut.done():
                    fut.set_exception(
                        Unavailable(f"zygote could not start a worker: {event['message']}")
                    )
            elif kind == "exit":
                pid, status = int(event["pid"]), int(event["status"])
                child = self._children.pop(pid, None)
                if child is not None:
                    child._set_status(status)
                else:
                    self._early_exits[pid] = status
        self.error = f"zygote process exited (code {await self.process.wait()})"
        if not self._closing:
            log.error("%s; its workers were killed with it", self.error)
        for fut in self._forks.values():
            if not fut.done():
                fut.set_exception(Unavailable(self.error))
        for child in self._children.values():
            child._set_status(signal.SIGKILL)
        self._children.clear()

    def alive(self) -> bool:
        return self.error is None and self.process.returncode is None

    def _send(self, message: dict[str, Any]) -> None:
        self._writer.write(json.dumps(message).encode() + b"\n")

    async def fork(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str, log_path: str
    ) -> ZygoteChild:
        if not self.alive():
            raise Unavailable(self.error or "zygote process is not running")
        rid = self._next_id
        self._next_id += 1
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._forks[rid] = fut
        self._send(
            {"op": "fork", "id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd,
             "log": log_path}
        )  # fmt: skip
        pid = await fut
        child = ZygoteChild(self, pid)
        if pid in self._early_exits:
            child._set_status(self._early_exits.pop(pid))
        else:
            self._children[pid] = child
        return child

    def signal(self, pid: int, sig: int) -> None:
        if self.alive():
            self._send({"op": "signal", "pid": pid, "signal": int(sig)})

    async def close(self) -> None:
        """EOF to the zygote: it kills and reaps its workers, then exits."""
        self._closing = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        try:
            await asyncio.wait_for(self.process.wait(), 10.0)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
        if self._events is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._events


if __name__ == "__main__":
    sys.exit(zygote_main())
