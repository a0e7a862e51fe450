"""Pipelines: functions chained into a DAG and invoked as one request.

Spec (JSON/YAML)::

    {"name": "classify-and-embed",
     "steps": [{"name": "pre", "function": "resize"},
               {"name": "cls", "function": "resnet", "after": ["pre"]},
               {"name": "emb", "function": "minilm", "after": ["pre"]},
               {"name": "join", "function": "merge", "after": ["cls", "emb"]}]}

A step without ``after`` receives the pipeline's request body; a step after one step receives
that step's response body and content type; a step after several receives a JSON object
mapping each of those step names to its response: parsed JSON when it was JSON, else text when
it is UTF-8, else ``{"content_type": ..., "encoding": "base64", "body": ...}`` (bytes are never
replaced). Header names are matched case-insensitively throughout (Note [case-insensitive
headers] in :mod:`trims.runtime.gateway.invocations`). The pipeline answers with
its one sink step's response, or with a JSON object of every sink's response when there are
several. Steps run as soon as their inputs are ready, so independent branches run at once; the
whole run is one span with a child span per step.

Every run is timed per step (:class:`PipelineRun`): the answer carries a ``Server-Timing``
header (W3C Server Timing: ``decode;dur=1.204, classify;dur=3.917, total;dur=5.310``, in
milliseconds, steps in spec order, ``total`` the whole run) and, when the caller asks for them
(:data:`OUTPUTS_HEADER`), a JSON envelope of every step's output (:meth:`PipelineRun.envelope`).
A step's time is what its function call took as the gateway saw it: queueing for an instance,
a cold start if one was needed, and the instance's answer.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict
from opentelemetry import trace

from trims.errors import TrimsError, UpstreamError, ValidationError
from trims.runtime.gateway.invocations import Outcome

tracer = trace.get_tracer(__name__)

#: Request header (``true``/``false``) asking for every step's output; ``?outputs=true`` too.
OUTPUTS_HEADER = "trims-pipeline-outputs"
#: The Server-Timing metric of the whole run.
TOTAL_METRIC = "total"
#: Content type of the per-step outputs envelope.
ENVELOPE_TYPE = "application/vnd.trims.pipeline-outputs+json"

#: Pipeline and step names; applied with fullmatch (see Note [full-string names] in
#: runtime/functions/spec.py).
NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")

PIPELINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "steps"],
    "properties": {
        "name": {"type": "string", "pattern": f"^{NAME_RE.pattern}$"},
        "steps": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "function"],
                "properties": {
                    "name": {"type": "string", "pattern": f"^{NAME_RE.pattern}$"},
                    "function": {"type": "string", "pattern": f"^{NAME_RE.pattern}$"},
                    "after": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}

#: (function, body, content type, trace context) -> the function's answer.
CallFunction = Callable[[str, bytes, str], Awaitable[Outcome]]


@dataclass(frozen=True)
class Step:
    name: str
    function: str
    after: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    #: In topological order: every step comes after the steps it reads.
    steps: tuple[Step, ...]

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.function for s in self.steps))

    @property
    def sinks(self) -> tuple[str, ...]:
        read = {a for s in self.steps for a in s.after}
        return tuple(s.name for s in self.steps if s.name not in read)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "steps": [
                {
                    "name": s.name,
                    "function": s.function,
                    **({"after": list(s.after)} if s.after else {}),
                }
                for s in self.steps
            ],
        }


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValidationError(
            f"{path}: must be lower-case letters, digits and '-' (at most 63), got {value!r}",
            field=path,
        )
    return value


def parse_pipeline(data: Any) -> PipelineSpec:
    """A checked pipeline spec: unique step names, known predecessors, no cycles."""
    if not isinstance(data, Mapping):
        raise ValidationError("a pipeline spec must be a JSON object with 'name' and 'steps'")
    unknown = sorted(set(data) - {"name", "steps"})
    if unknown:
        raise ValidationError(f"unknown pipeline field {unknown[0]!r}; allowed: name, steps")
    name = _name(data.get("name"), "name")
    raw_steps = data.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ValidationError("steps: must be a non-empty list of steps", field="steps")
    steps: dict[str, Step] = {}
    for i, raw in enumerate(raw_steps):
        path = f"steps[{i}]"
        if not isinstance(raw, Mapping):
            raise ValidationError(f"{path}: must be an object with name and function", field=path)
        extra = sorted(set(raw) - {"name", "function", "after"})
        if extra:
            raise ValidationError(
                f"{path}: unknown field {extra[0]!r}; allowed: name, function, after", field=path
            )
        step_name = _name(raw.get("name"), f"{path}.name")
        if step_name in steps:
            raise ValidationError(f"{path}.name: step {step_name!r} is defined twice")
        after = raw.get("after", [])
        if not isinstance(after, list) or not all(isinstance(a, str) for a in after):
            raise ValidationError(f"{path}.after: must be a list of step names", field=path)
        steps[step_name] = Step(
            step_name, _name(raw.get("function"), f"{path}.function"), tuple(after)
        )
    for step in steps.values():
        for dep in step.after:
            if dep not in steps:
                raise ValidationError(
                    f"step {step.name!r} runs after unknown step {dep!r}; "
                    f"steps are {', '.join(steps)}"
                )
    return PipelineSpec(name=name, steps=_topological(steps))


def _topological(steps: Mapping[str, Step]) -> tuple[Step, ...]:
    order: list[Step] = []
    state: dict[str, int] = {}

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join((*chain[chain.index(name) :], name))
            raise ValidationError(f"pipeline steps form a cycle: {cycle}; remove one 'after'")
        state[name] = 1
        for dep in steps[name].after:
            visit(dep, (*chain, name))
        state[name] = 2
        order.append(steps[name])

    for name in steps:
        visit(name, ())
    return tuple(order)


@dataclass(frozen=True)
class StageResult:
    """One step of a finished run: what its function answered and how long the call took."""

    step: str
    function: str
    duration_s: float
    outcome: Outcome


@dataclass(frozen=True)
class PipelineRun:
    """A finished run: the pipeline's answer (with ``Server-Timing``) and every step's result,
    in spec order."""

    pipeline: str
    outcome: Outcome
    stages: tuple[StageResult, ...]
    total_s: float

    def server_timing(self) -> str:
        """The ``Server-Timing`` value: each step's duration, then ``total``, in ms."""
        return server_timing(
            [(s.step, s.duration_s) for s in self.stages] + [(TOTAL_METRIC, self.total_s)]
        )

    def envelope(self, limit: int) -> Outcome:
        """Every step's output and the final one as one JSON object (``ENVELOPE_TYPE``)::

            {"pipeline": "digits", "total_ms": 5.3,
             "output": {"status": 200, "content_type": "...", "encoding": "utf-8", "body": "..."},
             "stages": [{"step": "decode", "function": "digits-decode", "duration_ms": 1.2,
                         "status": 200, "content_type": "application/x-npy",
                         "encoding": "base64", "body": "k05VTVBZ..."}, ...]}

        Bodies are text when they are UTF-8, else base64 (``encoding`` says which). At most
        ``limit`` body bytes are included (the gateway's ``max_body_bytes``): a step output
        that would pass it is left out, with ``omitted`` saying why; the final output comes
        first so it is always there unless it alone is too large.
        """
        budget = limit
        final, budget = _body_entry(self.outcome, budget, limit)
        stages = []
        for stage in self.stages:
            entry, budget = _body_entry(stage.outcome, budget, limit)
            stages.append(
                {
                    "step": stage.step,
                    "function": stage.function,
                    "duration_ms": round(stage.duration_s * 1000, 3),
                    **entry,
                }
            )
        doc = {
            "pipeline": self.pipeline,
            "total_ms": round(self.total_s * 1000, 3),
            "output": final,
            "stages": stages,
        }
        headers = {"Content-Type": ENVELOPE_TYPE, "Server-Timing": self.server_timing()}
        return Outcome(self.outcome.status, headers, json.dumps(doc).encode())


