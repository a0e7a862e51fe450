"""Train the digits MLP (``prepare:digits-mlp``, seed 0) and add it to the store.

    python examples/mxnet_digits/prepare.py [--out DIR] [--socket PATH] [--no-store]

The same model file the digits pipeline serves on ONNX Runtime (weights/digits-mlp.onnx); the
store keeps one copy, which this example maps into MXNet and the pipeline into ONNX Runtime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    from trims.evaluation.harness.prepare import build

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--out", type=Path, default=HERE / "weights", help="model folder")
    parser.add_argument("--no-store", action="store_true", help="only write the model file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from _store import add_to_store

    path = build("prepare:digits-mlp", args.out)
    print(f"wrote digits-mlp to {path}")
    if not args.no_store:
        add_to_store("digits-mlp", path, args.socket, "onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
