"""The Helm chart, rendered and linted offline with the Helm SDK (helm-python-sdk), every
manifest validated against the official Kubernetes schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

CHART = Path(__file__).resolve().parents[2] / "helm" / "trims"
KUBE_VERSION = "1.30.0"
#: Kinds from CRDs that kubernetes-validate has no schema for (the Prometheus Operator's).
FOREIGN_KINDS = {"ServiceMonitor"}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = chart.render(values=values, name="trims", namespace="trims-system")
    return [
        doc
        for path, text in sorted(out.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
        "gateway": {"tokensSecret": "trims-tokens", "replicas": 2},
        "daemon": {"nodeSelector": {"trims.io/node": "true"}, "otlpEndpoint": "http://otel:4318"},
        "operator": {"namespaced": True},
    },
    "daemon_only": {
        "gateway": {"enabled": False},
        "operator": {"enabled": False},
        "functions": {"networkPolicy": {"enabled": False}},
    },
}


@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_every_rendered_manifest_is_valid(chart: Any, case: str) -> None:
    docs = render(chart, VALUE_SETS[case])
    assert docs
    for doc in docs:
        if doc["kind"] in FOREIGN_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_lint_is_clean() -> None:
    for values in VALUE_SETS.values():
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["errors"] == []
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_daemon_shares_its_socket_dir_with_function_pods(chart: Any) -> None:
    docs = by_kind(render(chart, VALUE_SETS["everything"]))
    daemon = docs[("DaemonSet", "trims-daemon")]["spec"]["template"]
    volumes = {v["name"]: v for v in daemon["spec"]["volumes"]}
    assert volumes["socket-dir"]["hostPath"]["path"] == "/run/trims"
    container = daemon["spec"]["containers"][0]
    assert "--socket=/run/trims/store.sock" in container["args"]
    assert "--socket-group=10001" in container["args"]
    assert container["securityContext"]["runAsNonRoot"] is True
    assert daemon["spec"]["nodeSelector"] == {"trims.io/node": "true"}
    # The labels function pods require on their node (pod affinity) are the daemon pods'.
    from trims.runtime.kubernetes_objects import DAEMON_POD_LABELS

    assert DAEMON_POD_LABELS.items() <= daemon["metadata"]["labels"].items()

    gateway = docs[("Deployment", "trims-gateway")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in gateway["containers"][0]["env"]}
    assert env["TRIMS_K8S_STORE_SOCKET"] == "/run/trims/store.sock"
    assert json.loads(env["TRIMS_K8S_NODE_SELECTOR"]) == {"trims.io/node": "true"}
    assert "--executor=kubernetes" in gateway["containers"][0]["args"]


def test_the_daemon_owns_its_store_and_makes_it_private_itself(chart: Any) -> None:
    """The kubelet makes a DirectoryOrCreate hostPath 0755 (issue 41, finding 6). The daemon's
    store is a folder below it that the daemon creates 0700 (or tightens) at start, and refuses
    when another uid owns it (Note [private store] in trims.daemon.private): so the init
    container hands the hostPaths to the very uid the daemon runs as, and changes no mode."""
    values = {"runAsUser": 4321, "runAsGroup": 4322}
    docs = by_kind(render(chart, values))
    pod = docs[("DaemonSet", "trims-daemon")]["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    store_dir = next(
        a.split("=", 1)[1] for a in pod["containers"][0]["args"] if a.startswith("--store-dir=")
    )
    assert Path(store_dir).parent == Path(mounts["store-dir"])
    assert pod["securityContext"]["runAsUser"] == 4321
    [init] = pod["initContainers"]
    assert init["command"][:2] == ["/bin/chown", "4321:4322"]
    assert mounts["store-dir"] in init["command"] and mounts["socket-dir"] in init["command"]
    assert not any("chmod" in part for part in init["command"])


def test_gateway_settings_parse_into_the_executor(chart: Any) -> None:
    from trims.runtime.kubernetes_objects import KubernetesExecutorSettings

    docs = by_kind(render(chart, VALUE_SETS["everything"]))
    gateway = docs[("Deployment", "trims-gateway")]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in gateway["containers"][0]["env"] if "value" in e}
    settings = KubernetesExecutorSettings.from_env(env)
    assert settings.image == "trims-runtime:latest"
    assert settings.service_account == "trims-function"
    assert settings.store_group == 10001


def test_gateway_may_only_manage_pods_and_functions_get_no_token(chart: Any) -> None:
    docs = by_kind(render(chart))
    role = docs[("Role", "trims-gateway")]
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"pods", "pods/log"}
    assert docs[("ServiceAccount", "trims-function")]["automountServiceAccountToken"] is False
    cluster_role = docs[("ClusterRole", "trims-operator")]
    resources = {r for rule in cluster_role["rules"] for r in rule["resources"]}
    assert {"functions", "functions/status", "deployments", "services"} <= resources
    assert "secrets" not in resources and "pods" not in resources


def test_optional_parts_follow_their_switches(chart: Any) -> None:
    kinds = {d["kind"] for d in render(chart)}
    assert "ServiceMonitor" not in kinds and "NetworkPolicy" in kinds
    kinds = {d["kind"] for d in render(chart, VALUE_SETS["daemon_only"])}
    assert kinds == {"DaemonSet", "Service", "ServiceAccount"}
    docs = by_kind(render(chart, VALUE_SETS["everything"]))
    assert ("Role", "trims-operator") in docs and ("ClusterRole", "trims-operator") not in docs
    monitor = docs[("ServiceMonitor", "trims")]
    assert monitor["metadata"]["labels"]["release"] == "prom"


def test_chart_ships_the_function_crd(chart: Any) -> None:
    (crd,) = chart.crds
    assert yaml.safe_load(crd["data"])["metadata"]["name"] == "functions.trims.io"


def test_values_are_documented() -> None:
    """Each top-level key in values.yaml has a comment above it (or above its group of keys)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#")):
            j = i - 1
            while j >= 0 and lines[j] and not lines[j].startswith((" ", "#")):
                j -= 1
            assert j >= 0 and lines[j].startswith("#"), f"values.yaml: {line!r} has no comment"


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"daemon": {"eviction": "random"}}, "/daemon/eviction"),
        ({"gatway": {"replicas": 2}}, "gatway"),
        ({"functions": {"memoryOverhead": "lots"}}, "/functions/memoryOverhead"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ],
)
def test_values_schema_rejects_mistakes(chart: Any, values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=complaint):
        chart.render(values=values, name="trims", namespace="trims-system")


def test_value_sizes_parse_as_trims_sizes(chart: Any) -> None:
    from trims.config import parse_size

    merged = chart.merge_values({})
    for size in (*merged["daemon"]["budgets"].values(), merged["functions"]["memoryOverhead"]):
        parse_size(str(size))
