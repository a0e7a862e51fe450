"""The gateway's lock-free counters and histograms expose exactly what prometheus_client's do."""

from __future__ import annotations

import math
import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from trims.runtime.gateway.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0)
#: On, below, between and above the bucket bounds, zero, a negative and a NaN.
OBSERVED = (0.0, 0.0005, 0.001, 0.0010001, 0.01, 0.05, 1.0, 7.5, -0.25, math.nan)


def _exposition(counter_cls: type[Counter], histogram_cls: type[Histogram]) -> bytes:
    registry = CollectorRegistry()
    counter = counter_cls("c", "a counter", ["route"], registry=registry)
    histogram = histogram_cls("h", "a histogram", ["route"], buckets=BUCKETS, registry=registry)
    for i, value in enumerate(OBSERVED):
        route = "/a" if i % 3 else "/b"
        counter.labels(route).inc()
        counter.labels(route).inc(0.5)
        histogram.labels(route).observe(value)
    histogram.labels("/a").observe(0.002, exemplar={"trace_id": "abc"})
    counter.labels("/gone").inc()
    counter.remove("/gone")
    # the creation times differ between the two registries
    return re.sub(rb"(_created\{[^}]*\}) \S+", rb"\1", generate_latest(registry))


def test_the_exposition_is_prometheus_clients() -> None:
    mine = _exposition(LoopCounter, LoopHistogram)
    assert mine == _exposition(Counter, Histogram)
    assert b'h_bucket{le="0.001",route="/a"} 3.0' in mine  # 0.0005, 0.001 (on it) and -0.25
    assert b'h_bucket{le="+Inf",route="/b"} 3.0' in mine  # a NaN counts in no bucket


def test_misuse_fails_as_in_prometheus_client() -> None:
    registry = CollectorRegistry()
    counter = LoopCounter("c", "a counter", ["route"], registry=registry)
    histogram = LoopHistogram("h", "a histogram", ["route"], registry=registry)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("/a").inc(-1)
    with pytest.raises(ValueError, match="label values"):
        counter.inc()
    with pytest.raises(ValueError, match="label values"):
        histogram.observe(0.1)
