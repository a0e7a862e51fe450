"""The MXNet side of a leveled MXNet trace: one process that runs predicts of one graph on request.

Runs inside the MXNet environment (mxnet 1.9.1, numpy < 1.24, no onnx or torch) as
``python -m trims.evaluation.tracing.mxnet_child``, started by
:mod:`trims.evaluation.tracing.mxnet_workload` and alive for the whole leveled run. The graph is
a spec of :mod:`trims.evaluation.mxnet_backend` run node by node with ``mx.nd``
(:func:`trims.evaluation.mxnet_runner.prepare`); the parent sets ``MXNET_ENGINE_TYPE=
NaiveEngine``, so every operator runs synchronously on the calling thread, inside the node that
issued it.

One predict is three steps, as in the other workloads: ``preprocess`` (the input array to an
``mx.nd`` array), the inference (every node, then ``waitall``), ``postprocess`` (the outputs to
NumPy). Model spans are timed here with ``time.time_ns()``, the clock of every span; the parent
only forwards them.

Note [MXNet child protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
One JSON object per line each way; every request gets exactly one reply, ``{"ok": true, ...}``
or ``{"ok": false, "error": "..."}`` (the child then waits for the next request). Requests:

* ``{"op": "load", "spec": {...}}`` -> ``{"pid", "mxnet", "input"}``: build the graph;
* ``{"op": "run"}`` -> ``{"seconds"}``: one untraced predict, timed here (a parent-side clock
  would add the pipe's round trip to the untraced latency and nothing to the traced ones);
* ``{"op": "infer", "input": ARRAY}`` -> ``{"outputs": [ARRAY, ...]}``: one untraced predict
  of the given input, the graph's outputs in order (the evaluation harness's MXNet system under
  test, :mod:`trims.evaluation.harness.sut_mxnet`); an ARRAY is ``{"dtype", "shape", "data"}``
  with the C-order bytes in base64 (:func:`encode_array`, :func:`decode_array`);
* ``{"op": "begin", "level", "process", "label", "attributes"}``: open the level's profiling
  session (Note [one profiling session per level] in workload.py); ``model`` opens none;
* ``{"op": "predict"}`` -> ``{"spans"}``: one predict in the session: its model spans
  (``Span.to_dict()``, the predict span first);
* ``{"op": "end"}`` -> ``{"spans", "unavailable", "error"}``: close the session and return the
  source's spans (:mod:`trims.tracing.sources.mxnet`), grouped by ONNX node (Note [MXNet
  operators per ONNX node]).

The reply stream is a private copy of the original stdout; fd 1 is pointed at stderr, so
anything MXNet or a library prints cannot corrupt it. End of input ends the process.

Note [MXNet operators per ONNX node]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One ONNX node may run as several MXNet operators (a Gemm is ``dot``, a scalar multiply and a
``broadcast_add``; an asymmetrically padded Conv a ``Pad`` and a ``Convolution``), and the
profiler does not know nodes. In a profiled predict the child brackets each node with two
``time.time_ns()`` readings (the untraced and model-level predicts do not), and each operator
span goes to the node whose bracket holds its midpoint (operators are synchronous, see above).
Per node with operators, one layer span named after the node (attributes ``name`` = the node,
``op_type`` = its ONNX op type, ``mxnet_ops``) covers them from the first start to the last end,
and the operators become its children (``onnx_node``, ``depth`` 1). The layer table thus has a
row per ONNX node, matched to the IR by name, with FLOPs counted once. An operator outside every
bracket stays a top-level layer span of its own.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import replace
from typing import IO, Any

import numpy as np

from trims.tracing.levels import Level
from trims.tracing.sources import Recording
from trims.tracing.spans import AttrValue, Span

__all__ = ["Child", "decode_array", "encode_array", "group_by_node", "main"]

#: (node name, ONNX op type, start ns, end ns) of one node in one profiled predict
Bracket = tuple[str, str, int, int]


def group_by_node(spans: list[Span], brackets: list[Bracket]) -> list[Span]:
    """The operator spans under one layer span per ONNX node (Note [MXNet operators per ONNX
    node]); ``brackets`` in start order, not overlapping."""
    starts = [b[2] for b in brackets]
    groups: dict[int, list[Span]] = {}
    out: list[Span] = []
    for s in spans:
        mid = (s.start_ns + s.end_ns) // 2
        i = bisect.bisect_right(starts, mid) - 1
        if s.level is Level.LAYER and i >= 0 and mid <= brackets[i][3]:
            groups.setdefault(i, []).append(s)
        else:
            out.append(s)
    for i, ops in sorted(groups.items()):
        name, op_type, _, _ = brackets[i]
        attrs: dict[str, AttrValue] = {
            "op_type": op_type,
            "name": name,
            "depth": 0,
            "mxnet_ops": [str(s.attributes.get("op_type", s.name)) for s in ops],
        }
        node = Span(
            name=name,
            level=Level.LAYER,
            start_ns=min(s.start_ns for s in ops),
            end_ns=max(s.end_ns for s in ops),
            track=ops[0].track,
            attributes=attrs,
        )
        out.append(node)
        out.extend(
            replace(
                s,
                parent_id=node.span_id,
                attributes={**s.attributes, "onnx_node": name, "depth": 1},
            )
            for s in ops
        )
    return out


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """An array as JSON: dtype, shape and its C-order bytes in base64."""
    data = np.ascontiguousarray(array)
    return {
        "dtype": data.dtype.str,
        "shape": list(data.shape),
        "data": base64.b64encode(data.tobytes()).decode("ascii"),
    }


def decode_array(doc: dict[str, Any]) -> np.ndarray:
    """The array :func:`encode_array` wrote."""
    raw = base64.b64decode(doc["data"])
    return np.frombuffer(raw, dtype=np.dtype(doc["dtype"])).reshape(doc["shape"])


class Child:
    """One graph in MXNet and at most one open profiling session."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from trims.evaluation.mxnet_runner import prepare

        self.mx, self.env, self.steps = prepare(spec)
        if len(spec["inputs"]) != 1:
            raise ValueError(f"model {spec['name']!r} has {len(spec['inputs'])} inputs; one needed")
        (entry,) = spec["inputs"]
        self.input_name = str(entry["name"])
        self.input = np.random.default_rng(0).standard_normal(entry["shape"]).astype(np.float32)
        self.outputs = [str(o) for o in spec["outputs"]]
        self.level = Level.NONE
        self.process = "mxnet"
        self.label = str(spec["name"])
        self.attributes: dict[str, AttrValue] = {}
        self.brackets: list[Bracket] = []
        self._session: contextlib.AbstractContextManager[Recording] | None = None
        self._recording: Recording | None = None

    def _infer(self, x: Any, brackets: list[Bracket] | None) -> dict[str, Any]:
        mx = self.mx
        values = dict(self.env)
        values[self.input_name] = x
        for step in self.steps:
            t0 = time.time_ns() if brackets is not None else 0
            results = step.fn(mx, [values[i] for i in step.inputs if i], step.attrs)
            for key, value in zip(step.outputs, results, strict=False):
                values[key] = value
            if brackets is not None:
                mx.nd.waitall()
                brackets.append((step.name, step.op_type, t0, time.time_ns()))
        mx.nd.waitall()
        return values

    def _postprocess(self, values: dict[str, Any]) -> list[Any]:
        return [values[o].asnumpy() for o in self.outputs]

    def run(self) -> float:
        """One untraced predict; its seconds. The arrays it made are freed after the clock
        stops, as in :meth:`predict` (freeing them is synchronous under NaiveEngine)."""
        t0 = time.perf_counter()
        x = self.mx.nd.array(self.input)
        y = self._infer(x, None)
        out = self._postprocess(y)
        seconds = time.perf_counter() - t0
        del x, y, out
        return seconds

    def infer(self, x: np.ndarray) -> list[np.ndarray]:
        """One untraced predict of ``x``: the graph's outputs, in order."""
        return self._postprocess(self._infer(self.mx.nd.array(x), None))

    def begin(self, level: Level, process: str, label: str, attributes: dict[str, Any]) -> None:
        from trims.tracing.sources import mxnet as mx_source

        if self._session is not None:
            raise ValueError("a profiling session is open: end it first")
        self.level, self.process, self.label = level, process, label
        self.attributes = attributes
        self.brackets = []
        if level >= Level.LAYER:
            self._session = mx_source.profile(level, process=process)
            self._recording = self._session.__enter__()

    def predict(self) -> list[Span]:
        """One predict in the open session: the predict span, then pre- and post-processing."""
        if self.level < Level.MODEL:
            raise ValueError("no profiling session: send begin first")
        track = (self.process, f"thread {threading.get_native_id()}")
        brackets = self.brackets if self._session is not None else None
        t0 = time.time_ns()
        x = self.mx.nd.array(self.input)
        t1 = time.time_ns()
        y = self._infer(x, brackets)
        t2 = time.time_ns()
        self._postprocess(y)
        t3 = time.time_ns()
        predict = Span(
            f"predict {self.label}", Level.MODEL, t0, t3, track, attributes=self.attributes
        )
        steps = [
            Span(name, Level.MODEL, start, end, track, parent_id=predict.span_id)
            for name, start, end in (("preprocess", t0, t1), ("postprocess", t2, t3))
        ]
        return [predict, *steps]

    def end(self) -> Recording:
        """Close the session; what its source recorded, operators grouped by node."""
        session, recording = self._session, self._recording
        self._session = self._recording = None
        self.level = Level.NONE
        if session is None or recording is None:
            return Recording()
        session.__exit__(None, None, None)
        recording.spans = group_by_node(recording.spans, sorted(self.brackets, key=lambda b: b[2]))
        self.brackets = []
        return recording


