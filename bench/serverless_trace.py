"""The serverless benchmark's trace: which function is invoked when, and each function's model.

Pure and seeded: the same :class:`TraceParams` (or the same Azure file and seed) give the same
trace, byte for byte, and every system replays it from the file :func:`write_trace` wrote.

Synthetic popularity follows Shahrad et al., "Serverless in the Wild" (USENIX ATC'20, the Azure
Functions trace of July 2019). Its Fig. 5 numbers matched here:

* 45% of applications are invoked once per hour or less on average, 81% once per minute or
  less. A log-normal rate distribution through both quantiles has sigma = ln(60) / (z(0.81) -
  z(0.45)) = 4.094 / 1.004 = 4.08 (:data:`POPULARITY_SIGMA`);
* the most popular 18.6% of functions carry 99.6% of the invocations: the same log-normal,
  sampled at the F stratified quantiles ``(i + 1/2) / F``, gives 99.6% at F = 200 (and with it
  about 1.5% of the functions carry 80%).

The absolute level is not the paper's: the shares are scaled to ``rate_rps`` (requests per
second over all functions at rate scale 1), because a 2-core node cannot serve the Azure head's
absolute rates. Functions whose share would leave them fewer than ``tail_invocations``
expected invocations in the trace are raised to that floor, so the long tail is invoked now
and then (at the defaults, 10 minutes and 5 req/s: about 6 times an hour) rather than never,
and its models are what the node must keep loading.

Arrivals per function are renewal processes with a target inter-arrival coefficient of
variation: :data:`POISSON_SHARE` of the functions are Poisson (CV 1), the rest gamma renewals
(shape ``1 / CV^2``) with CV log-uniform in [1, :data:`MAX_CV`]: the bursty 1-4 range the
issue asks for (the paper's Fig. 8 finds most non-timer applications' CV above 1).

Models: one per function, sizes log-normal (sigma :data:`SIZE_SIGMA`) clipped to [min, max],
the median chosen so that they total ``total_mib``; the memory budget defaults to a quarter of
that total. A model is ``layers`` square Linear(width, width) float32 layers with biases (the
``peers_model.write_layers`` files), so its forward pass reads every weight. Sizes are
assigned to functions by a seeded permutation, independent of popularity.

Rate scale ``s`` replays the trace ``s`` times faster (every send time divided by ``s``): each
function's rate and the total scale by ``s`` while the popularity shares and every function's
inter-arrival CV stay exactly as generated (superposing copies would push CVs towards 1).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

#: log-normal sigma of per-function popularity, fitted to the paper's 45% / 81% quantiles
POPULARITY_SIGMA = 4.08
#: share of functions with Poisson arrivals; the rest are bursty gamma renewals
POISSON_SHARE = 0.25
#: the largest target inter-arrival CV
MAX_CV = 4.0
#: log-normal sigma of model sizes (in log-MiB)
SIZE_SIGMA = 1.2
#: square layer widths a model may have, smallest first
WIDTHS = (256, 512, 1024, 2048, 4096)
#: fewest layers a model of a given width has before a narrower width is taken
MIN_LAYERS = 4
#: share of invocations the head functions carry (the rest is the tail)
HEAD_SHARE = 0.8
MIB = 1 << 20


@dataclass(frozen=True)
class TraceParams:
    """What a synthetic trace is generated from."""

    functions: int = 200
    minutes: float = 10.0
    #: requests per second over all functions at rate scale 1
    rate_rps: float = 5.0
    #: expected invocations per trace of the least popular functions (the floor)
    tail_invocations: float = 1.0
    #: models' sizes: their total and the range each lies in
    total_mib: float = 12 * 1024
    min_mib: float = 4.0
    max_mib: float = 1024.0
    seed: int = 0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    width: int
    layers: int

    @property
    def bytes(self) -> int:
        """What ``write_layers`` stores: weights and biases, float32."""
        return self.layers * (self.width * self.width + self.width) * 4


@dataclass(frozen=True)
class Function:
    name: str
    model: ModelSpec
    #: requests per second at rate scale 1 (for Azure: the trace's mean over its minutes)
    rate_rps: float
    #: the target inter-arrival CV (None for a replayed Azure trace)
    cv: float | None


@dataclass(frozen=True)
class Trace:
    functions: tuple[Function, ...]
    #: (send time in seconds from the start at rate scale 1, function index), by time
    requests: tuple[tuple[float, int], ...]
    duration_s: float
    source: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def models_bytes(self) -> int:
        return sum(f.model.bytes for f in self.functions)

    def counts(self) -> list[int]:
        out = [0] * len(self.functions)
        for _, i in self.requests:
            out[i] += 1
        return out

    def head(self, share: float = HEAD_SHARE) -> frozenset[int]:
        """The most invoked functions that together carry ``share`` of the requests."""
        counts = self.counts()
        total = sum(counts)
        out: set[int] = set()
        carried = 0
        for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
            if total == 0 or carried >= share * total:
                break
            out.add(i)
            carried += counts[i]
        return frozenset(out)

    def window(self, scale: float, seconds: float | None) -> list[tuple[float, int]]:
        """The requests at rate scale ``scale`` (send times divided by it) that fall in the
        first ``seconds`` of the replay (all of them without a limit)."""
        out = [(t / scale, i) for t, i in self.requests]
        return out if seconds is None else [(t, i) for t, i in out if t < seconds]


def _stratified_normals(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` standard normals, one in each of ``n`` equal-probability strata, shuffled:
    the shares of a small population then match the distribution's (not one seed's luck)."""
    dist = NormalDist()
    z = np.array([dist.inv_cdf((i + 0.5) / n) for i in range(n)])
    return rng.permutation(z)


