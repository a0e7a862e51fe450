"""Bearer tokens and scopes; secrets never reach logs or error bodies."""

from __future__ import annotations

import logging

import pytest

from tests.fixtures.gateway import ADMIN, echo_spec
from trims.errors import ValidationError
from trims.runtime.settings import Token, load_tokens, parse_tokens

ECHO_ONLY = Token("echo-only-secret", frozenset({"invoke:echo"}), "echo-only")
ANY_FN = Token("any-function-secret", frozenset({"invoke:*"}), "any-fn")


async def test_scopes_decide_who_may_deploy_and_invoke(start_gateway, caplog):
    caplog.set_level(logging.DEBUG)
    gw = await start_gateway(tokens=(ADMIN, ECHO_ONLY, ANY_FN))
    await gw.deploy(echo_spec("echo"))
    await gw.deploy(echo_spec("other"))
    url = gw.url

    async def status(method: str, path: str, token: str | None, **kw: object) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with gw.session.request(method, url + path, headers=headers, **kw) as r:
            body = await r.read()
            for t in (ADMIN, ECHO_ONLY, ANY_FN):
                assert t.secret.encode() not in body
            if r.status == 401:
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
            return r.status

    assert await status("POST", "/v1/functions/echo/invoke", None) == 401
    assert await status("POST", "/v1/functions/echo/invoke", "wrong-secret-123") == 401
    assert await status("POST", "/v1/functions/echo/invoke", ECHO_ONLY.secret) == 200
    assert await status("POST", "/v1/functions/other/invoke", ECHO_ONLY.secret) == 403
    assert await status("POST", "/v1/functions/other/invoke", ANY_FN.secret) == 200
    assert await status("GET", "/v1/functions", ECHO_ONLY.secret) == 200
    assert await status("GET", "/v1/functions", None) == 401
    assert await status("DELETE", "/v1/functions/echo", ANY_FN.secret) == 403
    assert await status("PUT", "/v1/functions/x", ECHO_ONLY.secret, json=echo_spec("x")) == 403
    assert await status("DELETE", "/v1/functions/other", ADMIN.secret) == 200
    assert await status("GET", "/healthz", None) == 200
    assert await status("GET", "/metrics", None) == 200

    for t in (ADMIN, ECHO_ONLY, ANY_FN):
        assert t.secret not in caplog.text
        assert t.secret not in repr(t)


def test_tokens_file_and_env_parse_with_clear_errors(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# comment\nadmin-secret-1 admin ops\nreader-secret-2 invoke:echo,invoke:b\n")
    tokens = load_tokens(path, {"TRIMS_GATEWAY_TOKENS": "env-secret-33 invoke:*"})
    assert [(t.name, sorted(t.scopes)) for t in tokens] == [
        ("ops", ["admin"]),
        ("token-3", ["invoke:b", "invoke:echo"]),
        ("token-1", ["invoke:*"]),
    ]
    with pytest.raises(ValidationError, match="unknown scope 'root'"):
        parse_tokens("some-long-secret root", "test")
    with pytest.raises(ValidationError, match="shorter than 8"):
        parse_tokens("short admin", "test")
    with pytest.raises(ValidationError, match="cannot read tokens file"):
        load_tokens(tmp_path / "missing", {})
