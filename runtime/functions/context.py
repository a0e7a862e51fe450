"""The handler contract: what a function's code receives and may return.

A handler module defines ``handler(request, ctx)`` (sync or async) and optionally ``init(ctx)``
(once per instance, before the first request) and ``infer(inputs, ctx)`` (for functions that
serve a model over the Open Inference Protocol: a dict of NumPy arrays in and out).

``handler`` returns ``bytes``, ``str`` (UTF-8 text), a ``dict`` or ``list`` (JSON), a
:class:`Response`, or ``None`` (204, no body). Anything else is an error reported to the caller.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from trims.errors import ValidationError


@dataclass(frozen=True, slots=True)
class Request:
    body: bytes
    #: Request headers, names lower-cased.
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "application/octet-stream")

    def text(self) -> str:
        return self.body.decode("utf-8")

    def json(self) -> Any:
        """The body parsed as JSON; ValidationError (422) with the parse error otherwise."""
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise ValidationError(f"request body is not valid JSON: {e}") from e


@dataclass(frozen=True, slots=True)
class Response:
    body: bytes = b""
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Context:
    """What function code gets: its models (shared through the store), logger, tracer, config."""

    function: str
    instance_id: str
    #: Model key (the ModelRef's alias or name) -> trims.runtime.models.Model.
    models: Mapping[str, Any]
    logger: logging.Logger
    #: An OpenTelemetry tracer; spans started in handlers are children of the request span.
    tracer: Any
    config: Mapping[str, Any]
    #: Free for init(ctx) to keep per-instance objects (a built network, a tokenizer).
    state: dict[str, Any] = field(default_factory=dict)
