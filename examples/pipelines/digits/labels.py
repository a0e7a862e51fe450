"""Pipeline step ``labels``: a ``.npy`` row of class scores -> the top classes with names.

Config: ``labels`` (class id -> name) and ``top_k`` (default 3). Answers JSON
``{"class": 7, "label": "seven", "score": 0.98, "top": [{"class", "label", "score"}, ...]}``
(scores as the model gave them: probabilities or logits).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from trims.runtime.functions import Context, Request


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    scores = np.load(io.BytesIO(request.body), allow_pickle=False).reshape(-1)
    names = list(ctx.config.get("labels", []))
    k = min(int(ctx.config.get("top_k", 3)), scores.size)
    order = np.argsort(-scores, kind="stable")[:k]
    top = [
        {
            "class": int(c),
            "label": names[c] if c < len(names) else str(int(c)),
            "score": float(scores[c]),
        }
        for c in order
    ]
    return {**top[0], "top": top}
