"""Figures for the studies (matplotlib with the Agg backend, imported only here)."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    log.info("figure written to %s", path)
    return path


def tcu(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Throughput vs total size (segment 256 and full), and copy fraction vs segment size."""
    plt = _pyplot()
    paths = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    for col, op in enumerate(("reduce", "scan")):
        for row, segment in enumerate((256, 0)):
            ax = axes[row][col]
            lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
            for r in rows:
                if r["operation"] == op and r["segment"] == segment:
                    lines[r["method"]].append((r["total"], r["elements_per_s"]))
            for method, pts in sorted(lines.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, segment {segment or 'full'}")
            ax.set_xlabel("total elements")
            ax.set_ylabel("elements/s")
            ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "tcu_throughput.png"))
    largest = max((r["total"] for r in rows), default=0)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for col, op in enumerate(("reduce", "scan")):
        ax = axes[0][col]
        lines = defaultdict(list)
        for r in rows:
            if r["operation"] == op and r["total"] == largest and r["segment"] > 0:
                lines[r["method"]].append((r["segment"], r["copy_fraction"]))
        for method, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op}: fraction of copy bandwidth, {largest} elements")
        ax.set_xlabel("segment size")
        ax.legend(fontsize=7)
    paths.append(_save(fig, out_dir / "tcu_segments.png"))
    return paths


def klap(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Speedup over per-parent launches, per app and variant."""
    plt = _pyplot()
    apps = sorted({r["app"] for r in rows})
    variants = [
        v for v in ("warp", "block", "grid", "flat") if any(r["variant"] == v for r in rows)
    ]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        ys = [next((r["speedup"] for r in rows if r["app"] == a and r["variant"] == v), 0)
              for a in apps]  # fmt: skip
        ax.bar([j + i * width for j in range(len(apps))], ys, width, label=v)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(apps))], apps)
    ax.set_yscale("log")
    ax.set_ylabel("speedup over per-parent launches")
    ax.legend()
    return [_save(fig, out_dir / "klap_speedup.png")]


def transfer(rows: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Bandwidth vs size per modality, one panel per domain (host, ipc, gpu)."""
    plt = _pyplot()
    domains = [d for d in ("host", "ipc", "gpu") if any(r["domain"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(domains), figsize=(6 * len(domains), 4.5), squeeze=False)
    for ax, domain in zip(axes[0], domains, strict=True):
        lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if r["domain"] == domain:
                label = r["modality"] + (
                    "" if r["cache"] in ("n/a", "warm") else f" ({r['cache']})"
                )
                if domain == "host" and r["cache"] == "warm":
                    label += " (warm)"
                lines[label].append((r["size"], r["bandwidth"] / 1e9))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_ylabel("GB/s")
        ax.set_title(domain)
        ax.legend(fontsize=7)
    return [_save(fig, out_dir / "transfer_bandwidth.png")]


def als(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Seconds per iteration and precision@10: ours vs the implicit library."""
    plt = _pyplot()
    imp = result["implicit"]
    if imp.get("peer_s_per_iter") is None:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    names = ["trims.kernels.als", "implicit"]
    axes[0].bar(names, [imp["s_per_iter"], imp["peer_s_per_iter"]], color=["C0", "C1"])
    axes[0].set_ylabel("seconds / iteration")
    axes[1].bar(names, [imp["precision_at_10"], imp["peer_precision_at_10"]], color=["C0", "C1"])
    axes[1].set_ylabel("precision@10")
    fig.suptitle(f"implicit ALS, {imp.get('factors')} factors")
    return [_save(fig, out_dir / "als_implicit.png")]
