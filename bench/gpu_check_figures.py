"""The figures the GPU check kit pulls out of the kernel studies' JSON (``trims kernels ...``).

Only what a study's JSON holds: nothing here estimates or fills in a number. Each function
takes the study's JSON document and returns the step's ``figures``; a figure the study did not
produce is left out (docs/gpu.md lists the ones no study produces today).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GB = 1e9


def _largest(rows: Sequence[dict[str, Any]], key: str = "total") -> list[dict[str, Any]]:
    top = max((r[key] for r in rows), default=None)
    return [r for r in rows if r[key] == top]


def tcu(doc: dict[str, Any]) -> dict[str, Any]:
    """Full reduction as a fraction of the device-to-device copy (paper: 89-98% on V100), and
    segmented reduce/scan against CUB at segments 16 and 256 (paper: up to 100x / 3x), at the
    largest size measured."""
    rows = _largest(doc.get("rows", []))
    if not rows:
        return {}
    figures: dict[str, Any] = {"elements": rows[0]["total"]}
    full = [r for r in rows if r["operation"] == "reduce" and r["segment"] == 0]
    figures["full_reduce_copy_fraction"] = {r["method"]: r["copy_fraction"] for r in full}
    copy = [r["elements_per_s"] / r["copy_fraction"] for r in rows if r["copy_fraction"] > 0]
    if copy:  # tcu_bench times one fp16 device-to-device copy per size: 2 bytes an element
        figures["copy_gb_per_s"] = 2 * copy[0] / GB
    speedups: dict[str, dict[str, float]] = {}
    for op in ("reduce", "scan"):
        for segment in (16, 256):
            here = [r for r in rows if r["operation"] == op and r["segment"] == segment]
            base = [r for r in here if r["method"].endswith(("-sum", "-cumsum"))]
            if not base:
                continue
            figures["baseline"] = base[0]["method"].split("-")[0]  # cub on the GPU
            speedups[f"{op}_segment_{segment}"] = {
                r["method"]: base[0]["seconds"] / r["seconds"]
                for r in here
                if r is not base[0] and r["seconds"] > 0
            }
    figures["speedup_vs_baseline"] = speedups
    errors = [r["error_ratio"] for r in doc.get("rows", []) if r.get("error_ratio") is not None]
    if errors:
        figures["worst_error_ratio"] = max(errors)
    return figures


def klap(doc: dict[str, Any]) -> dict[str, Any]:
    """Geometric-mean speedup of each launch variant over one launch per parent (paper: 6.58x
    over plain dynamic parallelism), and where the per-parent launches ran (device CDP or host)."""
    rows = doc.get("rows", [])
    sides = sorted({r["launch_side"] for r in rows if r["variant"] == "per-parent"})
    return {
        "geomean_speedup_over_per_parent": doc.get("geomean_speedup", {}),
        "per_parent_launch_side": sides,
        "all_correct": all(r["correct"] for r in rows),
    }


def transfer(doc: dict[str, Any]) -> dict[str, Any]:
    """GB/s per GPU modality and cache state at the largest size measured."""
    rows = _largest([r for r in doc.get("rows", []) if r["domain"] == "gpu"], key="size")
    if not rows:
        return {}
    return {
        "size_bytes": rows[0]["size"],
        "gb_per_s": {f"{r['modality']} ({r['cache']})": r["bandwidth"] / GB for r in rows},
    }


def als(doc: dict[str, Any]) -> dict[str, Any]:
    """Seconds per implicit-ALS iteration on the GPU beside the ``implicit`` library (its CPU
    path: the study runs no other), and the explicit model's."""
    imp, exp = doc.get("implicit", {}), doc.get("explicit", {})
    figures: dict[str, Any] = {
        "dataset": imp.get("dataset"),
        "implicit_s_per_iter": imp.get("s_per_iter"),
        "implicit_precision_at_10": imp.get("precision_at_10"),
        "peer_cpu_s_per_iter": imp.get("peer_s_per_iter"),
        "peer_precision_at_10": imp.get("peer_precision_at_10"),
        "explicit_s_per_iter": exp.get("s_per_iter"),
        "explicit_rmse": exp.get("rmse"),
    }
    if imp.get("peer_s_per_iter") and imp.get("s_per_iter"):
        figures["speedup_vs_peer_cpu"] = imp["peer_s_per_iter"] / imp["s_per_iter"]
    return figures


EXTRACT = {"tcu": tcu, "klap": klap, "transfer": transfer, "als": als}
