"""Attention scoring functions of D2L "Attention Scoring Functions" and multi-head attention.

Every module here is pure math (no I/O) and exports to ONNX with dynamic batch, sequence and,
where no weight fixes them, feature axes. Two rules keep the export dynamic:

- Masks are built by broadcasting `arange(n_k) < valid_lens`, never with `repeat_interleave`
  (a symbolic repeat count exports but fails in ONNX Runtime whenever batch != n_q).
- The `1/sqrt(d)` scale is a tensor op on the symbolic size: `math.sqrt(q.shape[-1])` would
  freeze `d` to the example's value.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MaskedSoftmax",
    "MultiHeadAttention",
    "masked_softmax",
]


def masked_softmax(scores: torch.Tensor, valid_lens: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of `scores`, keeping only the first `valid_len` keys.

    `scores` is `(batch, ..., n_q, n_k)`; `valid_lens` is None, `(batch,)` (one length for every
    query of an example) or `(batch, n_q)` (one per query). Keys at positions `>= valid_len` get
    weight exactly 0; lengths of `n_k` or more keep every key, as in the book.

    Unlike the book, whose `-1e6` fill turns a fully masked row into uniform weights, a query
    whose valid length is 0 (or negative) attends to nothing: its weight row is all zeros, so its
    output row is zeros too, and no NaN appears.
    """
    if valid_lens is None:
        return nn.functional.softmax(scores, dim=-1)
    if valid_lens.dim() not in (1, 2):
        raise ValueError(f"valid_lens must be 1-D or 2-D, got shape {tuple(valid_lens.shape)}")
    n_k = scores.shape[-1]
    lens = valid_lens if valid_lens.dim() == 2 else valid_lens.unsqueeze(-1)  # (batch, n_q or 1)
    # Align `lens` with scores' leading axes: (batch, 1, ..., 1, n_q or 1, 1)
    lens = lens.reshape(lens.shape[:1] + (1,) * (scores.dim() - 3) + lens.shape[1:] + (1,))
    keep = torch.arange(n_k, device=scores.device) < lens  # (batch, ..., n_q or 1, n_k)
    # The smallest finite value rather than -inf: a fully masked row stays finite (uniform)
    # before the `where` below zeroes it; it cannot overflow in float16 as -1e6 does.
    filled = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(filled, dim=-1)
    return torch.where(keep, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


class MaskedSoftmax(nn.Module):
    """`masked_softmax` as a module, so that it exports (and is served) on its own: scores in,
    attention weights out (twice: as `outputs` and as `attention_weights`, the names every other
    model of the service answers with)."""

    def forward(
        self,
        scores: torch.Tensor,  # (batch, n_q, n_k)
        valid_lens: torch.Tensor | None = None,  # None, (batch,) or (batch, n_q)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weights = masked_softmax(scores, valid_lens)  # (batch, n_q, n_k)
        return weights, weights


class AdditiveAttention(nn.Module):
    """Additive attention: a(q, k) = w_v^T tanh(W_q q + W_k k), bias-free, as in the book."""

    def __init__(self, key_size: int, query_size: int, num_hiddens: int, dropout: float = 0.0):
        super().__init__()
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        queries: torch.Tensor,  # (batch, n_q, query_size)
        keys: torch.Tensor,  # (batch, n_k, key_size)
        values: torch.Tensor,  # (batch, n_k, value_size)
        valid_lens: torch.Tensor | None = None,  # None, (batch,) or (batch, n_q)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.W_q(queries), self.W_k(keys)  # (batch, n_q, h), (batch, n_k, h)
        features = torch.tanh(q.unsqueeze(2) + k.unsqueeze(1))  # (batch, n_q, n_k, h)
        scores = self.w_v(features).squeeze(-1)  # (batch, n_q, n_k)
        weights = masked_softmax(scores, valid_lens)  # (batch, n_q, n_k)
        return torch.matmul(self.dropout(weights), values), weights  # (batch, n_q, value_size)


class DotProductAttention(nn.Module):
    """Scaled dot-product attention: softmax(Q K^T / sqrt(d)) V, over any leading axes."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        queries: torch.Tensor,  # (batch, ..., n_q, d)
        keys: torch.Tensor,  # (batch, ..., n_k, d)
        values: torch.Tensor,  # (batch, ..., n_k, value_size)
        valid_lens: torch.Tensor | None = None,  # None, (batch,) or (batch, n_q)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A tensor, not math.sqrt: keeps `d` symbolic in the exported graph.
        scale = torch.rsqrt(torch.tensor(queries.shape[-1], dtype=queries.dtype))
        scores = torch.matmul(queries, keys.transpose(-2, -1)) * scale  # (batch, ..., n_q, n_k)
        weights = masked_softmax(scores, valid_lens)
        return torch.matmul(self.dropout(weights), values), weights  # (batch, ..., n_q, value_size)


class MultiHeadAttention(nn.Module):
    """The book's multi-head attention: W_q, W_k, W_v project to `num_hiddens`, split into
    `num_heads` heads of scaled dot-product attention, concatenate, then W_o.

    Attention weights come back as `(batch, num_heads, n_q, n_k)`; the book's
    `(batch * num_heads, n_q, n_k)` is the same tensor, flattened (row `b * num_heads + h`).
    """

    def __init__(
        self,
        key_size: int,
        query_size: int,
        value_size: int,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
    ):
        super().__init__()
        if num_heads <= 0 or num_hiddens % num_heads != 0:
            raise ValueError(
                f"num_hiddens ({num_hiddens}) must be a multiple of num_heads ({num_heads})"
            )
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, n = x.shape[0], x.shape[1]
        x = x.reshape(batch, n, self.num_heads, -1)  # (batch, n, num_heads, head_dim)
        return x.transpose(1, 2)  # (batch, num_heads, n, head_dim)

    def forward(
        self,
        queries: torch.Tensor,  # (batch, n_q, query_size)
        keys: torch.Tensor,  # (batch, n_k, key_size)
        values: torch.Tensor,  # (batch, n_k, value_size)
        valid_lens: torch.Tensor | None = None,  # None, (batch,) or (batch, n_q)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = self._split_heads(self.W_q(queries))  # (batch, num_heads, n_q, head_dim)
        k = self._split_heads(self.W_k(keys))  # (batch, num_heads, n_k, head_dim)
        v = self._split_heads(self.W_v(values))  # (batch, num_heads, n_k, head_dim)
        # masked_softmax broadcasts valid_lens over the head axis: the same lengths for every
        # head, which is what the book's repeat_interleave over batch * num_heads does.
        out, weights = self.attention(q, k, v, valid_lens)  # (batch, num_heads, n_q, head_dim)
        batch, n_q = out.shape[0], out.shape[2]
        out = out.transpose(1, 2).reshape(batch, n_q, -1)  # (batch, n_q, num_hiddens)
        return self.W_o(out), weights  # weights: (batch, num_heads, n_q, n_k)
