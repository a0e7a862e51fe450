"""Prometheus metrics scraped from the running daemon; OTLP spans received over real HTTP."""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tests.daemon.rawclient import RawClient
from tests.fixtures.store import DaemonProcess
from trims.errors import NotFound

PAGE = {"w": np.zeros(1024, np.float32)}


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_endpoint_reports_tiers_leases_loads_evictions_errors(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon(
        models={"a": PAGE, "b": PAGE | {"x": np.ones(1, np.int8)}},
        cpu_budget="8KiB",
        metrics_address="127.0.0.1:0",
    )
    assert daemon.metrics_url is not None
    with RawClient(daemon.socket) as client:
        held, fds = client.call("acquire", name="a")
        os.close(fds[0])
        with pytest.raises(NotFound):
            client.call("acquire", name="missing")
        m = _scrape(daemon.metrics_url)
        assert m['trims_tier_bytes_used{tier="cpu"}'] == 4096
        assert m['trims_tier_bytes_budget{tier="cpu"}'] == 8192
        assert m['trims_tier_models_resident{tier="cpu"}'] == 1
        assert m['trims_tier_models_resident{tier="disk"}'] == 2
        assert m["trims_leases_live"] == 1
        assert m['trims_loads_total{tier="cpu"}'] == 1
        assert m['trims_acquire_seconds_count{tier="cpu"}'] == 1
        assert m['trims_load_seconds_count{tier="cpu"}'] == 1
        assert m['trims_errors_total{code="not_found"}'] == 1
        client.result("release", lease=held["lease"])
        _, fds = client.call("acquire", name="b")
        os.close(fds[0])
        _, fds = client.call("acquire", name="a", tier="disk")
        os.close(fds[0])
    m = _scrape(daemon.metrics_url)
    assert m['trims_evictions_total{tier="cpu"}'] == 1
    assert m['trims_acquire_seconds_count{tier="disk"}'] == 1
    with RawClient(daemon.admin_socket) as admin:
        tiers = admin.result("stats")["tiers"]
    # seeded before the start, so first hashed by their loads into the cpu tier; the disk
    # hand-out of "a" then trusted the stamp its cpu load verified it under
    both = tiers["disk"]["used"]
    assert m['trims_verified_bytes_total{tier="cpu"}'] == tiers["cpu"]["hashed_bytes"] == both
    assert m['trims_verified_bytes_total{tier="disk"}'] == tiers["disk"]["hashed_bytes"] == 0
    assert m['trims_damaged_copies_total{tier="disk"}'] == 0
    blob = daemon.store_dir / "disk" / "blobs" / held["manifest"]["digest"]
    blob.chmod(0o644)  # a's disk copy is damaged: the next scrub finds it and deletes it
    with open(blob, "r+b") as f:
        f.write(b"\x01")
    with RawClient(daemon.admin_socket) as admin:
        states = {e["models"][0]: e["state"] for e in admin.result("verify")["verified"]}
    assert states == {"a:1": "damaged", "b:1": "ok"}
    m = _scrape(daemon.metrics_url)
    assert m['trims_damaged_copies_total{tier="disk"}'] == 1
    assert m['trims_verified_bytes_total{tier="disk"}'] == tiers["disk"]["used"] - 4096


class _Collector(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def otlp_collector() -> Iterator[tuple[str, list[bytes]]]:
    _Collector.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces", _Collector.bodies
    server.shutdown()
    server.server_close()
    thread.join()


def test_acquire_load_and_evict_spans_reach_the_otlp_endpoint(
    start_daemon: Callable[..., DaemonProcess], otlp_collector: tuple[str, list[bytes]]
) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    endpoint, bodies = otlp_collector
    daemon = start_daemon(models={"a": PAGE}, otlp_endpoint=endpoint)
    with RawClient(daemon.socket) as client:
        result, fds = client.call("acquire", name="a")
        os.close(fds[0])
        client.result("release", lease=result["lease"])
    with RawClient(daemon.admin_socket) as admin:
        admin.result("evict", name="a")
    assert daemon.stop() == 0
    names: set[str] = set()
    for body in bodies:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            for scope in resource_spans.scope_spans:
                names.update(span.name for span in scope.spans)
    assert {"acquire", "load", "evict"} <= names