def _body_entry(outcome: Outcome, budget: int, limit: int) -> tuple[dict[str, Any], int]:
    entry: dict[str, Any] = {
        "status": outcome.status,
        "content_type": outcome.headers.get("Content-Type", "application/octet-stream"),
    }
    size = len(outcome.body)
    if size > budget:
        entry["omitted"] = (
            f"{size} bytes would pass the gateway's {limit}-byte limit on the outputs "
            "(max_body_bytes); invoke the step's function alone to see it"
        )
        return entry, budget
    try:
        entry["body"] = outcome.body.decode("utf-8")
        entry["encoding"] = "utf-8"
    except UnicodeDecodeError:
        entry["body"] = base64.b64encode(outcome.body).decode()
        entry["encoding"] = "base64"
    return entry, budget - size


_NOT_TOKEN = re.compile(r"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")


def server_timing(entries: list[tuple[str, float]]) -> str:
    """``name;dur=ms, ...`` with names made RFC 7230 tokens; a step that would clash with the
    ``total`` metric is reported as ``step-total``."""
    out = []
    for i, (name, seconds) in enumerate(entries):
        token = _NOT_TOKEN.sub("-", name) or "step"
        if token == TOTAL_METRIC and i < len(entries) - 1:
            token = f"step-{token}"
        out.append(f"{token};dur={seconds * 1000:.3f}")
    return ", ".join(out)


