"""The UI's aiohttp sub-application: routes, the session and error middleware, the lifecycle.

Routes (under the mount point, ``/ui/``): ``/`` functions and models; ``/evaluations``,
``/evaluations/{ref}``, ``/compare?e=..``; ``/traces``, ``/traces/{id}`` (``?format=chrome``);
``/layers``; ``/run`` with ``POST /run/evaluate`` and ``POST /run/trace``; ``/runs/{id}``
(progress); ``/login``, ``POST /logout``; ``/static/``. Every answer is an HTML page, errors
too: a trims error becomes a page with its status and message, anything else a 500 page (and a
log line), never a traceback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from trims.errors import NotFound, TrimsError, Unauthorized
from trims.evaluation.ui import render as rendering
from trims.evaluation.ui import (
    views_evaluations,
    views_layers,
    views_run,
    views_status,
    views_traces,
)
from trims.evaluation.ui.api import GatewayAPI
from trims.evaluation.ui.config import UIConfig
from trims.evaluation.ui.data import Results
from trims.evaluation.ui.logins import LoginLimiter
from trims.evaluation.ui.sessions import SESSION, Sessions
from trims.evaluation.ui.state import STATE, UIState

__all__ = ["create_ui_app"]

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


def _error_page(request: web.Request, status: int, title: str, message: str) -> web.Response:
    login = status == 401
    return rendering.render(
        request, "error.html", status=status, title=title, message=message, login=login
    )


@web.middleware
async def ui_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Attach the browser's session; turn every failure into an HTML page."""
    state: UIState = request.app[STATE]
    session = state.sessions.of(request)
    request[SESSION] = session
    try:
        response: web.StreamResponse = await handler(request)
    except Unauthorized as e:
        response = _error_page(request, 401, "Log in to see this page", e.message)
    except TrimsError as e:
        if e.http_status >= 500:
            log.info("web UI %s %s: %s", request.method, request.path, e.message)
        response = _error_page(request, e.http_status, "Something is not right", e.message)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = "There is no such page." if e.status == 404 else e.reason
        response = _error_page(request, e.status, e.reason, message)
    except Exception:
        log.exception("web UI %s %s failed", request.method, request.path)
        response = _error_page(
            request, 500, "The page failed", "The web UI failed unexpectedly; see the gateway log."
        )
    final = request[SESSION]
    if final.fresh:
        state.sessions.set_cookie(request, response, final)
        final.fresh = False
    return response


async def _unknown(request: web.Request) -> web.Response:
    raise NotFound(f"there is no page {request.path}; start at /ui/")


def create_ui_app(config: UIConfig) -> web.Application:
    """The web UI as an aiohttp application, to mount with ``add_subapp("/ui", ...)``; a
    ``results_db`` of None reads the shared default (:func:`trims.config.results_db`)."""
    from trims.evaluation.harness.results import default_db_url

    app = web.Application(middlewares=[ui_middleware], client_max_size=64 << 10)
    state = UIState(
        config=config,
        results=Results(config.results_db or default_db_url(os.environ)),
        api=GatewayAPI(config.api_url),
        sessions=Sessions(capacity=config.max_sessions, ttl_s=config.session_ttl_s),
        logins=LoginLimiter(attempts=config.login_attempts, refill_s=config.login_refill_s),
    )
    app[STATE] = state
    rendering.install(app)
    r = app.router
    r.add_get("/", views_status.overview)
    r.add_get("/evaluations", views_evaluations.evaluations)
    r.add_get("/evaluations/{ref}", views_evaluations.evaluation)
    r.add_get("/compare", views_evaluations.compare)
    r.add_get("/traces", views_traces.traces)
    r.add_get("/traces/{trace_id}", views_traces.trace)
    r.add_get("/layers", views_layers.layers)
    r.add_get("/run", views_run.run_form)
    r.add_post("/run/evaluate", views_run.start_evaluate)
    r.add_post("/run/trace", views_run.start_trace)
    r.add_get("/runs/{id}", views_run.progress)
    r.add_get("/login", views_run.login_form)
    r.add_post("/login", views_run.login)
    r.add_post("/logout", views_run.logout)
    r.add_static("/static/", STATIC, append_version=False)
    r.add_route("*", "/{tail:.*}", _unknown)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await state.api.start()
        yield
        await state.api.close()
        state.results.close()

    app.cleanup_ctx.append(lifecycle)
    return app
