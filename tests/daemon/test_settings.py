"""The daemon's settings validate what they are given."""

from __future__ import annotations

from pathlib import Path

import pytest

from trims.daemon.settings import DaemonSettings
from trims.errors import ValidationError


def test_daemon_settings_reject_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="eviction policy"):
        DaemonSettings(store_dir=tmp_path, socket_path=tmp_path / "s", eviction="random")
