"""Train the digits MLP (``prepare:digits-mlp``, seed 0), add it to the store, write sample PNGs.

    python examples/pipelines/digits/prepare.py [--socket PATH] [--no-store] [--pngs N]

The model is the evaluation manifest ``digits-mlp`` (weights/digits-mlp.onnx); ``--pngs N``
writes the first N digits of its test split as ``samples/<index>-<label>.png`` (grey level x 15).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_pngs(out: Path, count: int) -> list[Path]:
    """The first ``count`` test digits as 8-bit grayscale PNGs (level x 15)."""
    import numpy as np
    from PIL import Image

    from trims.evaluation.harness.datasets import digits

    images, labels = digits("test")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(min(count, len(images))):
        path = out / f"{i:03d}-{labels[i]}.png"
        Image.fromarray((images[i] * 15).astype(np.uint8), mode="L").save(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    from trims.evaluation.harness.prepare import build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--no-store", action="store_true", help="only write the model file")
    parser.add_argument("--pngs", type=int, default=10, help="sample PNGs to write (Pillow)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parents[1]))
    from _store import add_to_store

    path = build("prepare:digits-mlp", HERE / "weights")
    print(f"wrote digits-mlp to {path}")
    if not args.no_store:
        add_to_store("digits-mlp", path, args.socket, "onnx")
    if args.pngs:
        written = write_pngs(HERE / "samples", args.pngs)
        print(f"wrote {len(written)} sample PNGs to {HERE / 'samples'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
