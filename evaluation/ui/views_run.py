"""Logging in and out, and starting work: forms that invoke the ``evaluate`` and ``trace``
benchmark functions through the gateway API (asynchronously, with the user's token), a progress
page that refreshes itself, and the landing on the result.

Every POST checks the session's CSRF token first (Note [browser credentials] in sessions.py);
what the user may run is decided by the API (``invoke:<function>``), never here. Each login
spends one of its peer's tries (Note [login attempts] in logins.py).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

from trims.errors import (
    AccessError,
    NotFound,
    QueueFull,
    TrimsError,
    Unauthorized,
    ValidationError,
)
from trims.evaluation.db import ResultsDB
from trims.evaluation.ui.render import render
from trims.evaluation.ui.sessions import CSRF_FIELD, SESSION, check_csrf
from trims.evaluation.ui.state import require_read, session_of, state_of
from trims.peer_cred import peer_of

__all__ = ["login", "login_form", "logout", "progress", "run_form", "start_evaluate", "start_trace"]

SCENARIOS = ("single-stream", "multi-stream", "server", "offline")
MODES = ("performance", "accuracy", "both")
FRAMEWORKS = ("torch", "onnxruntime", "mxnet")
LEVELS = ("model", "layer", "library", "kernel", "full")
_INVOCATION_ID = re.compile(r"[0-9a-f]{32}")


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _choices() -> dict[str, Any]:
    from trims.evaluation.harness.manifest import shipped_manifest_paths

    try:
        from trims.evaluation import families, zoo

        trace_models = [*zoo.zoo_names(), *families.FAMILIES, "example:resnet50"]
    except ImportError:
        trace_models = ["example:resnet50"]
    return {
        "manifests": [p.stem for p in shipped_manifest_paths()],
        "scenarios": SCENARIOS,
        "modes": MODES,
        "frameworks": FRAMEWORKS,
        "levels": LEVELS,
        "trace_models": trace_models,
    }


def _run_page(
    request: web.Request, status: int = 200, error: str = "", form: Mapping[str, str] | None = None
) -> web.Response:
    state = state_of(request)
    return render(
        request,
        "run.html",
        status=status,
        error=error,
        form=dict(form or {}),
        evaluate_function=state.config.evaluate_function,
        trace_function=state.config.trace_function,
        **_choices(),
    )


async def run_form(request: web.Request) -> web.Response:
    await require_read(request)
    return _run_page(request)


def _int(form: Mapping[str, str], key: str, default: int, low: int, high: int) -> int:
    raw = form.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(f"{key}: give a whole number, got {raw!r}", field=key) from None
    if not low <= value <= high:
        raise ValidationError(f"{key}: must be between {low} and {high}, got {value}", field=key)
    return value


def _one_of(form: Mapping[str, str], key: str, allowed: tuple[str, ...]) -> str:
    value = form.get(key, allowed[0])
    if value not in allowed:
        raise ValidationError(f"{key}: choose one of {', '.join(allowed)}", field=key)
    return value


async def _posted(request: web.Request) -> dict[str, str]:
    form = await request.post()
    check_csrf(session_of(request), form.get(CSRF_FIELD))
    return {k: v for k, v in form.items() if isinstance(v, str)}


async def _start(
    request: web.Request, function: str, body: dict[str, Any], form: Mapping[str, str]
) -> web.Response:
    state = state_of(request)
    try:
        doc = await state.api.call(
            request,
            "POST",
            f"/v1/functions/{quote(function, safe='')}/invoke",
            token=session_of(request).token,
            body=body,
            params={"async": "true"},
        )
    except TrimsError as e:
        hint = ""
        if isinstance(e, NotFound):
            hint = f" Deploy it first: trims functions deploy examples/{function}/function.yaml."
        if isinstance(e, Unauthorized):
            hint = " Log in with a token that may invoke it."
        return _run_page(request, e.http_status, e.message + hint, form)
    return see_other(f"/ui/runs/{doc['id']}")


async def start_evaluate(request: web.Request) -> web.Response:
    form = await _posted(request)
    try:
        model = form.get("model", "")
        if model not in _choices()["manifests"]:
            raise ValidationError("model: choose one of the shipped manifests", field="model")
        settings: dict[str, int] = {
            "min_duration_ms": _int(form, "min_duration_ms", 1000, 0, 30_000),
            "min_query_count": _int(form, "min_query_count", 16, 1, 100_000),
        }
        body = {
            "models": [model],
            "scenario": _one_of(form, "scenario", SCENARIOS),
            "mode": _one_of(form, "mode", MODES),
            "batch": _int(form, "batch", 1, 1, 256),
            "settings": settings,
        }
    except ValidationError as e:
        return _run_page(request, 422, e.message, form)
    return await _start(request, state_of(request).config.evaluate_function, body, form)


async def start_trace(request: web.Request) -> web.Response:
    form = await _posted(request)
    try:
        model = form.get("trace_model", "").strip()
        if not model:
            raise ValidationError("model: name the model to trace", field="trace_model")
        body = {
            "model": model,
            "framework": _one_of(form, "framework", FRAMEWORKS),
            "level": _one_of(form, "level", LEVELS),
            "runs": _int(form, "runs", 10, 1, 200),
            "batch": _int(form, "trace_batch", 1, 1, 64),
        }
    except ValidationError as e:
        return _run_page(request, 422, e.message, form)
    return await _start(request, state_of(request).config.trace_function, body, form)


def _answer(result: Mapping[str, Any]) -> Any:
    if result.get("encoding") != "utf-8":
        return None
    try:
        return json.loads(str(result.get("body") or ""))
    except ValueError:
        return None


async def _landing(request: web.Request, answer: Any) -> str | None:
    """Where the finished run's result is shown, when the UI's database holds it."""
    if not isinstance(answer, dict):
        return None
    if isinstance(answer.get("trace_id"), str):
        trace_id = answer["trace_id"]

        def has_trace(db: ResultsDB) -> bool:
            return db.get_trace(trace_id) is not None

        ok = await _safely(request, has_trace)
        return f"/ui/traces/{quote(trace_id, safe='')}" if ok else None
    runs = [e.get("run_id") for e in answer.get("evaluations") or [] if isinstance(e, dict)]
    run_ids = [r for r in runs if isinstance(r, str)]
    if not run_ids:
        return None

    def has_all(db: ResultsDB) -> bool:
        for run_id in run_ids:
            db.get_evaluation(run_id)  # NotFound when this database lacks it
        return True

    if not await _safely(request, has_all):
        return None
    if len(run_ids) == 1:
        return f"/ui/evaluations/{quote(run_ids[0], safe='')}"
    return "/ui/compare?" + urlencode([("e", r) for r in run_ids])


async def _safely(request: web.Request, check: Any) -> bool:
    try:
        return bool(await state_of(request).results.call(check))
    except NotFound:
        return False


async def progress(request: web.Request) -> web.Response:
    invocation_id = request.match_info["id"]
    if not _INVOCATION_ID.fullmatch(invocation_id):
        raise NotFound(f"no run {invocation_id!r}")
    state = state_of(request)
    doc = await state.api.call(
        request, "GET", f"/v1/invocations/{invocation_id}", token=session_of(request).token
    )
    answer = None
    if doc.get("state") == "succeeded":
        result = doc.get("result") or {}
        answer = _answer(result)
        if int(result.get("status", 500)) < 300:
            target = await _landing(request, answer)
            if target is not None:
                return see_other(target)
    elapsed = (doc.get("finished") or time.time()) - float(doc.get("created") or time.time())
    return render(
        request,
        "progress.html",
        run=doc,
        elapsed=elapsed,
        answer=answer,
        result=doc.get("result") or {},
        running=doc.get("state") == "running",
        results_db=state.results.url,
    )


async def login_form(request: web.Request) -> web.Response:
    return render(request, "login.html", error="", next=_next(request.query.get("next")))


def _next(value: str | None) -> str:
    """A local page to go to after logging in (never another site)."""
    if value and value.startswith("/ui/") and "//" not in value and "\\" not in value:
        return value
    return "/ui/"


async def login(request: web.Request) -> web.Response:
    form = await _posted(request)
    token = form.get("token", "").strip()
    target = _next(form.get("next"))
    state = state_of(request)
    if not token:
        return render(request, "login.html", status=422, error="Enter a token.", next=target)
    peer = peer_of(request.transport)
    try:
        state.logins.take(peer)
    except QueueFull as e:
        retry = {"Retry-After": str(e.details["retry_after_s"])}
        return render(request, "login.html", 429, retry, error=e.message, next=target)
    try:
        await state.api.call(request, "GET", "/v1/pipelines", token=token)
    except TrimsError as e:
        if not isinstance(e, AccessError):
            state.logins.give_back(peer)
        return render(request, "login.html", status=e.http_status, error=e.message, next=target)
    state.logins.give_back(peer)
    session = state.sessions.replace(session_of(request), token)
    request[SESSION] = session
    return see_other(target)


async def logout(request: web.Request) -> web.Response:
    await _posted(request)
    request[SESSION] = state_of(request).sessions.replace(session_of(request), None)
    return see_other("/ui/")
