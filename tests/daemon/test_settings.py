"""The daemon's settings validate what they are given."""

from __future__ import annotations

from pathlib import Path

import pytest

from trims.daemon.settings import DaemonSettings
from trims.errors import ValidationError


def test_daemon_settings_reject_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="eviction policy"):
        DaemonSettings(store_dir=tmp_path, socket_path=tmp_path / "s", eviction="random")


def test_settings_are_typed_models(tmp_path: Path) -> None:
    """The daemon's and the gateway's settings are pydantic dataclasses, as the function spec
    is: a value of the wrong type is refused where it is given, not at first use."""
    import pydantic

    from trims.daemon.settings import TierBudgets
    from trims.runtime.settings import GatewaySettings

    with pytest.raises(pydantic.ValidationError, match="cpu"):
        TierBudgets(cpu="lots")  # type: ignore[arg-type]
    with pytest.raises(pydantic.ValidationError, match="port"):
        GatewaySettings(port="eighty")  # type: ignore[arg-type]
    settings = DaemonSettings(store_dir=str(tmp_path), socket_path=str(tmp_path / "s"))  # type: ignore[arg-type]
    assert isinstance(settings.store_dir, Path)
