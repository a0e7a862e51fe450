"""The token a client of the gateway sends, found the way every trims command finds it.

Part of the runtime's public API: the CLI (``trims functions``, ``trims pipelines``) and the
evaluation harness's gateway systems under test use it, so a user's ``--token`` /
``$TRIMS_TOKEN`` / generated admin token works the same everywhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from trims.errors import ValidationError

__all__ = ["find_token"]


def find_token(token: str | None, state_dir: Path | None, env: Mapping[str, str]) -> str | None:
    """``token``, else ``$TRIMS_TOKEN``, else the admin token file of ``state_dir`` (or of the
    default state directory); None when there is none. ValidationError (one line) when the
    file exists but cannot be used."""
    from trims.runtime.gateway.admin_token import admin_token_path, read_token_file
    from trims.runtime.settings import default_state_dir

    if token:
        return token
    if env.get("TRIMS_TOKEN"):
        return env["TRIMS_TOKEN"]
    path = admin_token_path(state_dir or default_state_dir(env))
    if not os.path.lexists(path):
        return None
    try:
        return read_token_file(path)
    except ValidationError as e:
        raise ValidationError(f"{e.message}; or pass --token / set $TRIMS_TOKEN") from None
