"""Sinusoidal positional encoding and self-attention."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from models import MultiHeadAttention, PositionalEncoding, SelfAttention, sinusoidal_table
from tests import book
from tests.models import oracle


@pytest.mark.parametrize("n, d", [(60, 32), (7, 2), (5, 9)])
def test_table_is_the_chapters_formula(n, d):
    assert_close(sinusoidal_table(n, d), torch.from_numpy(oracle.positional_encoding(n, d)).float(),
                 atol=2e-5, rtol=1e-5)


def test_matches_the_books_class():
    theirs = book.PositionalEncoding(32, 0).eval()
    ours = PositionalEncoding(32, 0).eval()
    X = torch.randn(2, 60, 32)
    assert_close(ours(X), theirs(X))
    assert list(ours.state_dict()) == []  # P is a buffer, but not part of the checkpoint


def test_relative_position_is_a_rotation():
    # For any offset delta, [p_{i+delta,2j}, p_{i+delta,2j+1}] is [p_{i,2j}, p_{i,2j+1}] rotated
    # by a matrix that depends on delta (and j) only, not on i.
    d, delta = 32, 7
    P = sinusoidal_table(200, d).double()
    omega = 1 / torch.pow(torch.tensor(10000.0, dtype=torch.float64), torch.arange(0, d, 2, dtype=torch.float64) / d)
    for j in range(d // 2):
        c, s = torch.cos(delta * omega[j]), torch.sin(delta * omega[j])
        R = torch.stack([torch.stack([c, s]), torch.stack([-s, c])])
        pairs = P[:, 2 * j: 2 * j + 2]  # (200, 2)
        rotated = pairs[:-delta] @ R.T  # R @ column i gives column i + delta
        assert_close(rotated, pairs[delta:], atol=5e-5, rtol=0)


def test_longer_than_max_len_is_refused():
    with pytest.raises(ValueError, match="exceeds max_len"):
        PositionalEncoding(8, 0, max_len=10)(torch.zeros(1, 11, 8))


def test_self_attention_is_multi_head_on_x_plus_p():
    sa = SelfAttention(num_hiddens=20, num_heads=4, max_len=50).eval()
    mha = MultiHeadAttention(20, 20, 20, 20, 4).eval()
    mha.load_state_dict(sa.state_dict())
    X = torch.randn(3, 9, 20)
    lens = torch.tensor([9, 3, 0])
    XP = X + torch.from_numpy(oracle.positional_encoding(9, 20)).float()
    out, weights = sa(X, lens)
    ref_out, ref_w = mha(XP, XP, XP, lens)
    assert_close(out, ref_out)
    assert_close(weights, ref_w)
    assert weights.shape == (3, 4, 9, 9)
    assert torch.all(out[2] == mha.W_o(torch.zeros(20)))  # length 0: every head's output is 0


def test_self_attention_loads_the_books_multi_head_state_dict():
    theirs = book.MultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
    sa = SelfAttention(100, 5, 0.5).eval()
    sa.load_state_dict(theirs.state_dict())
    X = torch.ones(2, 4, 100)
    XP = book.PositionalEncoding(100, 0).eval()(X)
    lens = torch.tensor([3, 2])
    assert_close(sa(X, lens)[0], theirs(XP, XP, XP, lens))
    assert np.array_equal(sorted(sa.state_dict()), sorted(theirs.state_dict()))


@pytest.mark.parametrize("n, d", [(60, 32), (1000, 100), (3, 2), (17, 512)])
def test_sinusoidal_encoding_computes_the_table_for_any_even_size(n, d):
    from models import SinusoidalEncoding

    X = torch.randn(2, n, d)
    out, P = SinusoidalEncoding()(X)
    assert_close(P, sinusoidal_table(n, d), rtol=0, atol=0)  # the same arithmetic, to the bit
    assert_close(out, X + P)
    # float64 inside: within float32's rounding of the exact formula, even at position 999
    assert np.abs(P.numpy() - oracle.positional_encoding(n, d)).max() < 1e-7


def test_sinusoidal_encoding_agrees_with_the_books_class():
    from models import SinusoidalEncoding

    X = torch.randn(2, 60, 32)
    # The book rounds its angles to float32 (up to 60 x 6e-8 off at position 60); ours are exact.
    assert_close(SinusoidalEncoding()(X)[0], book.PositionalEncoding(32, 0).eval()(X), atol=5e-6, rtol=0)