def model_sizes(params: TraceParams, rng: np.random.Generator) -> list[int]:
    """Sizes in bytes, log-normal, clipped to [min, max] MiB, summing to about ``total_mib``."""
    n = params.functions
    if not params.min_mib * n <= params.total_mib <= params.max_mib * n:
        raise ValueError(
            f"{n} models of {params.min_mib:g}-{params.max_mib:g} MiB cannot total "
            f"{params.total_mib:g} MiB; change --total-mib or the number of functions"
        )
    z = _stratified_normals(n, rng)
    lo, hi = math.log(params.min_mib), math.log(params.max_mib)

    def total(mu: float) -> float:
        return float(np.exp(np.clip(mu + SIZE_SIGMA * z, lo, hi)).sum())

    # the clipped total grows with mu: bisect for the median that hits the target
    a, b = lo - 4 * SIZE_SIGMA, hi + 4 * SIZE_SIGMA
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if total(mid) < params.total_mib else (a, mid)
    mib = np.exp(np.clip(a + SIZE_SIGMA * z, lo, hi))
    return [int(m * MIB) for m in mib]


def model_shape(name: str, size: int) -> ModelSpec:
    """Square float32 layers (with biases) of about ``size`` bytes: the widest of
    :data:`WIDTHS` that still gives :data:`MIN_LAYERS` layers, so big models read many big
    matrices and small ones a few small ones."""
    width = WIDTHS[0]
    for w in WIDTHS:
        if size >= MIN_LAYERS * (w * w + w) * 4:
            width = w
    layers = max(1, round(size / ((width * width + width) * 4)))
    return ModelSpec(name, width, layers)


def _models(params: TraceParams, rng: np.random.Generator) -> list[ModelSpec]:
    sizes = model_sizes(params, rng)
    return [model_shape(f"sl-m{i:03d}", s) for i, s in enumerate(sizes)]


