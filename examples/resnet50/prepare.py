"""Write the example's ResNet-50 weights (seeded random) and add them to the model store.

    python examples/resnet50/prepare.py [--out PATH] [--socket STORE_SOCKET]

It also copies a sample photo to ``samples/flower.jpg``: scikit-learn's bundled ``flower.jpg``
(CC BY 2.0, "Some rights reserved by vultilion", flickr.com/photos/vultilion/6056698931), for
``trims functions invoke resnet50 --data @examples/resnet50/samples/flower.jpg``.

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
    parser.add_argument("--samples", type=Path, default=HERE / "samples", help="photo folder")
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
    sample = copy_sample(args.samples)
    print(f"sample photo {sample} (CC BY 2.0, vultilion on flickr, via scikit-learn)")
    return 0


def copy_sample(folder: Path) -> Path:
    """scikit-learn's bundled flower.jpg into ``folder`` (atomically: copy, then rename)."""
    import os
    import shutil

    import sklearn.datasets

    source = Path(sklearn.datasets.__file__).parent / "images" / "flower.jpg"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.name
    partial = target.with_suffix(".jpg.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)
    return target


if __name__ == "__main__":
    sys.exit(main())
