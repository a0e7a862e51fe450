"""Cold model acquisition: the trims store vs the usual loaders, and memory of 8 instances.

    python bench/acquire.py --sizes-mb 100,1000 --runs 5 --json OUT.json [--docs docs/store.md]

For each size a synthetic float32 model (4 MiB weight + bias per layer) is written as a
safetensors file and a torch state dict, and added to a trims daemon this script starts on a
temporary socket (then loaded into its CPU tier). Each method runs ``--runs`` times, each time
in a fresh process, and times from "framework imported" to "every tensor usable by torch":

* ``trims``            acquire from the CPU tier + ``torch.frombuffer`` views (torch adapter)
* ``trims_touch``      the same, then reading one value per page (every page mapped in)
* ``torch_load``       ``torch.load(weights_only=True)``
* ``torch_load_mmap``  ``torch.load(mmap=True, weights_only=True)``, then touching every page
* ``safetensors``      ``safetensors.torch.load_file``, then touching every page (since
                       safetensors 0.5 the file is mapped lazily, like ``mmap=True``)

Every worker calls ``gc.freeze()`` after its imports, as a pre-forking runtime does
(otherwise a garbage collection over torch's import-time objects, ~0.1 s, lands in whichever
method allocates enough first). Each file method runs with the file ``warm`` in the page cache
(the best case for it) and ``cold`` (dropped from the page cache with
``posix_fadvise(DONTNEED)`` before the run: a node that has not read the model lately). The
trims store is in memory either way. The memory
section starts ``--instances`` processes that hold the same model at once (every page touched)
and sums their PSS (``/proc/PID/smaps_rollup``) minus that of as many idle processes: with the
store (one shared copy) vs each process loading its own copy (``torch_load``), and
``safetensors`` (private mappings of one page-cached file).
Writes JSON (``--json``), a markdown table next to it (``.md``), and optionally replaces the
table between ``<!-- bench:acquire -->`` markers in ``--docs``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trims.tables import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime_common import pss_bytes, start_daemon, summary

METHODS = ("trims", "trims_touch", "torch_load", "torch_load_mmap", "safetensors")
LAYER_ROWS = 1024  # a layer: a 1024 x 1024 float32 weight (4 MiB) and a 1024 bias
MARK_START = "<!-- bench:acquire:start -->"
MARK_END = "<!-- bench:acquire:end -->"


@dataclass(frozen=True)
class BenchSettings:
    sizes_mb: tuple[int, ...]
    runs: int
    json_path: Path
    docs: Path | None
    instances: int
    memory_mb: int
    workdir: Path | None
    caches: tuple[str, ...]


# ---- worker side (a fresh process per measurement) ------------------------------------------


def _touch(tensors: dict[str, Any]) -> float:
    """Read one float per 4 KiB page of every tensor, so every page is mapped in."""
    total = 0.0
    for t in tensors.values():
        flat = t.reshape(-1)
        total += float(flat[:: max(1, 4096 // flat.element_size())].sum())
    return total


def worker(method: str, path: str, socket_path: str, name: str, hold: bool) -> None:
    """Load by ``method``; print seconds (and, with ``hold``, wait on stdin before exiting)."""
    import torch
    from safetensors.torch import load_file

    from trims.runtime.adapters import torch as torch_adapter
    from trims.runtime.client import StoreClient

    # A pre-forking runtime (the zygote) freezes what its imports created, so a collection in
    # the timed region does not walk torch's hundreds of thousands of objects. Same for all.
    gc.freeze()
    client = lease = None
    t0 = time.perf_counter()
    if method.startswith("trims"):
        client = StoreClient(socket_path)
        lease = client.acquire(name)
        tensors = torch_adapter.tensors(lease)
        if method == "trims_touch" or hold:
            _touch(tensors)
    elif method == "torch_load":
        tensors = torch.load(path, weights_only=True)
    elif method == "torch_load_mmap":
        tensors = torch.load(path, mmap=True, weights_only=True)
        _touch(tensors)
    elif method == "safetensors":
        tensors = load_file(path)
        _touch(tensors)
    else:
        raise SystemExit(f"unknown method {method}")
    elapsed = time.perf_counter() - t0
    if hold:
        _touch(tensors)
    print(json.dumps({"seconds": elapsed}), flush=True)
    if hold:
        sys.stdin.readline()
    if lease is not None and client is not None:
        lease.release()
        client.close()


# ---- driver side ----------------------------------------------------------------------------


def make_model(size_mb: int, folder: Path) -> tuple[Path, Path]:
    """A ``size_mb`` MiB model as safetensors and torch files; returns both paths."""
    import torch
    from safetensors.torch import save_file

    layers = max(1, size_mb // 4)
    gen = torch.Generator().manual_seed(size_mb)
    state = {}
    for i in range(layers):
        state[f"layers.{i}.weight"] = torch.rand(LAYER_ROWS, LAYER_ROWS, generator=gen)
        state[f"layers.{i}.bias"] = torch.rand(LAYER_ROWS, generator=gen)
    st, pt = folder / f"model{size_mb}.safetensors", folder / f"model{size_mb}.pt"
    save_file(state, str(st))
    torch.save(state, pt)
    for path in (st, pt):  # clean pages, so the cold runs can drop them from the page cache
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return st, pt


def drop_from_page_cache(path: Path) -> None:
    """Evict a (clean, fsynced) file's pages from the page cache; needs no privileges."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(16 << 20):
            pass


