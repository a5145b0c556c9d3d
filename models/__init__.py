"""PyTorch modules of D2L's attention chapters: pure math, no I/O, exportable to ONNX."""

from models.attention import AdditiveAttention, DotProductAttention, MultiHeadAttention, masked_softmax
from models.positional import PositionalEncoding, SelfAttention, sinusoidal_table

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MultiHeadAttention",
    "PositionalEncoding",
    "SelfAttention",
    "masked_softmax",
    "sinusoidal_table",
]
