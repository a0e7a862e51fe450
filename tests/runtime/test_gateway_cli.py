"""`trims gateway` arguments to settings and executors (no server started)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from trims.errors import ValidationError
from trims.runtime import gateway_cli


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gateway_cli.configure(parser)
    return parser.parse_args(list(argv))


def test_name_reaches_the_docker_executor_as_its_owner() -> None:
    pytest.importorskip("docker")
    settings = gateway_cli.settings_from_args(_args("--name", "edge-1", "--port", "0"), {})
    assert settings.name == "edge-1"
    executor = gateway_cli.executor_factory(settings, {})("docker")
    assert executor.settings.owner == "edge-1"


def test_name_from_the_environment_and_none_by_default() -> None:
    env = {"TRIMS_GATEWAY_NAME": "edge-2"}
    assert gateway_cli.settings_from_args(_args(), env).name == "edge-2"
    assert gateway_cli.settings_from_args(_args(), {}).name is None


def test_a_name_docker_cannot_label_with_is_refused_at_startup() -> None:
    for bad in ("edge 1", "-edge", "x" * 64):
        with pytest.raises(ValidationError, match="gateway name"):
            gateway_cli.settings_from_args(_args(f"--name={bad}"), {})


def test_anonymous_scopes_default_to_invoke_and_read_only_on_loopback(tmp_path) -> None:
    assert gateway_cli.settings_from_args(_args(), {}).anonymous_scopes == {"invoke:*", "read"}
    assert gateway_cli.settings_from_args(_args("--host", "0.0.0.0"), {}).anonymous_scopes == set()
    tokens = {"TRIMS_GATEWAY_TOKENS": "admin-secret-1 admin"}
    assert gateway_cli.settings_from_args(_args(), tokens).anonymous_scopes == set()
    explicit = _args("--host", "0.0.0.0", "--anonymous-scopes", "invoke:echo")
    assert gateway_cli.settings_from_args(explicit, {}).anonymous_scopes == {"invoke:echo"}
    with pytest.raises(ValidationError, match="admin scope"):
        gateway_cli.settings_from_args(_args("--anonymous-scopes", "admin"), {})
    with pytest.raises(ValidationError, match="--no-auth turns authentication off"):
        gateway_cli.settings_from_args(_args("--no-auth"), tokens)


def test_the_admin_token_goes_to_the_state_dir_or_the_default_one(tmp_path) -> None:
    from trims.runtime.settings import default_state_dir

    env = {"XDG_STATE_HOME": str(tmp_path / "xdg")}
    settings = gateway_cli.with_admin_token(gateway_cli.settings_from_args(_args(), env), env)
    assert settings.admin_token_file == tmp_path / "xdg/trims/gateway/auth/admin-token"
    assert [t.scopes for t in settings.tokens] == [{"admin"}]
    given = _args("--state-dir", str(tmp_path / "state"))
    settings = gateway_cli.with_admin_token(gateway_cli.settings_from_args(given, env), env)
    assert settings.admin_token_file == tmp_path / "state/auth/admin-token"
    off = gateway_cli.with_admin_token(gateway_cli.settings_from_args(_args("--no-auth"), env), env)
    assert not off.auth and off.tokens == ()
    assert default_state_dir({}, uid=0) == Path("/var/lib/trims/gateway")
    assert default_state_dir({"HOME": "/home/u"}, uid=1000) == Path(
        "/home/u/.local/state/trims/gateway"
    )
