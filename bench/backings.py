"""Backings side by side: what a fresh worker pays to read a model the CPU tier hands it.

    python bench/backings.py --mb 512 --runs 5 --json OUT.json

The CPU tier can hand a worker its model as a sealed memfd (``memfd``: shmem, in 4 KiB pages
where shmem huge pages are off, as on most nodes) or as the verified disk file in the page cache
(``file``). The issue that asked for a fast first request also named a third: a memfd in the
node's hugetlb pool (``hugetlb``: ``MFD_HUGETLB``, sealed as the others). This script measures
the three side by side: a child process started for each run maps the model as a worker does
(``MAP_PRIVATE``, read and write) and reads every byte twice; ``first_ms`` is the first pass
(page faults included: ``faults``), ``again_ms`` the second, ``map_ms`` the ``mmap`` call,
``reserved_mib`` the hugetlb pool the mapping reserved (``HugePages_Rsvd``).

hugetlb pages come from a pool that must be set aside beforehand (``vm.nr_hugepages``), and a
private mapping of a hugetlb file reserves as many pool pages again for its copy-on-write
copies when it is made: so each worker's mapping needs a second copy's worth of free pool,
and ``mmap`` fails where the pool lacks it (``private_map_error``). Where it fails, the run
maps ``MAP_SHARED`` read-only instead (``mapping``), which a handler that writes to a weight
would crash on. ``--hugetlb-pool auto`` (the default) grows the pool by what the runs need
when this runs as root and puts it back afterwards; ``--hugetlb-pool 0`` uses only what is
free; where the pool cannot hold the model the backing is skipped and the output says so.

Runs alternate the backings. JSON: ``{"results": [{"backing", "mapping", "map_ms",
"first_ms", "again_ms", "faults", "reserved_mib", "first_min_ms", "first_max_ms", "runs",
"private_map_error"}], "notes", "mb", "machine", "quick"}``; the markdown table goes to stdout
(and ``--markdown``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from trims.daemon.tiers.memfd import SEALS
from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import check_size_run_options, machine, size_run_options, write_outputs

HUGE = 2 << 20
BACKINGS = ("memfd", "file", "hugetlb")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _fill(view: memoryview | mmap.mmap, size: int) -> None:
    """Weights-like bytes: every 4 KiB page different."""
    import numpy as np

    arr = np.frombuffer(view, dtype=np.uint32, count=size // 4)
    arr[:] = np.arange(size // 4, dtype=np.uint32)
    del arr


def sealed_memfd(size: int, huge: bool) -> int:
    """A sealed memfd of ``size`` bytes written through a shared mapping (hugetlbfs has no
    ``write``); with ``huge`` in the hugetlb pool."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if huge else 0)
    fd = os.memfd_create("backings", flags)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            _fill(m, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def page_cache_file(folder: Path, size: int) -> int:
    """A read-only fd of a file of ``size`` bytes, written, fsynced and read once (cached)."""
    path = folder / "model.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            _fill(m, size)
            m.flush()
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    done = 0
    while done < size:
        done += len(os.pread(fd, 4 << 20, done))
    return fd


def child(fd: int, size: int) -> dict[str, Any]:
    """In the fresh process: map ``fd`` as a worker does and read it twice."""
    import numpy as np

    out: dict[str, Any] = {"mapping": "private", "private_map_error": None}
    reserved = _meminfo("HugePages_Rsvd")
    t0 = time.perf_counter()
    try:
        m = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        out["private_map_error"] = f"{e.strerror} (errno {e.errno})"
        out["mapping"] = "shared, read-only"
        t0 = time.perf_counter()
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    out["map_ms"] = (time.perf_counter() - t0) * 1e3
    out["reserved_mib"] = (_meminfo("HugePages_Rsvd") - reserved) * HUGE >> 20
    words = np.frombuffer(m, dtype=np.uint64)
    for name in ("first", "again"):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        np.bitwise_xor.reduce(words)
        out[f"{name}_ms"] = (time.perf_counter() - t0) * 1e3
        if name == "first":
            out["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    del words
    m.close()
    return out


def run_child(fd: int, size: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(fd), str(size)],
        pass_fds=[fd],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


class HugetlbPool:
    """Room for ``pages`` more huge pages: the pool grown by what is missing (as root, with
    ``grow``) and put back at exit; ``ok`` False (and ``note``) where there is no room."""

    def __init__(self, pages: int, grow: bool) -> None:
        self.before: int | None = None
        self.note = ""
        missing = pages - _meminfo("HugePages_Free")
        if missing > 0 and grow and os.geteuid() == 0 and NR_HUGEPAGES.exists():
            self.before = int(NR_HUGEPAGES.read_text())
            NR_HUGEPAGES.write_text(str(self.before + missing))
            missing = pages - _meminfo("HugePages_Free")
        self.ok = missing <= 0
        if not self.ok:
            self.note = (
                f"hugetlb skipped: the pool has {_meminfo('HugePages_Free')} free 2 MiB pages, "
                f"{pages} needed (run as root with --hugetlb-pool auto, or set vm.nr_hugepages)"
            )

    def close(self) -> None:
        if self.before is not None:
            NR_HUGEPAGES.write_text(str(self.before))


def measure(mb: int, runs: int, grow: bool) -> tuple[list[dict[str, Any]], list[str]]:
    size = (mb << 20) // HUGE * HUGE or HUGE
    results: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKINGS}
    notes: list[str] = []
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trims-bk-")))
        # the model, and a private mapping's reservation of as much again
        pool = HugetlbPool(2 * size // HUGE, grow)
        stack.callback(pool.close)
        backings = [b for b in BACKINGS if b != "hugetlb" or pool.ok]
        if pool.note:
            notes.append(pool.note)
        fds = {
            "memfd": sealed_memfd(size, huge=False),
            "file": page_cache_file(folder, size),
        }
        if pool.ok:
            fds["hugetlb"] = sealed_memfd(size, huge=True)
        for fd in fds.values():
            stack.callback(os.close, fd)
        for run in range(runs):
            for backing in backings if run % 2 == 0 else backings[::-1]:
                results[backing].append(run_child(fds[backing], size))
    rows = []
    for backing in backings:
        rs = results[backing]
        firsts = [r["first_ms"] for r in rs]
        rows.append(
            {
                "backing": backing,
                "mapping": rs[0]["mapping"],
                "map_ms": statistics.median(r["map_ms"] for r in rs),
                "first_ms": statistics.median(firsts),
                "again_ms": statistics.median(r["again_ms"] for r in rs),
                "faults": statistics.median(r["faults"] for r in rs),
                "reserved_mib": statistics.median(r["reserved_mib"] for r in rs),
                "first_min_ms": min(firsts),
                "first_max_ms": max(firsts),
                "runs": len(rs),
                "private_map_error": rs[0]["private_map_error"],
            }
        )
    return rows, notes


def render(doc: dict[str, Any]) -> str:
    label = " (quick: a check, not a measurement)" if doc["quick"] else ""
    head = (
        f"A {doc['mb']} MiB model read twice by a fresh process{label}; {doc['machine']}; "
        "medians (min-max)."
    )
    rows = [
        [
            r["backing"],
            r["mapping"],
            f"{r['map_ms']:.2f}",
            f"{r['first_ms']:.1f} ({r['first_min_ms']:.1f}-{r['first_max_ms']:.1f})",
            f"{r['again_ms']:.1f}",
            f"{r['faults']:.0f}",
            f"{r['reserved_mib']:.0f}",
        ]
        for r in doc["results"]
    ]
    table = markdown_table(
        [
            "backing",
            "mapping",
            "map ms",
            "first read ms",
            "second read ms",
            "faults",
            "pool MiB reserved",
        ],
        rows,
    )
    notes = "".join(f"\nNote: {n}\n" for n in doc["notes"])
    errors = "".join(
        f"\n{r['backing']}: a private mapping failed ({r['private_map_error']})\n"
        for r in doc["results"]
        if r["private_map_error"]
    )
    return f"{head}\n\n{table}\n{errors}{notes}"


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]), int(sys.argv[3]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_run_options(parser, "model size (whole 2 MiB pages)")
    parser.add_argument(
        "--hugetlb-pool",
        choices=("auto", "0"),
        default="auto",
        help="auto: as root, grow vm.nr_hugepages for the run and put it back; 0: use what is free",
    )
    args = parser.parse_args()
    check_size_run_options(parser, args, min_mb=2)
    where = machine()
    results, notes = measure(args.mb, args.runs, args.hugetlb_pool == "auto")
    doc = {
        "results": results,
        "notes": notes,
        "mb": args.mb,
        "machine": where,
        "quick": args.quick,
    }
    write_outputs(args.json, args.markdown, doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
