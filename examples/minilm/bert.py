"""The BERT encoder of all-MiniLM-L6-v2 as plain torch functions over its weight tensors.

No module objects: the forward pass reads the store's mapped tensors by name (the Hugging Face
``BertModel`` names), so nothing is copied or initialised. Sentence embedding = mean of the
last hidden states over real tokens, L2-normalised (the sentence-transformers pipeline).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn import functional as F

HEADS = 12
LAYERS = 6
EPS = 1e-12


def _linear(w: Mapping[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])


def _norm(w: Mapping[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], EPS)


def encode(
    w: Mapping[str, torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Last hidden states [batch, seq, 384] for token ids [batch, seq] (0/1 mask)."""
    batch, seq = input_ids.shape
    positions = torch.arange(seq).unsqueeze(0)
    x = (
        F.embedding(input_ids, w["embeddings.word_embeddings.weight"])
        + F.embedding(positions, w["embeddings.position_embeddings.weight"])
        + w["embeddings.token_type_embeddings.weight"][0]
    )
    x = _norm(w, "embeddings.LayerNorm", x)
    hidden = x.shape[-1]
    head_dim = hidden // HEADS
    bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, HEADS, head_dim).transpose(1, 2)

        q = heads(_linear(w, f"{p}.attention.self.query", x))
        k = heads(_linear(w, f"{p}.attention.self.key", x))
        v = heads(_linear(w, f"{p}.attention.self.value", x))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        context = context.transpose(1, 2).reshape(batch, seq, hidden)
        x = _norm(
            w,
            f"{p}.attention.output.LayerNorm",
            _linear(w, f"{p}.attention.output.dense", context) + x,
        )
        inner = F.gelu(_linear(w, f"{p}.intermediate.dense", x))
        x = _norm(w, f"{p}.output.LayerNorm", _linear(w, f"{p}.output.dense", inner) + x)
    return x


def sentence_embeddings(
    w: Mapping[str, torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Mean-pooled, L2-normalised sentence embeddings [batch, 384]."""
    states = encode(w, input_ids, attention_mask)
    mask = attention_mask.unsqueeze(-1).to(states.dtype)
    pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=1)
