"""Materialize a real model graph from the onnx wheel's zoo and add it to the model store.

    python examples/onnx_zoo/prepare.py [--model squeezenet] [--out PATH] [--socket PATH]

The light models in ``onnx/backend/test/data/light/`` keep their weights as ConstantOfShape
nodes; ``trims.evaluation.zoo.materialize`` turns them into real-size initializers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    from trims.evaluation.zoo import materialize, zoo_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="squeezenet", choices=zoo_names())
    parser.add_argument("--out", type=Path, help="default: weights/<model>.onnx here")
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--no-store", action="store_true", help="only write the model file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    import onnx
    from _store import add_to_store

    out = args.out or HERE / "weights" / f"{args.model}.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    model = materialize(args.model)
    onnx.save(model, str(out))
    print(f"wrote {args.model} ({out.stat().st_size / 2**20:.1f} MiB) to {out}")
    if not args.no_store:
        add_to_store(f"onnx-{args.model}", out, args.socket, "onnx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
