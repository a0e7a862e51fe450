"""`trims gateway --warm-pool K` and $TRIMS_WARM_POOL reach the local executor's settings."""

from __future__ import annotations

import argparse

import pytest

from trims.errors import ValidationError
from trims.runtime import gateway_cli
from trims.runtime.executors.local import LocalExecutorSettings


def _options(*argv: str, env: dict[str, str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    gateway_cli.configure(parser)
    return gateway_cli.local_options(parser.parse_args(argv), env or {})


def test_the_flag_and_the_variable_set_the_pool_and_the_flag_wins() -> None:
    assert "warm_pool" not in _options()
    assert _options("--warm-pool", "2")["warm_pool"] == 2
    assert _options(env={"TRIMS_WARM_POOL": "1"})["warm_pool"] == 1
    assert _options("--warm-pool", "0", env={"TRIMS_WARM_POOL": "3"})["warm_pool"] == 0
    assert LocalExecutorSettings(**_options()).warm_pool == 1  # type: ignore[arg-type]
    assert LocalExecutorSettings(**_options("--warm-pool", "0")).warm_pool == 0  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (("--warm-pool", "-1"), {}, "give 0"),
        ((), {"TRIMS_WARM_POOL": "many"}, "is not a number"),
    ],
)
def test_a_bad_pool_size_is_refused_with_the_fix(
    argv: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        _options(*argv, env=env)
