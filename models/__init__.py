"""PyTorch modules of D2L's attention chapters: pure math, no I/O, exportable to ONNX."""

from models.attention import AdditiveAttention, DotProductAttention, MaskedSoftmax, MultiHeadAttention, masked_softmax
from models.positional import PositionalEncoding, SelfAttention, SinusoidalEncoding, sinusoidal_table

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MaskedSoftmax",
    "MultiHeadAttention",
    "PositionalEncoding",
    "SelfAttention",
    "SinusoidalEncoding",
    "masked_softmax",
    "sinusoidal_table",
]
