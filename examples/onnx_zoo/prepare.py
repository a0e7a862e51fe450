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


def add_to_store(name: str, path: Path, socket: Path | None) -> bool:
    """Register ``path`` with the store daemon; False (with a note) when none is running."""
    from trims.errors import TrimsError
    from trims.runtime.client import StoreClient

    try:
        with StoreClient(socket) as client:
            model = client.add(name, path, fmt="onnx")
    except TrimsError as e:
        print(f"model {name} not added to the store ({e.message}); it loads from {path}")
        return False
    print(f"model {name} added to the store: {model.get('digest', '')[:12]}")
    return True


def main(argv: list[str] | None = None) -> int:
    from trims.evaluation.zoo import materialize, zoo_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="squeezenet", choices=zoo_names())
    parser.add_argument("--out", type=Path, help="default: weights/<model>.onnx here")
    parser.add_argument("--socket", type=Path, help="store socket (default $TRIMS_SOCKET)")
    parser.add_argument("--no-store", action="store_true", help="only write the model file")
    args = parser.parse_args(argv)
    import onnx

    out = args.out or HERE / "weights" / f"{args.model}.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    model = materialize(args.model)
    onnx.save(model, str(out))
    print(f"wrote {args.model} ({out.stat().st_size / 2**20:.1f} MiB) to {out}")
    if not args.no_store:
        add_to_store(f"onnx-{args.model}", out, args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
