"""What every UI handler reaches: the config, the results database, the API client, sessions
and login tries."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from trims.evaluation.ui.api import GatewayAPI
from trims.evaluation.ui.config import UIConfig
from trims.evaluation.ui.data import Results
from trims.evaluation.ui.logins import LoginLimiter
from trims.evaluation.ui.sessions import SESSION, Session, Sessions

__all__ = ["UIState", "require_read", "session_of", "state_of"]


@dataclass(frozen=True)
class UIState:
    config: UIConfig
    results: Results
    api: GatewayAPI
    sessions: Sessions
    logins: LoginLimiter


STATE = web.AppKey("trims.ui.state", UIState)


def state_of(request: web.Request) -> UIState:
    return request.app[STATE]


def session_of(request: web.Request) -> Session:
    session: Session = request[SESSION]
    return session


async def require_read(request: web.Request) -> None:
    """Reading pages needs what reading the API needs (the ``read`` scope, or any token):
    asked of the gateway itself, with this browser's token (401 page otherwise)."""
    await state_of(request).api.call(
        request, "GET", "/v1/pipelines", token=session_of(request).token
    )
