"""Browser sessions: which token a browser logged in with, and its CSRF token.

Note [browser credentials]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The bearer token a user types into the login form stays on the server: the browser holds only
a random session id in an ``HttpOnly``, ``SameSite=Strict`` cookie scoped to ``/ui/`` (script
cannot read it, other sites' pages and forms never send it). Every browser gets a session id on
its first page, so every POST form, the login form too, carries a CSRF token in a hidden field,
compared in constant time. The CSRF token is an HMAC of the session id under a secret of this
process, so an anonymous session needs nothing stored: only a successful login stores an entry
(the token it holds). Requests without a cookie therefore cannot fill the store and push out
the sessions of people who logged in; the store's capacity bounds logged-in sessions only,
least recently used first out. Logging in or out replaces the session id (no fixation).
Sessions live in memory: a restarted gateway logs everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import re
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
#: what :func:`secrets.token_urlsafe` (32 bytes) makes; any other cookie value gets a new id
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{43}")


@dataclass
class Session:
    id: str
    #: the HMAC of ``id`` the session's forms carry (:meth:`Sessions.csrf_of`)
    csrf: str = field(repr=False)
    #: the bearer token the user logged in with; None: anonymous (and not stored)
    token: str | None = field(default=None, repr=False)
    last_seen: float = field(default_factory=time.monotonic)
    #: the session id is new in this request: the response must set the cookie
    fresh: bool = False


#: the request's session (set by the UI's middleware)
SESSION = web.RequestKey("trims.ui.session", Session)


class Sessions:
    """In-memory logged-in sessions, least recently used first out, each lasting ``ttl_s``
    idle; anonymous sessions are not stored (Note [browser credentials])."""

    def __init__(self, *, capacity: int, ttl_s: float) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._secret = secrets.token_bytes(32)
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def csrf_of(self, sid: str) -> str:
        """The CSRF token of session ``sid``: an HMAC only this process can compute."""
        return hmac.new(self._secret, sid.encode(), hashlib.sha256).hexdigest()

    def of(self, request: web.Request) -> Session:
        """The request's session: its logged-in one, else an anonymous one under the id its
        cookie holds, else (no cookie, or not one we could have made) a new anonymous id."""
        now = time.monotonic()
        sid = request.cookies.get(COOKIE, "")
        session = self._sessions.get(sid)
        if session is not None and now - session.last_seen > self._ttl_s:
            del self._sessions[sid]
            session = None
        if session is not None:
            session.last_seen = now
            self._sessions.move_to_end(sid)
            return session
        if _SESSION_ID.fullmatch(sid):
            return Session(id=sid, csrf=self.csrf_of(sid))
        return self._new(None)

    def _new(self, token: str | None) -> Session:
        sid = secrets.token_urlsafe(32)
        session = Session(id=sid, csrf=self.csrf_of(sid), token=token, fresh=True)
        if token is not None:
            self._sessions[sid] = session
            while len(self._sessions) > self._capacity:
                self._sessions.popitem(last=False)
        return session

    def replace(self, old: Session, token: str | None) -> Session:
        """A new session (new id, new CSRF token) holding ``token``, stored when it holds
        one; ``old`` ends."""
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