async def run_pipeline(
    spec: PipelineSpec, body: bytes, content_type: str, call: CallFunction
) -> Outcome:
    """Run every step once its inputs are ready; the sinks' answers make the result (with the
    run's ``Server-Timing``)."""
    return (await execute_pipeline(spec, body, content_type, call)).outcome


async def execute_pipeline(
    spec: PipelineSpec, body: bytes, content_type: str, call: CallFunction
) -> PipelineRun:
    """:func:`run_pipeline` keeping each step's answer and time."""
    started = time.perf_counter()
    with tracer.start_as_current_span(f"pipeline {spec.name}", attributes={"pipeline": spec.name}):
        done: dict[str, asyncio.Future[StageResult]] = {
            s.name: asyncio.get_running_loop().create_future() for s in spec.steps
        }

        async def run_step(step: Step) -> None:
            try:
                inputs = [(await done[dep]).outcome for dep in step.after]
                if not step.after:
                    step_body, step_type = body, content_type
                elif len(inputs) == 1:
                    step_body = inputs[0].body
                    step_type = inputs[0].headers.get("Content-Type", "application/octet-stream")
                else:
                    joined = {d: _as_json(o) for d, o in zip(step.after, inputs, strict=True)}
                    step_body, step_type = json.dumps(joined).encode(), "application/json"
                with tracer.start_as_current_span(
                    f"step {step.name}", attributes={"step": step.name, "function": step.function}
                ):
                    step_started = time.perf_counter()
                    outcome = await _call_step(spec, step, step_body, step_type, call)
                    took = time.perf_counter() - step_started
                done[step.name].set_result(StageResult(step.name, step.function, took, outcome))
            except BaseException as e:
                if not done[step.name].done():
                    done[step.name].set_exception(e)
                raise

        tasks = [asyncio.create_task(run_step(s), name=f"trims-step-{s.name}") for s in spec.steps]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for fut in done.values():
                if fut.done() and not fut.cancelled():
                    fut.exception()
            raise
        stages = tuple(done[s.name].result() for s in spec.steps)
        sinks = spec.sinks
        if len(sinks) == 1:
            final = done[sinks[0]].result().outcome
        else:
            joined = {name: _as_json(done[name].result().outcome) for name in sinks}
            final = Outcome(200, {"Content-Type": "application/json"}, json.dumps(joined).encode())
    total = time.perf_counter() - started
    headers = CIMultiDict(final.headers)
    headers["Server-Timing"] = server_timing(
        [(s.step, s.duration_s) for s in stages] + [(TOTAL_METRIC, total)]
    )
    return PipelineRun(spec.name, Outcome(final.status, headers, final.body), stages, total)


async def _call_step(
    spec: PipelineSpec, step: Step, body: bytes, content_type: str, call: CallFunction
) -> Outcome:
    where = f"pipeline {spec.name} step {step.name} (function {step.function})"
    try:
        outcome = await call(step.function, body, content_type)
    except TrimsError as e:
        raise type(e)(f"{where}: {e.message}", **e.details) from e
    if outcome.status >= 400:
        text = outcome.body[:200].decode("utf-8", "replace")
        raise UpstreamError(f"{where} answered {outcome.status}: {text}", step=step.name)
    return outcome


def _as_json(outcome: Outcome) -> Any:
    """A step's answer as a value in a join: JSON as JSON, UTF-8 as text, else base64."""
    content_type = outcome.headers.get("Content-Type", "application/octet-stream")
    try:
        text = outcome.body.decode("utf-8")
    except UnicodeDecodeError:
        return {
            "content_type": content_type,
            "encoding": "base64",
            "body": base64.b64encode(outcome.body).decode(),
        }
    if _is_json(content_type):
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _is_json(content_type: str) -> bool:
    """``application/json`` or a ``+json`` type, parameters aside."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")
