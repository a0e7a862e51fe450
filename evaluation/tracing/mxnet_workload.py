"""The MXNet workload of leveled traces: a model run by a child process in the MXNet environment.

MXNet 1.9.1 needs numpy < 1.24 and so lives in its own virtualenv; the model runs there, in one
``python -m trims.evaluation.tracing.mxnet_child`` process that stays alive for the whole
leveled run (Note [MXNet child protocol] in mxnet_child.py). Its interpreter is, in this order:
the one named by the caller (the ``trace`` function's ``mxnet_python`` config),
``$TRIMS_MXNET_PYTHON``, ``$TRIMS_MXNET_VENV/bin/python``, ``/tmp/trims-mxnet-venv/bin/python``.

The model is any name :mod:`trims.evaluation.tracing.workload` accepts; it is prepared as an ONNX
graph here (the main environment has onnx and torch, the MXNet one has neither), sent as a spec
of :mod:`trims.evaluation.mxnet_backend` (weights by shape: random values cost the same to
compute with) and run node by node with ``mx.nd`` on the child's thread (NaiveEngine).

Note [MXNet clocks]
~~~~~~~~~~~~~~~~~~~
Every latency is measured in the child: model spans with ``time.time_ns()`` (the epoch clock of
every span, so the parent forwards them unchanged) and untraced predicts with its
``perf_counter`` (:meth:`MxnetWorkload.run` returns those seconds to the leveled run). Timing
them here would add the pipe's round trip to the untraced predicts only, and show up as a
negative overhead of every level.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trims.errors import TrimsError, Unavailable, UpstreamError, ValidationError
from trims.evaluation.tracing.workload import (
    TracedRuns,
    Workload,
    _model_name,
    _onnx_source,
    _prepared,
)
from trims.tracing.levels import Level
from trims.tracing.sources import Recording
from trims.tracing.spans import Span

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

__all__ = ["MxnetWorkload", "find_python"]

_CHILD = "trims.evaluation.tracing.mxnet_child"
#: seconds a child gets to exit once its input is closed, before it is killed
_EXIT_S = 30.0


def find_python(explicit: str | None = None) -> str:
    """The MXNet environment's interpreter (see the module docstring for the order)."""
    from trims.evaluation import mxnet_backend

    return mxnet_backend.find_python(explicit)


def _no_environment(python: str, why: str) -> Unavailable:
    return Unavailable(
        f"framework mxnet: no MXNet environment at {python} ({why}); set $TRIMS_MXNET_PYTHON to "
        "the python of a virtualenv with mxnet 1.9.1 and trims (.ci/run creates "
        "/tmp/trims-mxnet-venv), or trace the model with torch or onnxruntime"
    )


class _ChildProcess:
    """The child and its line protocol: one request, one reply."""

    def __init__(self, python: str, threads: int) -> None:
        self.python = python
        if not Path(python).is_file():
            raise _no_environment(python, "no such file")
        env = {
            **os.environ,
            "MXNET_ENGINE_TYPE": "NaiveEngine",
            "OMP_NUM_THREADS": str(threads),
            "MXNET_CPU_WORKER_NTHREADS": str(threads),
        }
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115  # lives as long as the child
        try:
            self._proc = subprocess.Popen(
                [python, "-m", _CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                text=True,
                bufsize=1,
            )
        except OSError as e:
            self._stderr.close()
            raise _no_environment(python, str(e)) from e
        log.debug("MXNet trace child %d started with %s", self._proc.pid, python)

    def stderr_tail(self, chars: int = 800) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").strip()[-chars:]

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send ``body``; its reply. UpstreamError when the child fails or is gone."""
        op = body["op"]
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(body) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self._proc.wait()
            raise UpstreamError(
                f"the MXNet process ({self.python}) exited with status {code} during {op!r}: "
                f"{self.stderr_tail()}"
            )
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise UpstreamError(f"the MXNet process failed on {op!r}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Close its input (it exits at the end of input); kill it if it does not."""
        with contextlib.suppress(OSError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(_EXIT_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "MXNet trace child %d did not exit within %.0f s of its input closing; killed",
                self._proc.pid,
                _EXIT_S,
            )
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()


class _ChildRuns(TracedRuns):
    """Predicts in the child's open session: each returns the model spans it timed there."""

    def __init__(self, workload: MxnetWorkload, process: str) -> None:
        super().__init__(workload, process, workload.name)
        self._child = workload.child

    def run(self) -> Span:
        spans = [Span.from_dict(d) for d in self._child.request({"op": "predict"})["spans"]]
        self.recording.spans.extend(spans)
        return spans[0]


class MxnetWorkload(Workload):
    """The prepared ONNX graph run as ``mx.nd`` operators in the MXNet environment."""

    framework = "mxnet"

    def __init__(self, source: str, batch: int, threads: int, python: str | None = None) -> None:
        from trims.evaluation import mxnet_backend

        super().__init__(_model_name(source), batch, threads)
        self._model = _prepared(self.name, _onnx_source(source, batch), batch)
        spec = mxnet_backend.spec(self._model, self.name)
        if len(spec["inputs"]) != 1:
            raise ValidationError(
                f"model {self.name!r} has {len(spec['inputs'])} inputs; trims trace feeds one"
            )
        self.python = find_python(python)
        self.child = _ChildProcess(self.python, threads)
        try:
            self._load(spec)
        except BaseException:
            self.child.close()
            raise

    def _load(self, spec: dict[str, Any]) -> None:
        try:
            reply = self.child.request({"op": "load", "spec": spec})
        except UpstreamError as e:
            if "exited" in e.message:
                raise _no_environment(self.python, e.message) from e
            raise ValidationError(f"model {self.name!r} does not run in MXNet: {e.message}") from e
        log.info(
            "model %s loaded in MXNet %s (trace child %d)", self.name, reply["mxnet"], reply["pid"]
        )

    def preprocess(self) -> Any:
        """Nothing here: the three steps run in the child, as one request (see :meth:`run`)."""
        return None

    def infer(self, x: Any) -> Any:
        """One untraced predict in the child (pre- and post-processing included): its seconds."""
        return self.child.request({"op": "run"})["seconds"]

    def postprocess(self, y: Any) -> Any:
        return y

    def run(self) -> float:
        """One untraced predict; the seconds the child timed (Note [MXNet clocks])."""
        return float(self.infer(self.preprocess()))

    def onnx_model(self) -> onnx.ModelProto:
        return self._model

    @contextmanager
    def traced(self, level: Level, *, process: str) -> Iterator[TracedRuns]:
        """Predicts at ``level`` in the child, one profiling session for all of them."""
        if level < Level.MODEL:
            raise ValidationError(f"a traced run needs level model or deeper, not {level.label}")
        runs = _ChildRuns(self, process)
        with self._profiled(level, runs, process):
            yield runs

    @contextmanager
    def _profiled(self, level: Level, runs: TracedRuns, process: str) -> Iterator[None]:
        attributes = {"model": self.name, "framework": self.framework, "batch": self.batch}
        self.child.request(
            {
                "op": "begin",
                "level": level.label,
                "process": process,
                "label": self.name,
                "attributes": attributes,
            }
        )
        try:
            yield
        except BaseException:
            with contextlib.suppress(TrimsError):
                self.child.request({"op": "end"})
            raise
        reply = self.child.request({"op": "end"})
        runs.absorb(
            Recording(
                spans=[Span.from_dict(d) for d in reply["spans"]],
                unavailable={Level[k.upper()]: str(v) for k, v in reply["unavailable"].items()},
                error=reply["error"],
            )
        )

    def close(self) -> None:
        self.child.close()
