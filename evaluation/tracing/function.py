"""The ``trace`` benchmark function: a leveled trace of one model, on the trims runtime.

Deploy ``examples/trace/function.yaml`` and invoke it with::

    trims functions invoke trace --data '{"model": "torch:resnet18", "framework": "onnxruntime",
                                          "level": "layer", "runs": 20, "batch": 1}'

The answer is the JSON of ``trims trace --json`` (levels, untraced latency, coverage, layer
table, trace id, unavailable levels) plus ``"chrome"``, the Chrome trace-event object of the
trace (save it as ``.trace.json`` and open it in Perfetto). Settings a request may give:
``model`` (required), ``framework``, ``level``, ``runs``, ``batch``, ``threads``,
``max_time``, ``quick``. Each is checked, and bounded (:data:`LIMITS`), before any model
loads, so a bad request costs nothing and no request can hold the instance for long.

As with the analyses function, a request names models (zoo, ``torch:<arch>``,
``example:resnet50``), never paths, and where traces are stored (``db``) is the
deployment's, from the function's config, and so is the MXNet environment's interpreter
(``mxnet_python``, for ``"framework": "mxnet"``; default ``$TRIMS_MXNET_PYTHON`` or
``/tmp/trims-mxnet-venv/bin/python``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from trims.errors import ValidationError
from trims.evaluation import families, zoo
from trims.evaluation.requests import typed_fields
from trims.evaluation.tracing.run import make_request, trace
from trims.evaluation.tracing.workload import EXAMPLE

if TYPE_CHECKING:
    from trims.runtime.functions import Context, Request

#: request field -> the JSON types it may have
_FIELDS: dict[str, tuple[type, ...]] = {
    "model": (str,),
    "framework": (str,),
    "level": (str,),
    "runs": (int,),
    "batch": (int,),
    "threads": (int,),
    "max_time": (int, float),
    "quick": (bool,),
}
#: the most a request may ask of one instance: setting -> bound
LIMITS: dict[str, float] = {"runs": 200, "batch": 64, "threads": 16, "max_time": 30.0}


def checked(body: object) -> dict[str, Any]:
    """The request's settings, type- and bound-checked; ValidationError saying what to fix."""
    if not isinstance(body, dict) or "model" not in body:
        raise ValidationError(
            'send a JSON object {"model": "torch:resnet18", '
            '"framework": "torch|onnxruntime|mxnet", '
            '"level": "model|layer|library|kernel|full", "runs": N, "batch": B}'
        )
    out = typed_fields(body, _FIELDS)
    for key, value in out.items():
        if key in LIMITS and isinstance(value, int | float) and value > LIMITS[key]:
            raise ValidationError(
                f"setting {key!r} is at most {LIMITS[key]:g} for the trace function, got {value!r}"
            )
    model = out["model"]
    allowed = set(zoo.zoo_names()) | set(families.FAMILIES) | {EXAMPLE}
    if model not in allowed:
        raise ValidationError(
            f"model {model!r} is neither a zoo model, a PyTorch family model nor {EXAMPLE}; a "
            "request names models (zoo names, torch:<arch>, example:resnet50), not paths"
        )
    return out


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    from trims.config import results_db
    from trims.evaluation.tracing import store
    from trims.tracing.chrome import to_chrome

    fields = checked(request.json())
    req = make_request(**fields)
    ctx.logger.info(
        "trace of %s (%s) to level %s requested", req.model, req.framework, req.level.label
    )
    result, report = trace(
        req,
        process=f"trace function {ctx.instance_id}",
        mxnet_python=ctx.config.get("mxnet_python"),
    )
    db = str(ctx.config.get("db") or results_db(os.environ))
    store.save(db, result.trace, report.body, req.level.label)
    return {**report.body, "chrome": to_chrome(result.trace), "text": report.text}
