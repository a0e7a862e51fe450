"""The web UI's settings: one frozen dataclass, built by whoever mounts the UI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trims.errors import ValidationError

__all__ = ["UIConfig"]


@dataclass(frozen=True)
class UIConfig:
    """What the UI reads and which functions its forms start."""

    #: Results database (SQLite path or SQLAlchemy URL), opened read-only; None: the one
    #: ``trims evaluate`` uses by default (:func:`trims.config.results_db`).
    results_db: str | None = None
    #: The store daemon's socket, for the models page; None shows no store models.
    store_socket: Path | None = None
    #: Base URL of the gateway API the UI calls with the user's token; None: the address the
    #: page request came in on (the gateway that mounts the UI). Never taken from a request's
    #: Host header, which the client chooses.
    api_url: str | None = None
    #: The benchmark functions the "run" forms invoke (examples/evaluate, examples/trace).
    evaluate_function: str = "evaluate"
    trace_function: str = "trace"
    #: Seconds between refreshes of the status and progress pages (a meta refresh, no script).
    refresh_s: int = 5
    #: Logged-in browser sessions kept at once (the least recently used go first; anonymous
    #: browsers take none) and how long one lasts idle.
    max_sessions: int = 10_000
    session_ttl_s: float = 12 * 3600.0
    #: Failed logins one peer address may make in a row, and the seconds after which it may
    #: make one more (Note [login attempts] in logins.py): 5 and 20 s let a person mistype a
    #: few times and hold a guesser to 180 tokens an hour.
    login_attempts: int = 5
    login_refill_s: float = 20.0

    def __post_init__(self) -> None:
        if self.refresh_s < 1:
            raise ValidationError(f"UI refresh interval {self.refresh_s}s must be >= 1 second")
        if self.max_sessions < 1 or self.session_ttl_s <= 0:
            raise ValidationError("UI sessions: max_sessions >= 1 and session_ttl_s > 0")
        if self.login_attempts < 1 or self.login_refill_s <= 0:
            raise ValidationError("UI logins: login_attempts >= 1 and login_refill_s > 0")
        if self.api_url is not None and not self.api_url.startswith(("http://", "https://")):
            raise ValidationError(
                f"UI api_url {self.api_url!r} must start with http:// or https://"
            )
