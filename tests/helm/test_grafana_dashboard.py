"""The Grafana dashboard (docs/grafana/trims-dashboard.json): a well-formed dashboard whose
queries name only metrics the gateway and the daemon really export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "trims-dashboard.json"
_METRIC_RE = re.compile(r"\btrims_[a-z_]+\b")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def exported_metrics() -> set[str]:
    """Every series name the gateway's and the daemon's registries can expose."""
    from trims.daemon.metrics import DaemonMetrics
    from trims.runtime.gateway.metrics import GatewayMetrics

    registries = [GatewayMetrics(lambda: {}, lambda: {}).registry, DaemonMetrics().registry]
    # collected at scrape time, from the pools' counts
    names = {"trims_instances", "trims_pending_requests"}
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + s for s in _SUFFIXES.get(family.type, ("",)))
    return names


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    for key in ("title", "uid", "schemaVersion", "panels", "templating", "time"):
        assert key in dashboard, key
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "function"} <= variables
    for panel in panels(dashboard):
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_panels_tile_the_grid_without_overlap(dashboard: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells


def test_queries_use_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    exported = exported_metrics()
    used: set[str] = set()
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")"), expr
            used.update(_METRIC_RE.findall(expr))
    assert used, "the dashboard queries nothing"
    assert used <= exported, f"unknown metrics: {sorted(used - exported)}"
    # The latency split the runtime promises is on the dashboard.
    for name in (
        "trims_queue_wait_seconds_bucket",
        "trims_cold_start_seconds_bucket",
        "trims_execution_seconds_bucket",
        "trims_model_acquire_seconds_bucket",
        "trims_invocations_total",
        "trims_instances",
    ):
        assert name in used, name
