"""Typed settings of the HTTP gateway, built once in ``main()`` from argv and the environment.

Nothing here reads the environment at import time; :func:`gateway_settings_from_env` and the CLI
build a :class:`GatewaySettings` and hand it to :func:`trims.runtime.gateway.create_app`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trims.errors import ValidationError

#: A gateway name: usable as a Docker label value and a Kubernetes label value.
GATEWAY_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")


def check_gateway_name(name: str, what: str = "gateway name") -> None:
    if not GATEWAY_NAME.fullmatch(name):
        raise ValidationError(
            f"{what} {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting and "
            "ending with a letter or digit"
        )


@dataclass(frozen=True)
class Token:
    """One bearer token and what it may do. The secret never appears in ``repr`` or logs."""

    secret: str = field(repr=False)
    #: ``admin`` (deploy, delete, everything), ``invoke:<function>`` or ``invoke:*``.
    scopes: frozenset[str] = frozenset()
    #: A name for logs and metrics (``token-1``, or the name given in the tokens file).
    name: str = "token"

    def __post_init__(self) -> None:
        if len(self.secret) < 8:
            raise ValidationError(f"token {self.name!r} is shorter than 8 characters; use longer")
        for scope in self.scopes:
            if scope != "admin" and not (scope.startswith("invoke:") and len(scope) > 7):
                raise ValidationError(
                    f"token {self.name!r} has unknown scope {scope!r}; "
                    "use admin, invoke:<function> or invoke:*"
                )


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
    #: Bearer tokens; empty disables authentication (local development on loopback only).
    tokens: tuple[Token, ...] = ()
    #: Where deployed function and pipeline specs are kept so a restarted gateway restores them;
    #: None keeps them in memory only.
    state_dir: Path | None = None
    #: Most instances one function may ask for (its min and max); a spec asking for more is
    #: refused, so one deploy cannot fork hundreds of workers on the node.
    instance_limit: int = 64
    #: Most instances on this node across all functions (memory is finite); None = no limit.
    #: At the limit, the least recently used idle instance is stopped to make room.
    max_instances_total: int | None = None
    #: Seconds SIGTERM waits for in-flight requests before instances are stopped.
    drain_timeout_s: float = 30.0
    #: Seconds an async invocation result is kept after it finished.
    invocation_ttl_s: float = 600.0
    #: Async invocations remembered at once; older finished ones are dropped first.
    max_invocations: int = 10_000
    #: Largest request body accepted by any route, bytes; functions set lower limits.
    max_body_bytes: int = 64 << 20
    #: OTLP/HTTP endpoint for traces; None exports nothing.
    otlp_endpoint: str | None = None
    #: Prepare the default executor at startup (the local executor starts its zygote), so the
    #: first cold start does not pay for it.
    warm_executor: bool = True
    #: Log one line per request (aiohttp access log). Off by default: it costs throughput.
    access_log: bool = False
    #: This gateway's name on its Docker host: its containers carry it, and a gateway started
    #: again under the same name removes the containers a crashed predecessor left. Gateways
    #: sharing a Docker Engine need different names; None sweeps nothing.
    name: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValidationError(f"port {self.port} is out of range; use 0..65535")
        if self.drain_timeout_s < 0:
            raise ValidationError("drain timeout must not be negative")
        if self.name is not None:
            check_gateway_name(self.name)
        if self.max_instances_total is not None and self.max_instances_total < 1:
            raise ValidationError("max instances total must be at least 1 (or unset)")
        if self.instance_limit < 1:
            raise ValidationError("instance limit must be at least 1")
        if self.max_invocations < 1:
            raise ValidationError("max invocations must be at least 1")

    @property
    def auth_enabled(self) -> bool:
        return bool(self.tokens)


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
