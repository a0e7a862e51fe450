"""Typed settings of the HTTP gateway, built once in ``main()`` from argv and the environment.

Nothing here reads the environment at import time; :func:`gateway_settings_from_env` and the CLI
build a :class:`GatewaySettings` and hand it to :func:`trims.runtime.gateway.create_app`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path

from pydantic.dataclasses import dataclass

from trims.errors import ValidationError

#: A gateway name: usable as a Docker label value and a Kubernetes label value.
GATEWAY_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


def check_gateway_name(name: str, what: str = "gateway name") -> None:
    if not GATEWAY_NAME.fullmatch(name):
        raise ValidationError(
            f"{what} {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting and "
            "ending with a letter or digit"
        )


#: A token's name in the tokens file (it appears in logs and error messages).
TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

#: Scopes a token (or an anonymous caller) may hold; ``invoke:<function>`` names one function,
#: ``trace`` lets a caller ask any function it may invoke for a trace (``trims-trace-level``)
#: and read the kept traces, ``trace:<function>`` the same for one function.
PLAIN_SCOPES = frozenset({"admin", "read", "invoke:*", "trace"})
#: Scopes that name one function after their prefix.
FUNCTION_SCOPE_PREFIXES = ("invoke:", "trace:")

#: What a caller without a token may do on a gateway whose admin token was generated and which
#: listens on loopback: invoke any function and read (list, get), so the README's ``curl``
#: examples work; deploying, deleting and every other admin operation need the token.
LOCAL_ANONYMOUS_SCOPES = frozenset({"invoke:*", "read"})


def check_scope(scope: str, owner: str) -> None:
    """Raise ValidationError unless ``scope`` is admin, read, invoke:*, invoke:<function>,
    trace or trace:<function>."""
    if scope in PLAIN_SCOPES:
        return
    prefix = next((p for p in FUNCTION_SCOPE_PREFIXES if scope.startswith(p)), None)
    function = scope.removeprefix(prefix) if prefix else ""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", function):
        raise ValidationError(
            f"{owner} has unknown scope {scope!r}; use admin, read, invoke:<function>, "
            "invoke:*, trace or trace:<function>"
        )


@dataclass(frozen=True)
class Token:
    """One bearer token and what it may do. The secret never appears in ``repr`` or logs."""

    secret: str = field(repr=False)
    #: ``admin`` (deploy, delete, everything), ``read`` (list and get), ``invoke:<function>``
    #: or ``invoke:*``, ``trace`` or ``trace:<function>`` (ask for a trace, read kept traces).
    scopes: frozenset[str] = frozenset()
    #: A name for logs and metrics (``token-1``, or the name given in the tokens file).
    name: str = "token"

    def __post_init__(self) -> None:
        if not TOKEN_NAME.fullmatch(self.name):
            raise ValidationError(
                f"token name {self.name!r} must be 1-64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if len(self.secret) < 8:
            raise ValidationError(f"token {self.name!r} is shorter than 8 characters; use longer")
        if not self.secret.isprintable() or any(c.isspace() for c in self.secret):
            raise ValidationError(
                f"token {self.name!r} contains spaces or control characters; use printable ones"
            )
        for scope in self.scopes:
            check_scope(scope, f"token {self.name!r}")


@dataclass(frozen=True)
class GatewaySettings:
    """Everything `trims gateway` needs."""

    #: Address to listen on. Default loopback: exposing the gateway is an explicit choice.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (tests). 8080 is the usual FaaS gateway port.
    port: int = 8080
    #: Executor name for functions that do not name one ("local", "docker", "kubernetes").
    executor: str = "local"
    #: The store socket handed to instances so their models come from the daemon.
    store_socket: Path | None = None
    #: Bearer tokens. `trims gateway` without a tokens file generates an admin token in the
    #: state directory (see :mod:`trims.runtime.gateway.admin_token`) and puts it here.
    tokens: tuple[Token, ...] = ()
    #: Check credentials. False (``--no-auth``) lets anyone who reaches the port deploy code
    #: and is only ever an explicit choice; with True and no tokens, every operation outside
    #: ``anonymous_scopes`` is refused (fail closed).
    auth: bool = True
    #: Scopes of a request without an ``Authorization`` header (``read``, ``invoke:*``, ...).
    #: Never ``admin``. Default none: every request needs a token.
    anonymous_scopes: frozenset[str] = frozenset()
    #: The generated admin token's file, named in 401 answers so a caller knows where to look.
    admin_token_file: Path | None = None
    #: Roots a function's ``code_dir`` must lie under; empty allows any directory that is not
    #: a system or trims directory (see :mod:`trims.runtime.gateway.code_rules`).
    code_roots: tuple[Path, ...] = ()
    #: The store daemon's directory: refused as a code_dir (function code must not read blobs
    #: or the catalog behind the daemon's back).
    store_dir: Path | None = None
    #: Where deployed function and pipeline specs are kept so a restarted gateway restores them;
    #: None keeps them in memory only.
    state_dir: Path | None = None
    #: Most instances one function may ask for (its min and max); a spec asking for more is
    #: refused, so one deploy cannot fork hundreds of workers on the node.
    instance_limit: int = 64
    #: Most instances on this node across all functions (memory is finite); None = no limit.
    #: At the limit, the least recently used idle instance is stopped to make room.
    max_instances_total: int | None = None
    #: Where the gateway's memory cgroup has a limit (below the machine's memory), the share of
    #: it that the node's working set plus a new instance's expected cost may reach: beyond,
    #: idle instances are stopped to make room, and a request that no instance can serve gets
    #: 503 with Retry-After rather than an instance the kernel would OOM-kill. 0.9 leaves
    #: room for an instance growing while it answers and for the estimate's error. None: off.
    memory_high_watermark: float | None = 0.9
    #: Seconds SIGTERM waits for in-flight requests before instances are stopped.
    drain_timeout_s: float = 30.0
    #: Seconds an async invocation result is kept after it finished.
    invocation_ttl_s: float = 600.0
    #: Async invocations remembered at once; older finished ones are dropped first.
    max_invocations: int = 10_000
    #: Largest request body accepted by any route, bytes; functions set lower limits.
    max_body_bytes: int = 64 << 20
    #: OTLP/HTTP endpoint for traces; None exports nothing. Traced invocations
    #: (``trims-trace-level``) are exported there too, in a background task.
    otlp_endpoint: str | None = None
    #: Traces of traced invocations kept in memory for ``GET /v1/traces/{id}``; the oldest go
    #: first. 100: the last few minutes of someone profiling by hand.
    traces_kept: int = 100
    #: Bytes (of span JSON) those kept traces may hold in all; a layer trace of a large model
    #: is a few MB, so 256 MiB keeps dozens without letting traces grow the gateway unbounded.
    traces_kept_bytes: int = 256 << 20
    #: Prepare the default executor at startup (the local executor starts its zygote), so the
    #: first cold start does not pay for it.
    warm_executor: bool = True
    #: Seconds a client has to send a complete request head after it connects; slower clients
    #: (slowloris) are disconnected. Later requests on a kept-alive connection fall under
    #: ``keepalive_timeout_s``.
    header_timeout_s: float = 10.0
    #: Seconds a request body may stall (no bytes arrive) before the gateway answers 408 and
    #: closes the connection.
    body_timeout_s: float = 30.0
    #: Seconds an idle kept-alive connection stays open (aiohttp's keepalive timeout).
    keepalive_timeout_s: float = 75.0
    #: Most open connections from one peer: one local user on loopback (every address of it,
    #: told by the kernel; see ``runtime/gateway/peer_cred.py``), else one address; more are
    #: answered 503 and closed, so one client cannot take every file descriptor, and one local
    #: user cannot take another's. 256: room for a proxy or a load generator in front of the
    #: gateway, far below ``max_connections`` and the usual fd limit.
    max_connections_per_peer: int = 256
    #: Most open connections in all; more are answered 503 and closed.
    max_connections: int = 4096
    #: Of ``max_connections``, how many only connections that have sent a complete request
    #: head may hold: connections still sending their first head (slowloris holds them there)
    #: share the rest, and a newcomer that finds that share full closes the oldest such
    #: connection of the peer holding the most, rather than being refused. None: a quarter of
    #: ``max_connections`` (1024 of the default 4096), room for the requests being served.
    reserved_connections: int | None = None
    #: Log one line per request (aiohttp access log). Off by default: it costs throughput.
    access_log: bool = False
    #: Answer plain invocations below aiohttp's web layer (Note [invoke fast path] in
    #: ``runtime/gateway/fastpath.py``); off with the access log or when spans are recorded.
    fast_path: bool = True
    #: This gateway's name on its Docker host: its containers carry it, and a gateway started
    #: again under the same name removes the containers a crashed predecessor left. Gateways
    #: sharing a Docker Engine need different names; None sweeps nothing.
    name: str | None = None
    #: Results database the web UI (``/ui/``) reads, read-only: a SQLite path or SQLAlchemy
    #: URL. None: the one ``trims evaluate`` uses by default (:func:`trims.config.results_db`).
    results_db: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValidationError(f"port {self.port} is out of range; use 0..65535")
        if self.drain_timeout_s < 0:
            raise ValidationError("drain timeout must not be negative")
        if self.name is not None:
            check_gateway_name(self.name)
        if self.max_instances_total is not None and self.max_instances_total < 1:
            raise ValidationError("max instances total must be at least 1 (or unset)")
        if self.memory_high_watermark is not None and not 0 < self.memory_high_watermark <= 1:
            raise ValidationError(
                f"memory high watermark {self.memory_high_watermark} must be a share of the "
                "memory limit above 0 and at most 1 (or off)"
            )
        if self.instance_limit < 1:
            raise ValidationError("instance limit must be at least 1")
        if self.max_invocations < 1:
            raise ValidationError("max invocations must be at least 1")
        if self.traces_kept < 0 or self.traces_kept_bytes < 0:
            raise ValidationError("traces kept (count and bytes) must not be negative")
        for scope in self.anonymous_scopes:
            check_scope(scope, "anonymous access")
        if "admin" in self.anonymous_scopes:
            raise ValidationError(
                "anonymous access may not have the admin scope; give admins a token "
                "(or, on a trusted machine only, turn authentication off with --no-auth)"
            )
        for what, value in (
            ("header timeout", self.header_timeout_s),
            ("body timeout", self.body_timeout_s),
            ("keepalive timeout", self.keepalive_timeout_s),
        ):
            if value <= 0:
                raise ValidationError(f"{what} must be > 0 seconds, got {value}")
        if self.max_connections_per_peer < 1 or self.max_connections < 1:
            raise ValidationError("connection limits must be at least 1")
        if not 0 <= self.connections_reserved < self.max_connections:
            raise ValidationError(
                f"reserved connections ({self.connections_reserved}) must be at least 0 and "
                f"below max connections ({self.max_connections}), which leaves room for "
                "connections still sending their request head"
            )
        for root in self.code_roots:
            if not root.is_absolute():
                raise ValidationError(f"code root {root} must be an absolute path")

    @property
    def auth_enabled(self) -> bool:
        return self.auth

    @property
    def connections_reserved(self) -> int:
        """``reserved_connections``, its default worked out."""
        if self.reserved_connections is None:
            return self.max_connections // 4
        return self.reserved_connections


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_state_dir(env: Mapping[str, str], uid: int | None = None) -> Path:
    """Where the gateway keeps its admin token when ``--state-dir`` is not given.

    ``$XDG_STATE_HOME/trims/gateway`` when set (XDG: state that survives restarts but is not
    user data); else ``/var/lib/trims/gateway`` for root (the FHS place for a service's state,
    not root's home); else ``~/.local/state/trims/gateway``.
    """
    if env.get("XDG_STATE_HOME"):
        return Path(env["XDG_STATE_HOME"]) / "trims" / "gateway"
    if (os.getuid() if uid is None else uid) == 0:
        return Path("/var/lib/trims/gateway")
    return Path(env.get("HOME") or Path.home()) / ".local" / "state" / "trims" / "gateway"


def parse_tokens(text: str, source: str) -> tuple[Token, ...]:
    """Tokens from ``SECRET SCOPE[,SCOPE...] [NAME]`` lines (``#`` starts a comment).

    The same format serves the tokens file and ``TRIMS_GATEWAY_TOKENS`` (where ``;`` may
    separate entries instead of newlines).
    """
    tokens: list[Token] = []
    for number, raw in enumerate(text.replace(";", "\n").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3):
            raise ValidationError(
                f"{source} entry {number} must be 'SECRET SCOPE[,SCOPE...] [NAME]'; "
                f"got {len(parts)} fields"
            )
        name = parts[2] if len(parts) == 3 else f"token-{number}"
        scopes = frozenset(s for s in parts[1].split(",") if s)
        tokens.append(Token(secret=parts[0], scopes=scopes, name=name))
    return tuple(tokens)


def load_tokens(path: Path | None, env: Mapping[str, str]) -> tuple[Token, ...]:
    """Tokens from a file and/or ``TRIMS_GATEWAY_TOKENS``; both may be given."""
    tokens: list[Token] = []
    if path is not None:
        try:
            text = path.read_text()
        except OSError as e:
            raise ValidationError(f"cannot read tokens file {path}: {e.strerror}") from e
        tokens.extend(parse_tokens(text, f"tokens file {path}"))
    if env.get("TRIMS_GATEWAY_TOKENS"):
        tokens.extend(parse_tokens(env["TRIMS_GATEWAY_TOKENS"], "TRIMS_GATEWAY_TOKENS"))
    return tuple(tokens)