def _handle(child: Child | None, request: dict[str, Any]) -> tuple[Child | None, dict[str, Any]]:
    op = request.get("op")
    if op == "load":
        import mxnet as mx

        child = Child(request["spec"])
        return child, {"pid": os.getpid(), "mxnet": mx.__version__, "input": child.input_name}
    if child is None:
        raise ValueError(f"request {op!r} before load")
    if op == "run":
        return child, {"seconds": child.run()}
    if op == "infer":
        outputs = child.infer(decode_array(request["input"]))
        return child, {"outputs": [encode_array(o) for o in outputs]}
    if op == "begin":
        level = Level[str(request["level"]).upper()]
        child.begin(level, str(request["process"]), str(request["label"]), request["attributes"])
        return child, {}
    if op == "predict":
        return child, {"spans": [s.to_dict() for s in child.predict()]}
    if op == "end":
        rec = child.end()
        return child, {
            "spans": [s.to_dict() for s in rec.spans],
            "unavailable": {level.label: why for level, why in rec.unavailable.items()},
            "error": rec.error,
        }
    raise ValueError(f"unknown request {op!r}; use load, run, infer, begin, predict or end")


def serve(requests: IO[str], replies: IO[str]) -> None:
    """Answer requests until the input ends (Note [MXNet child protocol])."""
    child: Child | None = None
    for line in requests:
        if not line.strip():
            continue
        try:
            child, body = _handle(child, json.loads(line))
            reply = {"ok": True, **body}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> int:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    serve(sys.stdin, replies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
