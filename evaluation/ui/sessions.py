"""Browser sessions: which token a browser logged in with, and its CSRF token.

Note [browser credentials]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The bearer token a user types into the login form stays on the server: the browser holds only
a random session id in an ``HttpOnly``, ``SameSite=Strict`` cookie scoped to ``/ui/`` (script
cannot read it, other sites' pages and forms never send it). Every browser gets a session on
its first page, anonymous until it logs in, so every POST form, the login form too, carries the
session's CSRF token in a hidden field, compared in constant time. Logging in or out replaces
the session id (no fixation). Sessions live in memory: a restarted gateway logs everyone out.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from trims.errors import PermissionDenied

__all__ = ["COOKIE", "CSRF_FIELD", "SESSION", "Session", "Sessions", "check_csrf"]

COOKIE = "trims_ui_session"
#: the form field that carries the CSRF token
CSRF_FIELD = "csrf"


@dataclass
class Session:
    id: str
    #: the bearer token the user logged in with; None: anonymous
    token: str | None = field(default=None, repr=False)
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    last_seen: float = field(default_factory=time.monotonic)
    #: the session id is new in this request: the response must set the cookie
    fresh: bool = False


#: the request's session (set by the UI's middleware)
SESSION = web.RequestKey("trims.ui.session", Session)


class Sessions:
    """In-memory sessions, least recently used first out, each lasting ``ttl_s`` idle."""

    def __init__(self, *, capacity: int, ttl_s: float) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def of(self, request: web.Request) -> Session:
        """The request's session, a new anonymous one if it has none (or an expired one)."""
        now = time.monotonic()
        sid = request.cookies.get(COOKIE, "")
        session = self._sessions.get(sid)
        if session is not None and now - session.last_seen > self._ttl_s:
            del self._sessions[sid]
            session = None
        if session is None:
            return self._new(None)
        session.last_seen = now
        self._sessions.move_to_end(sid)
        return session

    def _new(self, token: str | None) -> Session:
        session = Session(id=secrets.token_urlsafe(32), token=token, fresh=True)
        self._sessions[session.id] = session
        while len(self._sessions) > self._capacity:
            self._sessions.popitem(last=False)
        return session

    def replace(self, old: Session, token: str | None) -> Session:
        """A new session (new id, new CSRF token) holding ``token``; ``old`` ends."""
        self._sessions.pop(old.id, None)
        return self._new(token)

    def set_cookie(
        self, request: web.Request, response: web.StreamResponse, session: Session
    ) -> None:
        response.set_cookie(
            COOKIE,
            session.id,
            path="/ui/",
            httponly=True,
            samesite="Strict",
            secure=request.secure,
            max_age=int(self._ttl_s),
        )


def check_csrf(session: Session, form_value: object) -> None:
    """PermissionDenied unless the form carried this session's CSRF token."""
    given = form_value if isinstance(form_value, str) else ""
    if not given or not hmac.compare_digest(given.encode(), session.csrf.encode()):
        raise PermissionDenied(
            "this form expired or was not sent from this page (its CSRF token does not match "
            "your session); reload the page and submit it again"
        )
