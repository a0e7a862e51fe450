"""Idle memory: how much longer a pass over a model's weights takes after they sat unread.

    python bench/idle_memory.py --mb 512 --idle 0,0.25,0.5,1,2 --runs 5 --json OUT.json

A first request reads every weight; the warm request a benchmark holds it against usually
comes right after it. On some nodes memory that sat unread for a while is slower to read again
(a virtual machine whose host reclaims, compresses or lazily restores guest memory it sees
idle; a host's NUMA balancing), and then a first request pays for the idle time, not for the
cold start. This script measures that on the node, without trims: one process fills a
``--mb`` MiB memfd and runs the same forward pass as ``bench/peers.py`` over it (float32
``Linear`` layers, torch with every CPU), back to back until it is warm, then again after
sleeping ``--idle`` seconds. Idle times are interleaved run by run. For each it also times
reading one byte per 64 KiB after the same idle (``touch_ms``), what a prefetch would cost.

JSON: ``{"results": [{"idle_s", "after_idle_ms", "warm_ms", "ratio", "touch_ms", "runs"}],
"mb", "machine"}``; the markdown table goes to stdout (and ``--markdown``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import check_size_run_options, machine, size_run_options, write_outputs

#: the weights' layers: [WIDTH, WIDTH] float32 (64 MiB each at 4096)
WIDTH = 4096
#: the stride of the touch pass (one byte read per this many)
TOUCH_STRIDE = 64 << 10


class Weights:
    """``mb`` MiB of float32 layers in a memfd, mapped and written once."""

    def __init__(self, mb: int) -> None:
        import numpy as np
        import torch

        layer = WIDTH * WIDTH * 4
        self.layers = max(1, (mb << 20) // layer)
        size = self.layers * layer
        fd = os.memfd_create("idle-memory")
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.flat = np.frombuffer(self.map, dtype=np.float32)
        self.flat[:] = 1.0 / WIDTH
        self.w = torch.from_numpy(self.flat).view(self.layers, WIDTH, WIDTH)
        self.x = torch.ones(1, WIDTH)

    def forward_ms(self) -> float:
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():
            for i in range(self.layers):
                torch.nn.functional.linear(self.x, self.w[i])
        return (time.perf_counter() - t0) * 1e3

    def touch_ms(self) -> float:
        t0 = time.perf_counter()
        self.flat[:: TOUCH_STRIDE // 4].sum()
        return (time.perf_counter() - t0) * 1e3

    def warm(self) -> float:
        """Passes until two in a row are within 10% (at most 5); the last one's time."""
        last = self.forward_ms()
        for _ in range(4):
            now = self.forward_ms()
            if abs(now - last) <= 0.1 * last:
                return now
            last = now
        return last


def measure(mb: int, idles: list[float], runs: int) -> list[dict[str, Any]]:
    weights = Weights(mb)
    after: dict[float, list[float]] = {i: [] for i in idles}
    warm: dict[float, list[float]] = {i: [] for i in idles}
    touch: dict[float, list[float]] = {i: [] for i in idles}
    for run in range(runs):
        for idle in idles if run % 2 == 0 else idles[::-1]:
            warm[idle].append(weights.warm())
            time.sleep(idle)  # the idle time is what is measured
            after[idle].append(weights.forward_ms())
            weights.warm()
            time.sleep(idle)
            touch[idle].append(weights.touch_ms())
            print(
                f"idle {idle:5.2f} s run {run}: after {after[idle][-1]:7.1f} ms, warm "
                f"{warm[idle][-1]:6.1f} ms, touch {touch[idle][-1]:6.1f} ms",
                file=sys.stderr,
            )
    rows = []
    for idle in idles:
        a, w = statistics.median(after[idle]), statistics.median(warm[idle])
        rows.append(
            {
                "idle_s": idle,
                "after_idle_ms": a,
                "warm_ms": w,
                "ratio": a / w,
                "touch_ms": statistics.median(touch[idle]),
                "runs": runs,
            }
        )
    return rows


def render(doc: dict[str, Any]) -> str:
    label = " (quick: a check, not a measurement)" if doc["quick"] else ""
    rows = [
        [
            f"{r['idle_s']:g}",
            f"{r['after_idle_ms']:.1f}",
            f"{r['warm_ms']:.1f}",
            f"{r['ratio']:.2f}x",
            f"{r['touch_ms']:.1f}",
        ]
        for r in doc["results"]
    ]
    head = (
        f"A forward pass over {doc['mb']} MiB of weights after they sat unread{label}; "
        f"{doc['machine']}; {doc['results'][0]['runs']} runs, medians."
    )
    table = markdown_table(
        ["idle s", "pass after idle ms", "warm pass ms", "after / warm", "touch 1 B / 64 KiB ms"],
        rows,
    )
    return f"{head}\n\n{table}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_run_options(parser, "size of the weights, in whole 64 MiB layers")
    parser.add_argument("--idle", default="0,0.25,0.5,1,2", help="seconds, comma-separated")
    args = parser.parse_args()
    try:
        idles = [float(v) for v in args.idle.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--idle takes seconds separated by commas, not {args.idle!r}")
    if not idles or min(idles) < 0:
        parser.error("--idle needs seconds >= 0")
    check_size_run_options(parser, args)
    layer_mb = WIDTH * WIDTH * 4 >> 20
    args.mb = max(1, args.mb // layer_mb) * layer_mb  # what Weights holds
    where = machine()
    doc = {"results": measure(args.mb, idles, args.runs), "mb": args.mb, "machine": where}
    doc["quick"] = args.quick
    write_outputs(args.json, args.markdown, doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