def run_worker(method: str, path: Path, socket: Path, name: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", method, str(path), str(socket), name],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{method} worker failed:\n{out.stderr}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def measure_times(settings: BenchSettings, socket: Path, folder: Path) -> list[dict[str, Any]]:
    from trims.runtime.client import StoreClient

    results: list[dict[str, Any]] = []
    for size in settings.sizes_mb:
        st, pt = make_model(size, folder)
        name = f"bench{size}"
        with StoreClient(socket, timeout=3600) as c:
            c.add(name, st)
            c.load(name, tier="cpu")
        paths = {"torch_load": pt, "torch_load_mmap": pt, "safetensors": st}
        for cache in settings.caches:
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(settings.runs):
                for method in METHODS:
                    path = paths.get(method, st)
                    if cache == "cold":
                        drop_from_page_cache(path)
                    else:
                        warm_page_cache(path)
                    times[method].append(run_worker(method, path, socket, name)["seconds"])
            base = summary(times["trims"])["median_s"]
            for method in METHODS:
                s = summary(times[method])
                results.append({"size_mb": size, "method": method, "cache": cache, **s,
                                "ratio_vs_trims": s["median_s"] / base})  # fmt: skip
                print(f"{size:>6} MiB {cache:<4} {method:<16} median {s['median_s']:.4f} s",
                      file=sys.stderr)  # fmt: skip
        with StoreClient(socket) as c:
            c.remove(name)
        st.unlink()
        pt.unlink()
    return results


def hold_instances(method: str, count: int, path: Path, socket: Path, name: str) -> float:
    """Start ``count`` holders at once; their total PSS in MiB once all hold the model."""
    return _total_pss_mib(["--worker", method, str(path), str(socket), name, "--hold"], count)


def _total_pss_mib(args: list[str], count: int) -> float:
    """Start ``count`` copies of this script with ``args``; their total PSS once all are ready.

    Each says it is ready with one line on stdout and waits for one on stdin to exit.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            if not p.stdout.readline():
                raise RuntimeError(f"{' '.join(args)}: process {p.pid} exited before it was ready")
        # Read only when every process is ready: shared pages are then split by all.
        return sum(pss_bytes(p.pid) for p in procs) / 2**20
    finally:
        for p in procs:
            assert p.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                p.stdin.write("\n")
                p.stdin.close()
        for p in procs:
            p.wait(60)


def measure_memory(settings: BenchSettings, socket: Path, folder: Path) -> dict[str, Any]:
    from trims.runtime.client import StoreClient

    st, pt = make_model(settings.memory_mb, folder)
    name = "memory"
    with StoreClient(socket, timeout=3600) as c:
        c.add(name, st)
        c.load(name, tier="cpu")
    idle = _idle_pss_mib(settings.instances)
    pss: dict[str, float] = {}
    totals: dict[str, float] = {}
    for label, method, path in (
        ("trims", "trims", st),
        ("baseline", "torch_load", pt),
        ("safetensors", "safetensors", st),
    ):
        total = hold_instances(method, settings.instances, path, socket, name)
        totals[label] = total
        pss[label] = total - idle
    return {
        "instances": settings.instances,
        "model_mb": settings.memory_mb,
        "pss_mb": {k: round(v, 1) for k, v in pss.items()},
        "total_pss_mb": {k: round(v, 1) for k, v in totals.items()},
        "idle_pss_mb": round(idle, 1),
    }


def _idle_pss_mib(count: int) -> float:
    """Total PSS of ``count`` processes that imported everything but hold no model."""
    return _total_pss_mib(["--idle"], count)


def idle() -> None:
    import torch
    from safetensors.torch import load_file  # noqa: F401

    from trims.runtime.adapters import torch as torch_adapter  # noqa: F401
    from trims.runtime.client import StoreClient  # noqa: F401

    # Run the same reduction the holders run, so torch's thread pool exists here too.
    _touch({"warm-up": torch.ones(LAYER_ROWS * LAYER_ROWS)})
    print("ready", flush=True)
    sys.stdin.readline()


def markdown(report: dict[str, Any]) -> str:
    touch = {
        (r["size_mb"], r["cache"]): r["median_s"]
        for r in report["results"]
        if r["method"] == "trims_touch"
    }
    header = ["size (MiB)", "page cache", "method", "median (s)", "min (s)", "max (s)",
              "x trims", "x trims_touch"]  # fmt: skip
    rows = [
        [r["size_mb"], r["cache"], r["method"], f"{r['median_s']:.4f}", f"{r['min_s']:.4f}",
         f"{r['max_s']:.4f}", f"{r['ratio_vs_trims']:.1f}",
         f"{r['median_s'] / touch[(r['size_mb'], r['cache'])]:.1f}"]
        for r in report["results"]
    ]  # fmt: skip
    lines = [markdown_table(header, rows, align="rllrrrrr")]
    mem = report.get("memory")
    if mem:
        labels = {
            "trims": "trims (one shared copy)",
            "baseline": "torch_load (own copy each)",
            "safetensors": "safetensors (page-cache mappings)",
        }
        pss = [
            [label, f"{mem['pss_mb'][k]:.0f}", f"{mem['pss_mb'][k] / mem['model_mb']:.2f}"]
            for k, label in labels.items()
        ]
        lines += [
            "",
            f"Memory: {mem['instances']} processes holding one {mem['model_mb']} MiB model at "
            f"once (sum of their PSS minus {mem['instances']} idle processes, "
            f"{mem['idle_pss_mb']:.0f} MiB):",
            "",
            markdown_table(["", "model PSS, all processes (MiB)", "x one model"], pss, align="lrr"),
        ]
    m = report["machine"]
    lines += ["", f"Measured on {m['cpus']} CPUs, {m['platform']}, Python {m['python']}."]
    return "\n".join(lines) + "\n"


def update_docs(docs: Path, table: str, command: str) -> None:
    from trims.config import write_atomic

    text = docs.read_text() if docs.exists() else ""
    block = f"{MARK_START}\n`{command}`\n\n{table}{MARK_END}"
    if MARK_START in text and MARK_END in text:
        head, rest = text.split(MARK_START, 1)
        text = head + block + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    write_atomic(docs, text)


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list[:1] == ["--worker"]:
        method, path, sock, name = args_list[1:5]
        worker(method, path, sock, name, hold="--hold" in args_list)
        return 0
    if args_list[:1] == ["--idle"]:
        idle()
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes-mb", default="100,1000", help="model sizes in MiB, comma separated")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per method and size")
    p.add_argument("--json", type=Path, required=True, help="where to write the JSON report")
    p.add_argument("--docs", type=Path, help="markdown file whose bench:acquire block to replace")
    p.add_argument("--instances", type=int, default=8, help="processes in the memory section")
    p.add_argument("--memory-mb", type=int, default=500, help="model size for the memory section")
    p.add_argument("--workdir", type=Path, help="where to put model files (default: a temp dir)")
    p.add_argument("--cache", default="warm,cold", help="page-cache states for file loaders")
    a = p.parse_args(args_list)
    settings = BenchSettings(
        sizes_mb=tuple(int(s) for s in a.sizes_mb.split(",") if s),
        runs=a.runs,
        json_path=a.json,
        docs=a.docs,
        instances=a.instances,
        memory_mb=a.memory_mb,
        workdir=a.workdir,
        caches=tuple(c for c in a.cache.split(",") if c in ("warm", "cold")),
    )
    root = Path(tempfile.mkdtemp(prefix="trims-bench-", dir=settings.workdir))
    daemon = None
    try:
        daemon, socket = start_daemon(root, cpu_budget="20GiB", disk_budget="100GiB")
        report: dict[str, Any] = {
            "results": measure_times(settings, socket, root),
            "memory": measure_memory(settings, socket, root) if settings.instances else None,
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
        }
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    from trims.config import write_atomic

    write_atomic(settings.json_path, json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    write_atomic(settings.json_path.with_suffix(".md"), table)
    if settings.docs is not None:
        update_docs(settings.docs, table, "python bench/acquire.py " + " ".join(args_list))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
