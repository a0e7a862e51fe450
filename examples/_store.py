"""What every example's prepare.py shares: registering its weights with the store daemon."""

from __future__ import annotations

from pathlib import Path


def add_to_store(name: str, path: Path, socket: Path | None, fmt: str) -> bool:
    """Register ``path`` with the store daemon; False (with a note) when none is running."""
    from trims.errors import TrimsError
    from trims.runtime.client import StoreClient

    try:
        with StoreClient(socket) as client:
            model = client.add(name, path, fmt=fmt)
    except TrimsError as e:
        print(f"model {name} not added to the store ({e.message}); it loads from {path}")
        return False
    print(f"model {name} added to the store: {model.get('digest', '')[:12]}")
    return True
