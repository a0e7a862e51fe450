"""The analyses as a benchmark function on the trims runtime (the public handler contract).

Deploy it with a spec like::

    name: analyze
    handler: trims.evaluation.functions:handler
    config: {db: /var/lib/trims/results.sqlite}
    scaling: {max_instances: 1, concurrency: 1, request_timeout_s: 600}

and invoke it with a JSON body naming the analysis and, optionally, its settings::

    trims functions invoke analyze --async \\
        --data '{"analysis": "bricks", "models": "families", "granularity": [1, 5]}'

The answer is the analysis' JSON, the same as ``trims analyze ANALYSIS --json`` writes, with
the human tables under ``"text"``. Settings a request may give: ``models`` (zoo or PyTorch
family names, the sets ``zoo``/``families``, and ``store:<key>`` for a model of the function's
own spec, as text or a list), ``framework``, ``variants``, ``threads``, ``batch``,
``granularity``, ``force``, ``max_time``, ``min_reps``, ``precision``, ``quick``.

Where results are kept (``db``) and the MXNet interpreter (``mxnet_python``) are the
deployment's: they come from the function's config, never from a request, so a caller cannot
make the function read or write files of its choosing. For the same reason a request names
models, not paths: a user's own ONNX model reaches the analyses through the spec's ``models``
(shared by the store like any function's model) and ``store:<key>``. Results accumulate in the
database across requests, so an analysis asked twice is measured once (``force`` re-measures).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from trims.errors import ValidationError
from trims.evaluation import families, zoo
from trims.evaluation.analyses import ANALYSES, MODEL_SETS, analyze, expand_models, make_settings
from trims.evaluation.requests import typed_fields

if TYPE_CHECKING:
    import onnx

    from trims.runtime.functions import Context, Request

#: request field -> the JSON types it may have
_FIELDS: dict[str, tuple[type, ...]] = {
    "models": (str, list),
    "framework": (str, list),
    "variants": (str, list),
    "threads": (int,),
    "batch": (int,),
    "granularity": (str, list),
    "force": (bool,),
    "max_time": (int, float),
    "min_reps": (int,),
    "precision": (int, float),
    "quick": (bool,),
}


#: a request names one of the function's own models (its spec's ``models``) as ``store:<key>``
STORE_PREFIX = "store:"


def onnx_model(model: Any, key: str) -> onnx.ModelProto:
    """The ONNX model behind ``ctx.models[key]``, with its weights in the proto.

    From the store: the stored graph, each external initializer filled from the shared
    mapping (a copy: the analysis exports sub-models from it). Loaded directly (no daemon):
    the ONNX file itself.
    """
    from trims.errors import TrimsError

    try:
        proto: onnx.ModelProto = model.onnx_model()
    except TrimsError as e:
        raise ValidationError(
            f"model {key!r} of this function is not an ONNX model; the analyses read ONNX "
            f"graphs ({e.message})"
        ) from None
    return proto


def _checked(body: dict[str, Any], own: Collection[str]) -> dict[str, Any]:
    out = typed_fields(body, _FIELDS, also={"analysis"})
    if "models" in out:
        listed = out["models"] if isinstance(out["models"], list) else [out["models"]]
        names = expand_models(",".join(str(m) for m in listed))
        allowed = set(zoo.zoo_names()) | set(families.FAMILIES) | set(MODEL_SETS)
        allowed |= {STORE_PREFIX + key for key in own}
        refused = [n for n in names if n not in allowed]
        if refused:
            mine = ", ".join(STORE_PREFIX + k for k in sorted(own)) or "none"
            raise ValidationError(
                f"models {refused} are neither zoo, PyTorch family nor this function's models "
                f"({mine}); a request names models ({', '.join(sorted(MODEL_SETS))}, zoo "
                "names, torch:<arch>, store:<model of the spec>), not paths"
            )
        out["models"] = list(names)
    return out


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    from trims.config import results_db

    body = request.json()
    if not isinstance(body, dict) or body.get("analysis") not in ANALYSES:
        raise ValidationError(
            'send a JSON object {"analysis": "layers|lowerbound|bricks", ...settings}'
        )
    fields = _checked(body, ctx.models)
    provided = {
        name: onnx_model(ctx.models[name.removeprefix(STORE_PREFIX)], name)
        for name in fields.get("models", ())
        if name.startswith(STORE_PREFIX)
    }
    db = str(ctx.config.get("db") or results_db(os.environ))
    settings = make_settings(
        body["analysis"],
        db=db,
        mxnet_python=ctx.config.get("mxnet_python"),
        provided=provided,
        **fields,
    )
    ctx.logger.info("analysis %s of %d models requested", settings.analysis, len(settings.models))
    report = analyze(settings)
    return {**report.body, "text": report.text}
