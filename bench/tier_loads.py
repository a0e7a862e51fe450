"""CPU tier loads: what bringing a model from the disk tier into memory costs, first and again.

    python bench/tier_loads.py --mb 512 --runs 5 --json OUT.json

A model evicted from the CPU tier is loaded again on its next acquire, the scale from zero of
a function whose model was evicted waits for it. This script times the daemon's CPU tier
itself (``CpuTier.load``, no daemon process, no client) on a ``--mb`` MiB layout committed to a
disk tier in a temporary folder, with its page cache warm, for each backing:

- ``memfd``: a sealed memfd copy. ``first``: a tier that knows no chunk digests of the layout
  (as for a store added by a trims before them): the copy is hashed whole, sequentially, plus
  its chunks on a thread pool; ``again``: the same tier after freeing it, which checks the copy
  against those chunk digests on every core (Note [chunk digests] in
  trims.daemon.tiers.chunks); ``restart``: a fresh tier that knows the chunk digests but has
  verified nothing, as a restarted daemon that read them from its catalog (or one whose
  commit computed them).
- ``file``: the disk file kept in the page cache. ``first``: hashed as it is mapped; ``again``:
  mapped without a hash, its stamp unchanged since the first load verified it (Note [trusted
  re-loads] in trims.daemon.residency); ``restart``: the stamp is not trusted, the chunk
  digests are known: checked on every core.

It also times the disk tier's commit of the same layout (``disk`` / ``commit``: the hash of a
new blob before it is placed), whole only (``pool=None``) and with chunk digests computed
beside (``commit+chunks``, the daemon's default where a core is free), and two checks of the
committed blob against its chunk digests: ``verify`` reads it through the page cache (a check
after its stamp moved), ``scrub`` from the device (``O_DIRECT``, as ``trims models verify``
does: Note [scrub reads the device] in trims.daemon.tiers.disk).

Runs alternate the backings; each run is one of each load. JSON: ``{"results": [{"backing",
"load", "ms", "min_ms", "max_ms", "hashed_mib", "vs_first", "runs"}], "mb", "machine",
"quick"}`` (``vs_first``: the median over the first load's, or over ``commit``'s); the
markdown table goes to stdout (and ``--markdown``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trims.daemon.formats.writer import LayoutWriter
from trims.daemon.tiers.chunks import ChunkDigests
from trims.daemon.tiers.cpu import CpuTier
from trims.daemon.tiers.disk import DiskTier
from trims.layout import Manifest, TensorSpec
from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import check_size_run_options, machine, size_run_options, write_outputs

#: bytes of each tensor of the layout (64 MiB)
TENSOR = 64 << 20
BACKINGS = ("memfd", "file")


def commit_layout(disk: DiskTier, mb: int) -> Manifest:
    """A layout of ``mb`` MiB (whole 64 MiB tensors of random bytes) in ``disk``."""
    import numpy as np

    rng = np.random.default_rng(0)
    temp = disk.new_temp()
    with LayoutWriter(temp, source=Path("bench")) as writer:
        for i in range(max(1, (mb << 20) // TENSOR)):
            data = rng.integers(0, 255, TENSOR, dtype=np.uint8).tobytes()
            writer.add(TensorSpec(f"t{i}", "uint8", (TENSOR,)), [data])
        manifest: Manifest = writer.finish(
            name="bench", version="1", framework="bench", metadata={}
        )
    disk.commit(temp, manifest)
    return manifest


LOADS = ("first", "again", "restart")
COMMITS = ("commit", "commit+chunks")
CHECKS = ("verify", "scrub")


def one_run(backing: str, path: Path, manifest: Manifest) -> dict[str, tuple[float, int]]:
    """{load: (seconds, bytes hashed)} for fresh tiers of ``backing`` (see the docstring)."""
    pool, restarted = ChunkDigests(), ChunkDigests()
    tier = CpuTier(backing, pool=pool)
    out: dict[str, tuple[float, int]] = {}
    try:
        verified = None
        for load in LOADS:
            if load == "restart":
                known = pool.get(manifest.digest)
                assert known is not None, "the first load computed no chunk digests"
                restarted.learn(manifest.digest, known)
                tier.close()
                tier, verified = CpuTier(backing, pool=restarted), None
            t0 = time.perf_counter()
            loaded = tier.load(manifest.digest, path, manifest.total_bytes, "bench", None, verified)
            out[load] = (time.perf_counter() - t0, loaded.hashed)
            verified = loaded.stamp
            tier.free(manifest.digest)
    finally:
        tier.close()
        pool.close()
        restarted.close()
    return out


def commit_run(disk: DiskTier, path: Path, manifest: Manifest) -> dict[str, tuple[float, int]]:
    """{"commit" | "commit+chunks" | "verify" | "scrub": (seconds, bytes hashed)}: a copy of
    the blob committed again (hashed, then found already on disk), without and with chunk
    digests beside; then the blob checked against those digests through the page cache, as a
    moved stamp is, and from the device, as ``trims models verify`` does."""
    out: dict[str, tuple[float, int]] = {}
    for name in COMMITS:
        pool = ChunkDigests() if name == "commit+chunks" else None
        temp = disk.new_temp()
        shutil.copyfile(path, temp)
        tier = DiskTier(disk.root, disk.budget, pool)
        try:
            t0 = time.perf_counter()
            tier.commit(temp, manifest)
            out[name] = (time.perf_counter() - t0, manifest.total_bytes)
            if pool is None:
                continue
            assert pool.get(manifest.digest) is not None
            for check in CHECKS:
                t0 = time.perf_counter()
                tier.verify(manifest.digest, direct=check == "scrub")
                out[check] = (time.perf_counter() - t0, manifest.total_bytes)
        finally:
            if pool is not None:
                pool.close()
    return out


def measure(mb: int, runs: int) -> tuple[int, list[dict[str, Any]]]:
    times: dict[tuple[str, str], list[tuple[float, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="trims-tier-loads-") as tmp:
        disk = DiskTier(Path(tmp) / "disk", 1 << 40)
        manifest = commit_layout(disk, mb)
        path = disk.path(manifest.digest)
        for run in range(runs):
            order = BACKINGS if run % 2 == 0 else BACKINGS[::-1]
            for backing in order:
                for load, result in one_run(backing, path, manifest).items():
                    times.setdefault((backing, load), []).append(result)
            for load, result in commit_run(disk, path, manifest).items():
                times.setdefault(("disk", load), []).append(result)
    results = []
    for backing, loads in (*((b, LOADS) for b in BACKINGS), ("disk", COMMITS + CHECKS)):
        first = statistics.median(t for t, _ in times[(backing, loads[0])])
        for load in loads:
            results.append(_row(backing, load, times[(backing, load)], first))
    return manifest.total_bytes >> 20, results


def _row(backing: str, load: str, rs: list[tuple[float, int]], first: float) -> dict[str, Any]:
    ms = [t * 1e3 for t, _ in rs]
    return {
        "backing": backing,
        "load": load,
        "ms": statistics.median(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
        "hashed_mib": statistics.median(h for _, h in rs) / (1 << 20),
        "vs_first": statistics.median(t for t, _ in rs) / first,
        "runs": len(rs),
    }


def render(doc: dict[str, Any]) -> str:
    label = " (quick: a check, not a measurement)" if doc["quick"] else ""
    head = (
        f"CPU tier loads of a {doc['mb']} MiB layout, page cache warm{label}; {doc['machine']}; "
        f"medians (min-max) of {doc['results'][0]['runs']} runs."
    )
    rows = [
        [
            r["backing"],
            r["load"],
            f"{r['ms']:.1f} ({r['min_ms']:.1f}-{r['max_ms']:.1f})",
            f"{r['hashed_mib']:.0f}",
            f"{r['vs_first']:.2f}x",
        ]
        for r in doc["results"]
    ]
    table = markdown_table(["backing", "load", "ms", "MiB hashed", "vs first"], rows)
    return f"{head}\n\n{table}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_run_options(parser, "layout size, in whole 64 MiB")
    args = parser.parse_args()
    check_size_run_options(parser, args)
    where = machine()
    mb, results = measure(args.mb, args.runs)
    doc = {"results": results, "mb": mb, "machine": where, "quick": args.quick}
    write_outputs(args.json, args.markdown, doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
