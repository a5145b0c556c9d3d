"""Sinusoidal positional encoding and self-attention, D2L "Self-Attention and Positional Encoding"."""

from __future__ import annotations

import torch
from torch import nn

from models.attention import MultiHeadAttention

__all__ = ["PositionalEncoding", "SelfAttention", "SinusoidalEncoding", "sinusoidal_table"]


def sinusoidal_table(max_len: int, num_hiddens: int) -> torch.Tensor:
    """P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(i / 10000^(2j/d)); shape (max_len, d).

    Computed in float64, then rounded to float32: the book's float32 arithmetic is off by up to
    6e-5 at position 1000 (the angle's rounding, times 1000), and two float32 implementations of pow
    and sin (PyTorch's, ONNX Runtime's) disagree by as much. In float64 both round to the same P.
    """
    P = torch.zeros(max_len, num_hiddens, dtype=torch.float64)
    X = torch.arange(max_len, dtype=torch.float64).reshape(-1, 1) / torch.pow(
        10000, torch.arange(0, num_hiddens, 2, dtype=torch.float64) / num_hiddens
    )  # (max_len, ceil(d / 2))
    P[:, 0::2] = torch.sin(X)
    P[:, 1::2] = torch.cos(X[:, : num_hiddens // 2])  # an odd d has one cosine column fewer
    return P.to(torch.float32)


class PositionalEncoding(nn.Module):
    """Adds the chapter's sinusoidal P to X, then dropout.

    P is a non-persistent buffer: it follows `.to(device)` but stays out of the state_dict,
    like the book's plain attribute, so the book's checkpoints load unchanged.
    """

    def __init__(self, num_hiddens: int, dropout: float = 0.0, max_len: int = 1000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("P", sinusoidal_table(max_len, num_hiddens).unsqueeze(0), persistent=False)

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # X: (batch, n, num_hiddens)
        if X.shape[1] > self.P.shape[1]:
            raise ValueError(f"sequence length {X.shape[1]} exceeds max_len {self.P.shape[1]}")
        return self.dropout(X + self.P[:, : X.shape[1], :])  # (batch, n, num_hiddens)


class SinusoidalEncoding(nn.Module):
    """X + P for any (even) feature size: P computed from X's shape with the chapter's formula,
    operation for operation as `sinusoidal_table` does, so that it exports with n and d dynamic
    (a table would fix d). Returns (X + P, P); P is (n, d)."""

    def __init__(self, max_len: int = 1000):
        super().__init__()
        self.max_len = max_len

    def forward(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # X: (batch, n, d), d even
        n, d = X.shape[1], X.shape[2]
        position = torch.arange(n, dtype=torch.float64).reshape(-1, 1)  # (n, 1)
        # A tensor, not a Python number: keeps d symbolic in the exported graph. float64 as in
        # sinusoidal_table, for the same P to the last bit.
        size = torch.tensor(d, dtype=torch.float64)
        angle = position / torch.pow(10000, torch.arange(0, d, 2, dtype=torch.float64) / size)  # (n, d / 2)
        P = torch.stack([torch.sin(angle), torch.cos(angle)], dim=-1).reshape(n, d)  # sin, cos interleaved
        P = P.to(torch.float32)
        return X + P, P  # (batch, n, d), (n, d)


class SelfAttention(MultiHeadAttention):
    """Self-attention of the chapter: X + P, then multi-head attention with X as queries, keys
    and values. It *is* a MultiHeadAttention (same parameter names, W_q/W_k/W_v/W_o), so the
    book's `MultiHeadAttention(d, d, d, d, heads, dropout)` state_dict loads unchanged.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        max_len: int = 1000,
        bias: bool = False,
    ):
        super().__init__(num_hiddens, num_hiddens, num_hiddens, num_hiddens, num_heads, dropout, bias)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout, max_len)

    def forward(  # type: ignore[override]
        self,
        X: torch.Tensor,  # (batch, n, num_hiddens)
        valid_lens: torch.Tensor | None = None,  # None, (batch,) or (batch, n)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        X = self.pos_encoding(X)
        return super().forward(X, X, X, valid_lens)  # (batch, n, d), (batch, heads, n, n)
