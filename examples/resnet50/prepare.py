"""Write the example's ResNet-50 weights (seeded random) and add them to the model store.

    python examples/resnet50/prepare.py [--out PATH] [--socket STORE_SOCKET]

Without a running store daemon the weights are only written; the function then loads them
straight from the file (function.yaml names it as the model's ``source``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "resnet50-demo"
DEFAULT_OUT = HERE / "weights" / "resnet50.safetensors"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--no-store", action="store_true", help="only write the weights")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from _store import add_to_store

    sys.path.insert(0, str(HERE))
    from network import random_state_dict
    from safetensors.torch import save_file

    args.out.parent.mkdir(parents=True, exist_ok=True)
    state = random_state_dict(args.seed)
    save_file(state, str(args.out))
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"wrote {len(state)} tensors ({size / 2**20:.1f} MiB) to {args.out}")
    if not args.no_store:
        add_to_store(MODEL, args.out, args.socket, "safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
