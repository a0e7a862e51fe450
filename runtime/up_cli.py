"""`trims up`: the whole node on embedded defaults, for a first run.

Starts ``python -m trims daemon`` on the default store socket (or reuses one already running
there), then the gateway with the local executor in this process. ``--examples`` deploys the
example functions in ``examples/`` so they can be invoked with curl at once. Ctrl-C (or SIGTERM)
drains the gateway, stops the instances and then the daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

from trims import daemon_process
from trims.errors import TrimsError, ValidationError

log = logging.getLogger(__name__)

#: The database the example evaluate and trace functions record into (their config.db; under
#: /tmp because their workers run as nobody when trims up runs as root), and so the one the web
#: UI of ``trims up --examples`` reads unless --results-db says otherwise.
EXAMPLES_RESULTS_DB = "/tmp/trims-results/results.sqlite"
DAEMON_START_TIMEOUT_S = 60.0
SPEC_NAMES = ("function.yaml", "function.yml", "function.json")


def own_results_folder(folder: Path, run_as: str | None) -> None:
    """Make ``folder``, where the examples record results, this process's own.

    It sits under /tmp, so another local user could make it first and plant what the web UI
    shows, and a function user that owned it could open it to everyone. So the gateway's user
    owns it and refuses a folder (or a link) someone else made. The user function code runs as
    (``run_as``, when this process is root) gets what SQLite needs to write the database and
    its journal through the folder's group (mode 0770), never the folder's owner or mode.
    """
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValidationError(
            f"{folder}, the examples' results folder, is not a folder ({e.strerror}); remove "
            "it or pass --results-db"
        ) from e
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ValidationError(
                f"{folder}, the examples' results folder, belongs to uid {st.st_uid}, not to "
                f"this gateway's user ({os.geteuid()}): whoever owns it decides what the web UI "
                "shows; remove it (it holds only example results) or pass --results-db"
            )
        if run_as is None:
            os.fchmod(fd, 0o700)
            return
        from trims.runtime.worker.sandbox import resolve_user

        _, gid = resolve_user(run_as)
        os.fchown(fd, -1, gid)
        os.fchmod(fd, stat.S_IRWXU | stat.S_IRWXG)
    finally:
        os.close(fd)


def _records_results(spec: Path) -> bool:
    """Whether the example ``spec`` (the evaluate and trace ones) records into the examples'
    results database; an unreadable spec is skipped, and named, at deploy."""
    from trims.runtime.functions.spec import load_spec_file

    try:
        return load_spec_file(spec).config.get("db") == EXAMPLES_RESULTS_DB
    except TrimsError:
        return False


def configure(parser: argparse.ArgumentParser) -> None:
    from trims.runtime import gateway_cli

    gateway_cli.configure(parser)
    parser.add_argument("--examples", action="store_true", help="deploy the example functions")
    parser.add_argument("--examples-dir", type=Path, help="where the examples are (default: repo)")
    parser.add_argument("--store-dir", type=Path, help="the daemon's store directory")
    parser.add_argument(
        "--daemon-metrics-address",
        metavar="HOST:PORT",
        help="the store daemon serves Prometheus /metrics there (its --metrics-address; "
        "default $TRIMS_METRICS_ADDRESS, else none)",
    )


def _socket_alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def start_daemon(
    store_socket: Path, store_dir: Path | None, metrics_address: str | None = None
) -> subprocess.Popen[bytes] | None:
    """A daemon subprocess on ``store_socket``; None when one already answers there."""
    if _socket_alive(store_socket):
        print(f"using the store daemon already running on {store_socket}", file=sys.stderr)
        return None
    options = {"metrics_address": metrics_address} if metrics_address else {}
    started = daemon_process.start_daemon(
        store_socket, store_dir=store_dir, options=options, timeout_s=DAEMON_START_TIMEOUT_S
    )
    print(f"store daemon started (pid {started.pid}, log {started.log})", file=sys.stderr)
    return started.proc


def stop_daemon(proc: subprocess.Popen[bytes] | None) -> None:
    daemon_process.stop(proc, grace_s=15)


def example_specs(folder: Path) -> list[Path]:
    """``examples/<name>/function.yaml`` (or .yml/.json), sorted by name."""
    found = []
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []:
        for name in SPEC_NAMES:
            if (sub / name).is_file():
                found.append(sub / name)
                break
    return found


def _default_examples_dir() -> Path:
    import trims

    return Path(trims.__file__).resolve().parent.parent / "examples"


async def deploy_examples(url: str, token: str | None, specs: list[Path]) -> list[str]:
    """PUT every example spec to the gateway; names of those deployed."""
    import aiohttp

    from trims.runtime.functions.spec import load_spec_file

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deployed = []
    async with aiohttp.ClientSession(headers=headers) as session:
        for path in specs:
            try:
                spec = load_spec_file(path)
            except Exception as e:
                print(f"example {path.parent.name} skipped: {e}", file=sys.stderr)
                continue
            async with session.put(f"{url}/v1/functions/{spec.name}", json=spec.to_dict()) as r:
                if r.status >= 400:
                    reason = _error_message(await r.text())
                    print(f"example {spec.name} not deployed: {reason}", file=sys.stderr)
                    continue
            deployed.append(spec.name)
    return deployed


def _error_message(body: str) -> str:
    """The message of a gateway error answer (``{"error": {"message"}}``), else the body."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return body.strip()
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(error)


