"""Templates (Jinja2, autoescaped) and the headers every page carries."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

__all__ = ["SECURITY_HEADERS", "environment", "render"]

TEMPLATES = Path(__file__).parent / "templates"

#: Scripts only from /ui/static (there are none today); inline styles are allowed because
#: matplotlib's SVG uses them. No framing, forms post only here, nothing leaves the origin.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

_ENV = web.AppKey("trims.ui.jinja", jinja2.Environment)


def _when(ts: float | None) -> str:
    if ts is None:
        return ""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def _num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}%"


def _size(n: int | None) -> str:
    if n is None:
        return "–"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=_when, num=_num, pct=_pct, size=_size)
    return env


def install(app: web.Application) -> None:
    app[_ENV] = environment()


def render(
    request: web.Request,
    template: str,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> web.Response:
    """The page ``template`` with ``context`` plus what every page shows (session, nav)."""
    from trims.evaluation.ui.sessions import SESSION
    from trims.evaluation.ui.state import state_of

    state = state_of(request)
    session = request.get(SESSION)
    body = (
        request.app[_ENV]
        .get_template(template)
        .render(
            logged_in=bool(session is not None and session.token),
            csrf=session.csrf if session is not None else "",
            refresh_s=state.config.refresh_s,
            path=request.path,
            **context,
        )
    )
    return web.Response(
        status=status,
        text=body,
        content_type="text/html",
        charset="utf-8",
        headers={**SECURITY_HEADERS, **(headers or {})},
    )