def _arrivals(rate: float, cv: float, duration: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in [0, duration) of a renewal process of mean rate ``rate`` and
    inter-arrival CV ``cv`` (exponential for 1, gamma with shape 1/cv^2 above), started in
    equilibrium (the first arrival after a uniformly placed point in a length-biased gap)."""
    if rate <= 0:
        return np.empty(0)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    expected = rate * duration
    times: list[np.ndarray] = []
    # the gap that straddles time 0 is length-biased: gamma(shape + 1); the first arrival lies
    # uniformly within it
    t = float(rng.gamma(shape + 1.0, scale) * rng.random())
    while t < duration:
        n = int(expected + 4 * math.sqrt(expected + 1) + 16)
        gaps = rng.gamma(shape, scale, size=n)
        chunk = t + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        times.append(chunk[chunk < duration])
        t = float(chunk[-1] + gaps[-1])
    return np.concatenate(times) if times else np.empty(0)


def synthetic(params: TraceParams) -> Trace:
    """A trace as the module docstring describes, from ``params`` alone."""
    if params.functions < 1 or params.minutes <= 0 or params.rate_rps <= 0:
        raise ValueError("a trace needs at least one function, minutes > 0 and a rate > 0")
    rng = np.random.default_rng(params.seed)
    models = _models(params, rng)
    duration = params.minutes * 60.0
    weights = np.exp(POPULARITY_SIGMA * _stratified_normals(params.functions, rng))
    rates = params.rate_rps * weights / weights.sum()
    rates = np.maximum(rates, params.tail_invocations / duration)
    bursty = rng.random(params.functions) >= POISSON_SHARE
    cvs = np.where(bursty, np.exp(rng.uniform(0.0, math.log(MAX_CV), params.functions)), 1.0)
    functions = []
    requests: list[tuple[float, int]] = []
    for i in range(params.functions):
        times = _arrivals(float(rates[i]), float(cvs[i]), duration, rng)
        requests.extend((round(float(t), 6), i) for t in times)
        functions.append(Function(f"sl-f{i:03d}", models[i], float(rates[i]), float(cvs[i])))
    requests.sort()
    return Trace(tuple(functions), tuple(requests), duration, "synthetic", asdict(params))


def azure(path: Path, params: TraceParams) -> Trace:
    """The top ``params.functions`` functions (by invocations in the first ``params.minutes``
    minutes) of an Azure Functions 2019 per-minute file (``invocations_per_function_md.anon.
    dNN.csv``: HashOwner, HashApp, HashFunction, Trigger, then one column per minute 1..1440),
    each given a model as :func:`synthetic` would; a minute's count is spread uniformly
    (seeded) over that minute."""
    minutes = math.ceil(params.minutes)
    rows: list[tuple[int, str, list[int]]] = []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or header[:4] != ["HashOwner", "HashApp", "HashFunction", "Trigger"]:
            raise ValueError(
                f"{path} is not an Azure Functions 2019 invocation file: its header must start "
                "HashOwner,HashApp,HashFunction,Trigger then the minutes 1..1440"
            )
        if len(header) < 4 + minutes:
            raise ValueError(f"{path} has {len(header) - 4} minutes; ask for at most that many")
        for n, row in enumerate(reader):
            counts = [int(float(c or 0)) for c in row[4 : 4 + minutes]]
            rows.append((sum(counts), f"{row[2]}:{n}", counts))
    rows.sort(key=lambda r: (-r[0], r[1]))
    top = [r for r in rows[: params.functions] if r[0] > 0]
    if not top:
        raise ValueError(f"{path} has no invocation in its first {minutes} minutes")
    rng = np.random.default_rng(params.seed)
    models = _models(TraceParams(**{**asdict(params), "functions": len(top)}), rng)
    duration = minutes * 60.0
    functions = []
    requests: list[tuple[float, int]] = []
    for i, (total, _, counts) in enumerate(top):
        for m, c in enumerate(counts):
            requests.extend((round(float(t), 6), i) for t in 60.0 * (m + rng.random(c)))
        functions.append(Function(f"sl-f{i:03d}", models[i], total / duration, None))
    requests.sort()
    return Trace(tuple(functions), tuple(requests), duration, f"azure:{path.name}",
                 asdict(params))  # fmt: skip


# ---- the file every system replays ----------------------------------------------------------


def write_trace(trace: Trace, path: Path) -> None:
    from trims.config import write_atomic

    doc = {
        "source": trace.source,
        "params": trace.params,
        "duration_s": trace.duration_s,
        "functions": [
            {"name": f.name, "model": asdict(f.model), "rate_rps": f.rate_rps, "cv": f.cv}
            for f in trace.functions
        ],
        "requests": [list(r) for r in trace.requests],
    }
    write_atomic(path, json.dumps(doc, separators=(",", ":")) + "\n")


def read_trace(path: Path) -> Trace:
    doc = json.loads(path.read_text())
    functions = tuple(
        Function(f["name"], ModelSpec(**f["model"]), f["rate_rps"], f["cv"])
        for f in doc["functions"]
    )
    requests = tuple((float(t), int(i)) for t, i in doc["requests"])
    return Trace(functions, requests, doc["duration_s"], doc["source"], doc["params"])


# ---- what a trace is ------------------------------------------------------------------------


def interarrival_cv(times: Sequence[float]) -> float | None:
    """The coefficient of variation of the gaps between sorted ``times`` (None below 3)."""
    if len(times) < 3:
        return None
    gaps = np.diff(np.asarray(times))
    mean = float(gaps.mean())
    return float(gaps.std() / mean) if mean > 0 else None


def describe(trace: Trace) -> dict[str, Any]:
    """The trace's shape as the report states it."""
    counts = trace.counts()
    total = max(1, sum(counts))
    order = sorted(counts, reverse=True)
    top5 = max(1, math.ceil(0.05 * len(counts)))
    head = trace.head()
    per_fn: dict[int, list[float]] = {}
    for t, i in trace.requests:
        per_fn.setdefault(i, []).append(t)
    cvs = [cv for ts in per_fn.values() if len(ts) >= 50 and (cv := interarrival_cv(ts))]
    hours = trace.duration_s / 3600
    sizes = [f.model.bytes for f in trace.functions]
    return {
        "source": trace.source,
        "functions": len(trace.functions),
        "duration_s": trace.duration_s,
        "requests": len(trace.requests),
        "rate_rps": len(trace.requests) / trace.duration_s,
        "head_functions": len(head),
        "head_share": sum(counts[i] for i in head) / total,
        "top_5pct_share": sum(order[:top5]) / total,
        "functions_invoked": sum(1 for c in counts if c),
        "functions_at_most_12_per_hour": sum(1 for c in counts if c / hours <= 12),
        "interarrival_cv_min": min(cvs) if cvs else None,
        "interarrival_cv_max": max(cvs) if cvs else None,
        "models_mib": sum(sizes) / MIB,
        "model_mib_min": min(sizes) / MIB,
        "model_mib_max": max(sizes) / MIB,
        "params": trace.params,
    }
