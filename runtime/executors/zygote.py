"""The zygote: a process that has imported the heavy frameworks once and forks workers on request.

A cold instance forked from it pays neither interpreter start nor ``import torch``: the child
inherits the imported modules copy-on-write and goes straight to the worker's main.

Protocol (newline-delimited JSON over a socketpair; the executor holds the other end)::

    zygote -> executor  {"event": "ready", "pid", "preloaded", "warmed"}        once, after imports
    executor -> zygote  {"op": "fork", "id", "argv", "env", "cwd", "log", "store"}  start a worker
    zygote -> executor  {"event": "forked", "id", "pid"} | {"event": "error", "id", "message"}
    executor -> zygote  {"op": "signal", "pid", "signal"}                      to its process group
    zygote -> executor  {"event": "exit", "pid", "status"}                     raw wait status
    executor -> zygote  {"op": "pool", "size", "run_as", "store_socket", "tracing"}  warm pool

Note [warm pool]: with ``pool`` size k > 0 the zygote keeps k workers forked ahead of need, each
already confined as far as it can be without knowing its function: signals reset, its own
process group, dropped to the ``run_as`` user (never root: the same
:func:`~trims.runtime.worker.sandbox.confine` as any worker) and tied to the zygote's life. It
then waits on its end of a socketpair. A ``fork`` request takes the oldest pooled worker: the
zygote opens the instance's log and, when the worker dropped privileges, a connection to the
store (both as a fresh fork would, with the zygote's rights: the store socket may be closed to
the ``run_as`` user), passes the descriptors and the request over that socketpair and reports
the pooled worker's pid as ``forked``; the worker takes its log, cwd, environment and memory
limit from the request, greets the store on that connection when it first needs a model, and
runs that one instance, then exits like any other: a pooled worker is never reused. (Pooled
workers once connected to the store before their drop and then waited: the daemon closes a
connection without leases after its idle timeout, 60 s by default, and the worker, no longer
allowed to connect, failed its start.) The daemon sees the zygote as the process that
connected (``connected_pid`` in the lease table; the uid is the zygote's, as it is for a fork's
own connection, made before its drop) and the worker as the one that acquired (``pid``: Note
[request sender] in trims.daemon.connection); a function without models gets no connection.
The pool is refilled when the zygote has no request waiting, a moment after the last take (the
fork of its replacement would otherwise compete for the CPU with the instance that just
started). A
pooled worker that dies before it is taken is reaped silently; after a few such deaths in a
row the pool stops refilling (logged), so a broken setup never turns into a fork loop; starts
then fork as without a pool. A waiting pooled worker costs about 7 MiB of private memory
(``smaps_rollup`` of one beside its zygote with torch imported: Private_Dirty 7.2 MiB), one
process of the ``run_as`` user, and no store connection.

Note [start rehearsal]: a forked worker pays for the first run of everything it does: the
pages of the zygote's heap it writes to (reference counts, caches, the allocator's lists) are
copied one 4 KiB page fault at a time, and lazily built state is built then. A pooled worker
rehearses, before its request, the steps of a start that do not depend on the function
(:func:`_rehearse`): it sets up logging, parses a worker's arguments and a spec with a model
and a V2 signature (argparse, the spec's validators), and makes its event loop and runs it
once; ``run_worker`` then runs the instance on that loop. Measured in a pooled start of
``bench/peers.py``'s model (worker log ``start phases``, 5 starts each): 740 page faults after
the hand-over instead of 1,400, and from the hand-over to init done 7.7-8.5 ms instead of
11.4-12.2 (arguments and spec 2.2 -> 1.1 ms, logging 0.9 -> 0.3, loop and socket 2.1 -> 1.1).

Note [fork safety]: the invariants that keep a fork of this process a working worker.

* The zygote starts no framework thread pool: it imports the frameworks and runs their
  warm-up on one thread (Note [zygote warm-up] in :mod:`trims.runtime.executors.warmup`), and
  nothing else of theirs. OpenMP and other thread pools that torch creates on first
  multi-threaded use do not survive ``fork``; a child that inherited a half-initialised pool
  would deadlock on its first matmul. (Importing numpy starts OpenBLAS's pool, which
  re-initialises itself in the child through its ``pthread_atfork`` handlers; the zygote's
  own loop is single-threaded.)
* The zygote is the parent of every worker, so it reaps them (SIGCHLD -> ``waitpid``) and
  reports each exit status: there are no zombies, and a pid it signals is always its own live
  (or not yet reaped) child, never a recycled one.
* When the executor goes away (EOF on the socket, or its death via PR_SET_PDEATHSIG), the
  zygote kills every worker's process group, reaps them, kills what they leave behind (Note
  [leftovers]) and exits.

Note [leftovers]: the zygote is a child subreaper, and so is every worker (Note [an instance's
processes end with it] in :mod:`trims.runtime.worker.sandbox`). A process function code
started is reparented to its worker while the worker lives, so a child of the zygote that is
not a worker can only be what a worker left when it died without ending its own processes
(SIGKILL after the drain timeout, out of memory, a crash): the zygote kills every such child
each time it reaps something, and reaps them without a report (the executor never heard of
them). A leftover's own children come to the zygote when it dies, and the next round kills
them.

Note [zygote imports as root]: the zygote runs as the executor's user (root on a node) and its
children drop to the unprivileged ``run_as`` user. It imports every module a worker needs
(:data:`trims.runtime.worker.imports.WORKER_MODULES`) so that a worker never has to read the
project's files after the drop: they may sit where that user cannot read them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from trims.errors import Unavailable, ValidationError

log = logging.getLogger(__name__)

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


# --- zygote side (a separate process: python -m trims.runtime.executors.zygote) ------------


def _preload(modules: Sequence[str]) -> list[str]:
    """The frameworks, then everything a worker imports (Note [zygote imports as root])."""
    from trims.runtime.worker.imports import WORKER_MODULES, preimport

    return preimport([*modules, *(m for m in WORKER_MODULES if m not in modules)])


#: Pooled workers that may die unbound in a row before the pool stops refilling.
_POOL_FAILURES = 3
#: Seconds after a start took a pooled worker before its replacement is forked: forking a
#: process that has torch imported, and confining the child, compete for the CPU with the
#: starting instance (on 2 cores it made a pooled start slower than a plain fork).
_REFILL_DELAY_S = 0.25
#: Seconds the zygote waits to connect a pooled worker to the store at hand-over.
_STORE_CONNECT_TIMEOUT_S = 0.5


class _ZygoteServer:
    """The zygote process's side: reads fork and signal requests, forks, reaps, reports."""

    def __init__(self, sock: socket.socket, parent_pid: int) -> None:
        self.sock = sock
        self.parent_pid = parent_pid
        self.children: set[int] = set()
        #: Pooled, not yet bound workers (Note [warm pool]): pid -> the zygote's socket end.
        self.pool: dict[int, socket.socket] = {}
        self.pool_config: dict[str, Any] = {}
        #: The store socket the zygote connects pooled workers to at hand-over (None: they
        #: connect themselves), decided once per pool configuration.
        self.pool_store_socket: str | None = None
        #: Pooled workers sent away unbound (the pool shrank): reaped without a report.
        self.retired: set[int] = set()
        self.pool_size = 0
        self.pool_failures = 0
        self.refill_at = 0.0
        self.buf = b""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        self.sel = selectors.DefaultSelector()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def serve(self, preloaded: list[str], warmed: list[str]) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # Blocked, not ignored: a child inherits the mask, so a SIGTERM sent to a worker before
        # it has reset its signals stays pending and is acted on, where an ignored one is lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        self.sel.register(self.sock, selectors.EVENT_READ)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.send({"event": "ready", "pid": os.getpid(), "preloaded": preloaded, "warmed": warmed})
        try:
            while True:
                for key, _ in self.sel.select(self._refill_timeout()):
                    if key.fileobj is self.sock:
                        if not self._read_requests():
                            return
                    else:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self.wake_r, 4096)
                self._reap()
                self._fill_pool()
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
            pid = self._take_pooled(req)
            if pid is None:
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
        elif req["op"] == "pool":
            self.pool_size = max(0, int(req["size"]))
            self.pool_config = req
            self.pool_store_socket = _handed_store_socket(req)
            self.pool_failures = 0
            for pid in list(self.pool)[self.pool_size :]:
                self.pool.pop(pid).close()  # EOF: the pooled worker exits
                self.retired.add(pid)
        elif req["op"] == "signal":
            pid = int(req["pid"])
            if pid in self.children:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, int(req["signal"]))

    def _refill_timeout(self) -> float | None:
        """How long the loop may block: until a deferred refill is due (None: no limit)."""
        if len(self.pool) >= self.pool_size or self.pool_failures >= _POOL_FAILURES:
            return None
        return max(0.0, self.refill_at - time.monotonic())

    def _fill_pool(self) -> None:
        """Fork pooled workers up to the pool size (Note [warm pool]), when no request waits
        and the last take is :data:`_REFILL_DELAY_S` old."""
        if time.monotonic() < self.refill_at:
            return
        while len(self.pool) < self.pool_size and self.pool_failures < _POOL_FAILURES:
            if self.sel.select(0):
                return  # a request (or a child's exit) first; refill on the next round
            ours, theirs = socket.socketpair()
            try:
                pid = os.fork()
            except OSError as e:
                ours.close()
                theirs.close()
                print(f"zygote: warm pool not refilled: fork failed: {e}", file=sys.stderr)
                return
            if pid == 0:
                ours.close()
                self._pooled_child(theirs)
            theirs.close()
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)
            self.children.add(pid)
            self.pool[pid] = ours

    def _take_pooled(self, req: dict[str, Any]) -> int | None:
        """Hand ``req`` to the oldest live pooled worker; its pid, or None (fork instead)."""
        while self.pool:
            pid = next(iter(self.pool))
            sock = self.pool.pop(pid)
            try:
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                             0o640)  # fmt: skip
            except OSError:
                self.pool[pid] = sock  # the fresh fork reports the same failure in its log
                return None
            path = self.pool_store_socket if req.get("store", True) else None
            store = None if path is None else _store_connection(path)
            try:
                fds = [fd] if store is None else [fd, store.fileno()]
                socket.send_fds(sock, [b"L"], fds)
                sock.sendall(json.dumps(req).encode())
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                continue  # it died unbound; _reap drops it
            finally:
                os.close(fd)
                sock.close()
                if store is not None:
                    store.close()
            self.pool_failures = 0
            self.refill_at = time.monotonic() + _REFILL_DELAY_S
            return pid
        return None

    def _reap(self) -> None:
        reaped = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped = True
            if pid not in self.children:
                continue  # a leftover (Note [leftovers])
            self.children.discard(pid)
            if pid in self.retired:
                self.retired.discard(pid)
                continue
            sock = self.pool.pop(pid, None)
            if sock is not None:
                # Died unbound: the executor never heard of it (Note [warm pool]).
                sock.close()
                self.pool_failures += 1
                if self.pool_failures >= _POOL_FAILURES:
                    print(
                        f"zygote: {_POOL_FAILURES} pooled workers died before use (the last "
                        f"with wait status {status}; see above); the warm pool is off and "
                        "instances fork at start",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
                continue
            with contextlib.suppress(OSError):
                self.send({"event": "exit", "pid": pid, "status": status})
        if reaped:
            self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """SIGKILL every child that is not a worker (Note [leftovers]); reaped by :meth:`_reap`
        on their SIGCHLD."""
        from trims.runtime.worker.sandbox import children_of

        for pid in children_of(os.getpid()) - self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def _shutdown(self) -> None:
        from trims.runtime.worker.sandbox import end_children

        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in list(self.children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.children.clear()
        end_children()

    def _leave_zygote(self) -> None:
        """In a forked child: drop the zygote's loop, sockets and signal set-up."""
        signal.set_wakeup_fd(-1)
        self.sel.close()
        self.sock.close()
        for sock in self.pool.values():
            sock.close()
        self.pool.clear()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for sig in (signal.SIGCHLD, *_STOP_SIGNALS):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)

    def _child(self, req: dict[str, Any]) -> None:
        """In the forked child: become a clean worker process, run it, never return."""

        def run() -> int:
            _mark("forked")
            self._leave_zygote()
            fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
            _bind(req, fd)
            _reseed()
            return _run_worker_argv(req["argv"])

        _exit_with(run)

    def _pooled_child(self, sock: socket.socket) -> None:
        """A pooled worker (Note [warm pool]): confine, wait for a request, run it; never
        returns. Before its request it writes to the zygote's stderr."""

        def run() -> int:
            from trims.runtime.worker.sandbox import close_inherited_fds

            self._leave_zygote()
            close_inherited_fds(keep=(sock.fileno(),))  # Note [what a worker inherits]
            prepared = _prepare_pooled(self.pool_config)
            received = _receive_request(sock)
            if received is None:
                return 0  # the pool shrank or the zygote is closing
            req, fd, store_fd = received
            _mark("taken")
            _bind(req, fd)
            return _run_worker_argv(req["argv"], _with_store(prepared, store_fd))

        _exit_with(run)


def _exit_with(run: Callable[[], int]) -> NoReturn:
    """In a forked child: ``run()``, then leave with its status, never returning into the
    zygote's code (SystemExit's code kept, any other exception printed: status 1)."""
    rc = 1
    try:
        rc = run()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(rc)


def _mark(phase: str) -> None:
    """A step of the worker's start (:class:`trims.runtime.worker.runner.StartPhases`)."""
    from trims.runtime.worker.runner import PHASES

    PHASES.mark(phase)


def _bind(req: dict[str, Any], log_fd: int) -> None:
    """Take the request's log (``log_fd``, closed here), cwd and environment.

    A pooled worker has dropped privileges already: a working directory its user may not enter
    (a code folder made unreadable after deploy) leaves it in ``/``, said in its log, and the
    worker's own check of the code folder then fails the start with the folder and the user,
    as in a fresh fork, which enters the directory before its drop."""
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    try:
        os.chdir(req["cwd"])
    except OSError as e:
        print(f"zygote: cannot enter the working directory ({e}); running in /", file=sys.stderr)
        os.chdir("/")
    os.environ.clear()
    os.environ.update(req["env"])


def _prepare_pooled(config: Mapping[str, Any]) -> Any:
    """Everything a pooled worker does before it knows its function (Note [warm pool])."""
    from trims.runtime.worker.imports import TRACING_MODULES, preimport
    from trims.runtime.worker.runner import Prestarted
    from trims.runtime.worker.sandbox import Confinement, confine

    _reseed()
    if config.get("tracing"):
        preimport(TRACING_MODULES)
    run_as = config.get("run_as")
    dropped_to = confine(Confinement(run_as=run_as, parent_pid=os.getppid()))
    return Prestarted(run_as=run_as, dropped_to=dropped_to, loop=_rehearse())


def _handed_store_socket(config: Mapping[str, Any]) -> str | None:
    """The store socket the zygote connects this pool's workers to when it hands them a request
    (Note [warm pool]): only when they drop privileges (the socket may be closed to their
    user); None when they can connect themselves, or when their user is not valid (then they
    fail their own confinement, and the pool turns itself off)."""
    from trims.config import default_socket
    from trims.runtime.worker.sandbox import effective_run_as

    if os.geteuid() != 0:
        return None
    try:
        if effective_run_as(config.get("run_as")) is None:
            return None
    except ValidationError:
        return None
    return str(config.get("store_socket") or default_socket(os.environ))


def _store_connection(path: str) -> socket.socket | None:
    """A connection to the store at ``path`` for a pooled worker, made at hand-over; None when
    the store does not answer now (the worker then tries itself, and says so)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_STORE_CONNECT_TIMEOUT_S)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _with_store(prepared: Any, store_fd: int | None) -> Any:
    """``prepared`` holding the store connection the zygote handed over, if any."""
    if store_fd is None:
        return prepared
    return dataclasses.replace(prepared, store_connection=socket.socket(fileno=store_fd))


#: A worker's arguments for :func:`_rehearse`: a spec with a model and a V2 signature, so the
#: parse runs through the validators real specs meet.
_REHEARSAL_SPEC = {
    "name": "rehearsal",
    "handler": "rehearsal:handler",
    "models": [{"name": "model", "alias": "weights"}],
    "serves": {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}],
    },
}
_REHEARSAL_ARGV = [
    "--spec-json", json.dumps(_REHEARSAL_SPEC), "--listen", "unix:/nonexistent/rehearsal.sock",
    "--instance-id", "rehearsal", "--parent-pid", "1",
]  # fmt: skip


def _rehearse() -> asyncio.AbstractEventLoop | None:
    """Run ahead, in a pooled worker, the steps of a start that do not depend on its function
    (Note [start rehearsal]); the event loop it made and ran once (None if that failed)."""
    import uvloop

    from trims.runtime import worker_cli
    from trims.telemetry import setup_logging

    try:
        setup_logging(os.environ.get("TRIMS_LOG_LEVEL", "INFO"))
        worker_cli.settings_from_args(_worker_parser().parse_args(_REHEARSAL_ARGV))
        loop = uvloop.new_event_loop()
        loop.run_until_complete(asyncio.sleep(0))
    except (Exception, SystemExit):  # an optimisation, never a reason for the worker to fail
        traceback.print_exc()  # SystemExit: argparse refused the arguments
        return None
    return loop


def _receive_request(sock: socket.socket) -> tuple[dict[str, Any], int, int | None] | None:
    """Block until the zygote hands this pooled worker a request: (request, log fd, store
    connection fd or None), or None on EOF (never bound)."""
    try:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 2)
        if not msg or not fds:
            return None
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    finally:
        sock.close()
    return json.loads(b"".join(chunks)), fds[0], (fds[1] if len(fds) > 1 else None)


def _reseed() -> None:
    """Forked children would share the zygote's random state; give each its own.

    torch: the CPU generator (the one the zygote holds) and CUDA's, which is seeded when CUDA
    initialises in the child; ``torch.seed()`` did the same plus other device types, at 3-6 ms
    of a start.
    """
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        seed = torch.default_generator.seed()
        torch.cuda.manual_seed_all(seed)


@functools.cache
def _worker_parser() -> argparse.ArgumentParser:
    """Built once in the zygote (see zygote_main) so each child skips argparse's set-up."""
    from trims.runtime import worker_cli

    parser = argparse.ArgumentParser(prog="trims worker")
    worker_cli.configure(parser)
    return parser


def _run_worker_argv(argv: list[str], prestarted: Any = None) -> int:
    from trims.runtime import worker_cli
    from trims.runtime.worker.runner import run_worker

    args = _worker_parser().parse_args(argv)
    if args.log_level:
        os.environ["TRIMS_LOG_LEVEL"] = args.log_level
    return run_worker(worker_cli.settings_from_args(args), prestarted)


def zygote_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trims.runtime.executors.zygote")
    parser.add_argument("--fd", type=int, required=True, help="socket to the executor")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--preload", default="numpy,torch,onnxruntime")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    from trims.runtime.executors.warmup import warm_up
    from trims.runtime.worker.sandbox import (
        become_subreaper,
        close_inherited_fds,
        die_with_parent,
    )

    die_with_parent(args.parent_pid)
    close_inherited_fds(keep=(args.fd,))  # Note [what a worker inherits]
    become_subreaper()  # Note [leftovers]
    preloaded = _preload([m for m in args.preload.split(",") if m])
    warmed = warm_up(preloaded)
    _worker_parser()
    # Everything imported so far lives as long as the zygote: keep the collector away from it
    # so that a child's collections do not write to (and so copy) every page of it.
    gc.collect()
    gc.freeze()
    _ZygoteServer(sock, args.parent_pid).serve(preloaded, warmed)
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
        #: the preloaded frameworks whose warm-up ran (Note [zygote warm-up])
        self.warmed: list[str] = []
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
        zygote.warmed = list(ready.get("warmed", ()))
        zygote._events = asyncio.get_running_loop().create_task(
            zygote._read_events(), name="zygote-events"
        )
        log.info("zygote %d ready in %.2f s with %s preloaded (%s warmed up)", process.pid,
                 time.perf_counter() - t0, ", ".join(zygote.preloaded),
                 ", ".join(zygote.warmed) or "none")  # fmt: skip
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
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        log_path: str,
        store: bool = True,
    ) -> ZygoteChild:
        """A worker running ``argv``; ``store``: whether it will use the model store (a pooled
        worker is then handed a connection: Note [warm pool])."""
        if not self.alive():
            raise Unavailable(self.error or "zygote process is not running")
        rid = self._next_id
        self._next_id += 1
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._forks[rid] = fut
        self._send(
            {"op": "fork", "id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd,
             "log": log_path, "store": store}
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

    def set_pool(
        self, size: int, *, run_as: str | None, store_socket: str | None, tracing: bool
    ) -> None:
        """Keep ``size`` workers forked ahead of need (Note [warm pool]); 0 turns it off."""
        if self.alive():
            self._send({"op": "pool", "size": int(size), "run_as": run_as,
                        "store_socket": store_socket, "tracing": tracing})  # fmt: skip

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
