"""`trims gateway` arguments to settings and executors (no server started)."""

from __future__ import annotations

import argparse

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
