"""bench/peers.py's report: a table per case with every system in rows and its ratio to the best
peer, the issue's targets met or missed, and a figure (bars per case, the best peer marked)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, NamedTuple

from trims.tables import markdown_table


class Case(NamedTuple):
    """One figure per system that the systems are compared on."""

    key: str
    title: str
    unit: str
    lower_is_better: bool
    values: dict[str, float]
    #: the target: trims' value at most (or, higher is better, at least) factor x best peer's
    factor: float | None
    target: str

    def best_peer(self) -> tuple[str, float] | None:
        peers = [(s, v) for s, v in self.values.items() if s != "trims"]
        if not peers:
            return None
        pick = min if self.lower_is_better else max
        return pick(peers, key=lambda sv: sv[1])

    def ratio(self, system: str) -> float | None:
        best = self.best_peer()
        if best is None or system not in self.values or best[1] == 0:
            return None
        return self.values[system] / best[1]

    def met(self) -> bool | None:
        r = self.ratio("trims")
        if r is None or self.factor is None:
            return None
        return r <= self.factor if self.lower_is_better else r >= self.factor


def _cold(doc: dict[str, Any], system: str, case: str, tier: str | None, cache: str) -> Any:
    for r in doc.get("cold_start", []):
        if (r["system"], r["case"], r["tier"], r["cache"]) == (system, case, tier, cache):
            return r
    return None


def _loop(doc: dict[str, Any], mode: str, concurrency: int | None) -> dict[str, Any]:
    return {
        r["system"]: r
        for r in doc.get("throughput", [])
        if r["mode"] == mode and r["concurrency"] == concurrency
    }


def _values(rows: dict[str, Any], field: str) -> dict[str, float]:
    return {s: r[field] for s, r in rows.items() if r is not None and r.get(field) is not None}


def cases(doc: dict[str, Any]) -> list[Case]:
    """Every case of ``doc`` that a system was measured on."""
    systems = doc.get("systems", [])
    peers = [s for s in systems if s != "trims"]
    out: list[Case] = []
    for cache, cold_factor, cold_target in (
        ("warm", 1.0, "at most the best peer's in-process load"),
        ("dropped", 0.5, "at most 0.5x the best peer's in-process load"),
    ):
        rows = {"trims": _cold(doc, "trims", "scale_from_zero", "cpu", cache)}
        rows |= {p: _cold(doc, p, "load", None, cache) for p in peers}
        out.append(
            Case(
                f"overhead_{cache}",
                f"cold-start overhead, page cache {cache} (trims: scale from zero; peers: load)",
                "ms",
                True,
                _values(rows, "overhead_ms"),
                cold_factor,
                cold_target,
            )
        )
    rows = {"trims": _cold(doc, "trims", "scale_from_zero", "cpu", "warm")}
    rows |= {p: _cold(doc, p, "process_start", None, "warm") for p in peers}
    out.append(
        Case(
            "first_response",
            "first full response, page cache warm (trims: scale from zero; peers: process start)",
            "ms",
            True,
            _values(rows, "first_response_ms"),
            1 / 20,
            "at least 20x faster than the fastest peer's process start",
        )
    )
    memory = {r["system"]: r for r in doc.get("memory", [])}
    replicas = next(iter(memory.values()))["replicas"] if memory else "N"
    out.append(
        Case(
            "pss",
            f"total PSS of {replicas} replicas of the full model",
            "MiB",
            True,
            _values(memory, "pss_mib"),
            0.6,
            "at most 0.6x the best peer's",
        )
    )
    loops: list[tuple[str, str, int | None, str, bool, float | None, str]] = [
        ("c1_p99", "closed", 1, "p99_ms", True, 1.0, "no worse than the best peer's"),
        ("c16_rps", "closed", 16, "rps", False, 1.2, "at least 1.2x the best peer's"),
        ("open_p99", "open", None, "p99_ms", True, 1.0, "no worse than the best peer's"),
        ("binary_c16_rps", "closed-binary", 16, "rps", False, None, "(no target)"),
    ]
    titles = {
        "c1_p99": "small model, closed loop c=1: p99",
        "c16_rps": "small model, closed loop c=16: throughput",
        "open_p99": "small model, open loop at 80% of the best c=16 rate: p99",
        "binary_c16_rps": "small model, V2 binary tensors, closed loop c=16: throughput",
    }
    for key, mode, c, field, lower, factor, target in loops:
        unit = "ms" if field.endswith("_ms") else "req/s"
        values = _values(_loop(doc, mode, c), field)
        out.append(Case(key, titles[key], unit, lower, values, factor, target))
    return [c for c in out if len(c.values) >= 1]


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _cold_tables(doc: dict[str, Any]) -> list[str]:
    parts = []
    for cache in ("warm", "dropped"):
        rows = [r for r in doc.get("cold_start", []) if r["cache"] == cache]
        if not rows:
            continue
        loads = [r["overhead_ms"] for r in rows if r["case"] == "load"]
        starts = [r["first_response_ms"] for r in rows if r["case"] == "process_start"]
        best_load, best_start = min(loads, default=None), min(starts, default=None)
        table = []
        for r in rows:
            ratio = r.get("first_request_ratio")
            table.append(
                [
                    r["system"],
                    r["case"] + (f" ({r['tier']} tier)" if r.get("tier") else ""),
                    f"{_ms(r['first_response_ms'])} ({_ms(r['min_ms'])}-{_ms(r['max_ms'])})",
                    _ms(r["warm_ms"]),
                    _ms(r["overhead_ms"]),
                    _ratio(r["overhead_ms"] / best_load if best_load else None),
                    _ratio(r["first_response_ms"] / best_start if best_start else None),
                    _ms(r.get("instance_start_ms")),
                    _ms(r.get("first_request_ms"))
                    + (f" ({ratio:.2f}x)" if ratio is not None else ""),
                    _ms(r.get("warm_idle_ms"))
                    + (f" ({r['idle_ms'] / 1e3:.1f} s)" if r.get("idle_ms") is not None else ""),
                ]
            )
        parts.append(
            f"**Cold start, page cache {cache}** (ratios: overhead / the best peer's load "
            "overhead; first response / the fastest peer's process start)\n\n"
            + markdown_table(
                [
                    "system",
                    "case",
                    "first full response ms (min-max)",
                    "warm ms",
                    "overhead ms",
                    "overhead vs best load",
                    "first vs fastest start",
                    "instance start ms",
                    "first request ms (/ warm)",
                    "warm after the same idle ms (idle)",
                ],
                table,
            )
        )
    return parts


def _memory_table(doc: dict[str, Any], case: Case | None) -> list[str]:
    if not doc.get("memory"):
        return []
    rows = [
        [
            r["system"],
            r["replicas"],
            f"{r['pss_mib']:.0f}",
            f"{r['model_mib']:.0f}",
            f"{r['pss_mib'] / r['model_mib']:.2f}x",
            _ratio(case.ratio(r["system"]) if case else None),
        ]
        for r in doc["memory"]
    ]
    header = ["system", "replicas", "total PSS MiB", "model MiB", "PSS / model", "vs best peer"]
    return ["**Memory**\n\n" + markdown_table(header, rows)]


def _loop_tables(doc: dict[str, Any], by_key: dict[str, Case]) -> list[str]:
    parts = []
    for key, mode, c in (
        ("c1_p99", "closed", 1),
        ("c16_rps", "closed", 16),
        ("binary_c16_rps", "closed-binary", 16),
        ("open_p99", "open", None),
    ):
        rows = _loop(doc, mode, c)
        case = by_key.get(key)
        if not rows or case is None:
            continue
        table = [
            [
                s,
                r.get("request", "-"),
                f"{r['rps']:.0f}",
                _ms(r["p50_ms"], 2),
                _ms(r["p99_ms"], 2),
                _ratio(case.ratio(s)),
                ", ".join(f"{n} x {st}" for st, n in r.get("error_statuses", {}).items())
                or r["errors"],
            ]
            for s, r in rows.items()
        ]
        rate = next(iter(rows.values())).get("rate")
        title = case.title + (f" ({rate:.0f} req/s offered)" if rate else "")
        what = "p99" if case.lower_is_better else "req/s"
        parts.append(
            f"**{title[0].upper() + title[1:]}**\n\n"
            + markdown_table(
                [
                    "system",
                    "request",
                    "req/s",
                    "p50 ms",
                    "p99 ms",
                    f"{what} vs best peer",
                    "errors",
                ],
                table,
            )
        )
    return parts


def _targets(all_cases: list[Case]) -> list[str]:
    rows = []
    for case in all_cases:
        best = case.best_peer()
        if case.factor is None or best is None or "trims" not in case.values:
            continue
        met = case.met()
        rows.append(
            [
                case.title,
                case.target,
                f"{case.values['trims']:.1f} {case.unit}",
                f"{best[1]:.1f} {case.unit} ({best[0]})",
                _ratio(case.ratio("trims")),
                "yes" if met else "**no**",
            ]
        )
    if not rows:
        return []
    # the missed targets first
    rows.sort(key=lambda r: r[-1] == "yes")
    header = ["case", "target", "trims", "best peer", "trims / best peer", "met"]
    return ["**Targets**\n\n" + markdown_table(header, rows)]


def render_markdown(doc: dict[str, Any]) -> str:
    """Every table of ``doc`` (as bench/peers.py writes it)."""
    label = " (quick: a check, not a measurement)" if doc.get("quick") else ""
    versions = ", ".join(f"{n} {p['version']}" for n, p in doc.get("peers", {}).items())
    parts = [
        f"trims vs {versions or '(no peer run)'}{label}; {doc['machine']}; {doc['runs']} runs, "
        f"medians (min-max); throughput with {doc.get('workers', '?')} replicas each; trims "
        f"gateway --warm-pool {doc.get('trims_warm_pool', 0)}."
    ]
    for name, why in doc.get("unavailable", {}).items():
        parts.append(f"Not run: **{name}** cannot run here: `{why}`")
    for name, why in doc.get("failed", {}).items():
        parts.append(f"Failed: **{name}** stopped at {why}")
    configured = [f"- {n}: {p['configuration']}" for n, p in doc.get("peers", {}).items()]
    if doc.get("trims_configuration"):
        configured.insert(0, f"- trims: {doc['trims_configuration']}")
    if configured:
        parts.append("How each system was configured:\n\n" + "\n".join(configured))
    all_cases = cases(doc)
    by_key = {c.key: c for c in all_cases}
    parts += _targets(all_cases)
    parts += _cold_tables(doc)
    parts += _memory_table(doc, by_key.get("pss"))
    parts += _loop_tables(doc, by_key)
    parts.extend(f"Note: {n}" for n in doc.get("notes", []))
    return "\n\n".join(parts) + "\n"


def write_figure(doc: dict[str, Any], path: Path) -> None:
    """Bars per case, one per system: trims, the best peer marked, the other peers grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = cases(doc)
    if not shown:
        return
    cols = min(4, len(shown))
    rows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)

    def colour(case: Case, system: str) -> str:
        if system == "trims":
            return "tab:blue"
        best = case.best_peer()
        return "tab:orange" if best is not None and system == best[0] else "lightgrey"

    for ax, case in zip(axes.flat, shown, strict=False):
        names = list(case.values)
        ax.bar(names, [case.values[s] for s in names], color=[colour(case, s) for s in names])
        better = "lower" if case.lower_is_better else "higher"
        ax.set_title(
            textwrap.fill(f"{case.title} ({case.unit}, {better} is better)", 48), fontsize=8
        )
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        ax.tick_params(axis="y", labelsize=7)
        values = [v for v in case.values.values() if v > 0]
        if values and max(values) > 20 * min(values):  # the small bars would not show
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    label = " (quick: a check)" if doc.get("quick") else ""
    fig.suptitle(f"trims vs peers{label}: blue trims, orange the best peer", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