#: Most seconds one example's prepare.py may take (it writes weights and adds them to the store).
PREPARE_TIMEOUT_S = 600.0


async def prepare_examples(specs: list[Path], store_socket: Path) -> list[Path]:
    """Run each example's ``prepare.py`` (weights + store add); the specs ready to deploy.

    An example whose preparation fails is left out with the reason, so the others still come up.
    """
    ready = []
    for spec in specs:
        script = spec.parent / "prepare.py"
        if not script.is_file():
            ready.append(spec)
            continue
        print(f"preparing example {spec.parent.name} ...", file=sys.stderr, flush=True)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            "--socket",
            str(store_socket),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), PREPARE_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            print(f"example {spec.parent.name} skipped: prepare.py timed out", file=sys.stderr)
            continue
        if proc.returncode != 0:
            tail = out.decode(errors="replace").strip().splitlines()[-3:]
            print(
                f"example {spec.parent.name} skipped: prepare.py exited {proc.returncode}: "
                + " | ".join(tail),
                file=sys.stderr,
            )
            continue
        ready.append(spec)
    return ready


async def announce(url: str, token: str | None, specs: list[Path], store_socket: Path) -> None:
    """Prepare and deploy the examples, then print where everything is."""
    specs = await prepare_examples(specs, store_socket) if specs else []
    names = await deploy_examples(url, token, specs) if specs else []
    lines = [
        f"trims is up: gateway {url}",
        f"  API document   {url}/openapi.json",
        f"  metrics        {url}/metrics",
        f"  store socket   {store_socket}",
        f"  web UI         {url}/ui/",
    ]
    from trims.runtime.functions_cli import DEFAULT_URL

    if url.rstrip("/") != DEFAULT_URL:
        # The CLI calls the default address unless told otherwise.
        lines.append(
            f"  CLI            export TRIMS_GATEWAY_URL={url}   (or trims functions --url {url})"
        )
    if names:
        first = "echo" if "echo" in names else names[0]
        lines.append(f"  functions      {', '.join(names)}")
        lines.append(f"  try: curl -d hello {url}/v1/functions/{first}/invoke")
    lines.append(f"trims gateway ready url={url}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import uvloop

    from trims.runtime import gateway_cli
    from trims.runtime.gateway.server import serve
    from trims.telemetry import setup_logging, setup_tracing

    gateway_cli.check_port_free(args.host, args.port)
    setup_logging(args.log_level)
    settings = gateway_cli.with_admin_token(
        gateway_cli.settings_from_args(args, os.environ), os.environ
    )
    if args.examples and not args.results_db and not os.environ.get("TRIMS_RESULTS_DB"):
        # The web UI shows what the example evaluate and trace functions record.
        settings = dataclasses.replace(settings, results_db=EXAMPLES_RESULTS_DB)
    if settings.otlp_endpoint:
        setup_tracing("trims-gateway", settings.otlp_endpoint)
    store_socket = settings.store_socket
    assert store_socket is not None
    admin_token = next((t.secret for t in settings.tokens if "admin" in t.scopes), None)
    specs = example_specs(args.examples_dir or _default_examples_dir()) if args.examples else []
    local = gateway_cli.local_options(args)
    if any(_records_results(spec) for spec in specs):
        from trims.runtime.worker.sandbox import effective_run_as

        run_as = effective_run_as(local.get("run_as")) if os.geteuid() == 0 else None
        own_results_folder(Path(EXAMPLES_RESULTS_DB).parent, run_as)
    tasks: set[asyncio.Task[None]] = set()

    def ready(url: str) -> None:
        task = asyncio.get_running_loop().create_task(
            announce(url, admin_token, specs, store_socket), name="trims-announce"
        )
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    daemon = start_daemon(store_socket, args.store_dir, args.daemon_metrics_address)
    try:
        factory = gateway_cli.executor_factory(settings, local)
        uvloop.run(serve(settings, factory, on_ready=ready))
    finally:
        stop_daemon(daemon)
    return 0
