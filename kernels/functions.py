"""The studies as a benchmark function on the trims runtime (the public handler contract).

Deploy it with a spec like::

    name: kernels
    handler: trims.kernels.functions:handler
    scaling: {max_instances: 1, concurrency: 1}

and invoke it with a JSON body naming the study and, optionally, its settings (the fields of
the study's settings dataclass)::

    trims functions invoke kernels --data '{"study": "tcu", "settings": {"max_log2": 14}}'

The answer is the study's JSON, the same as ``trims kernels STUDY --json`` writes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trims.errors import ValidationError
from trims.kernels import studies

if TYPE_CHECKING:
    from trims.runtime.functions import Context, Request

log = logging.getLogger(__name__)


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    body = request.json()
    if not isinstance(body, dict) or not isinstance(body.get("study"), str):
        raise ValidationError(
            'send a JSON object {"study": "tcu|klap|transfer|als", "settings": {...}}'
        )
    settings = body.get("settings") or {}
    if not isinstance(settings, dict):
        raise ValidationError('"settings" must be a JSON object of the study\'s settings fields')
    ctx.logger.info("kernels study %s requested with settings %s", body["study"], settings)
    return studies.run(body["study"], studies.settings_from(body["study"], settings))
