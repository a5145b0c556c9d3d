"""The modules against the book's printed examples, the book's own code, and a plain-math oracle."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from models import AdditiveAttention, DotProductAttention, MultiHeadAttention, masked_softmax
from tests import book
from tests.models import oracle


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- masked softmax -------------------------------------------------------------------------

def test_masked_softmax_1d_lengths_zero_exactly_the_masked_keys():
    # The book: masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3]))
    w = masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3]))
    keep = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)[:, None, :].expand(2, 2, 4)
    assert torch.all(w[~keep] == 0)
    assert torch.all(w[keep] > 0)
    assert_close(w.sum(-1), torch.ones(2, 2))


def test_masked_softmax_2d_lengths_zero_exactly_the_masked_keys():
    # The book: masked_softmax(torch.rand(2, 2, 4), d2l.tensor([[1, 3], [2, 4]]))
    w = masked_softmax(torch.rand(2, 2, 4), torch.tensor([[1, 3], [2, 4]]))
    keep = torch.tensor([[[1, 0, 0, 0], [1, 1, 1, 0]], [[1, 1, 0, 0], [1, 1, 1, 1]]], dtype=torch.bool)
    assert torch.all(w[~keep] == 0)
    assert torch.all(w[keep] > 0)
    assert_close(w[0, 0], torch.tensor([1.0, 0, 0, 0]))
    assert_close(w.sum(-1), torch.ones(2, 2))


def test_masked_softmax_matches_the_book_where_the_book_is_defined():
    X = torch.randn(3, 5, 7)
    for lens in (None, torch.tensor([1, 7, 4]), torch.randint(1, 9, (3, 5))):
        assert_close(masked_softmax(X, lens), book.masked_softmax(X.clone(), lens))


def test_valid_length_zero_attends_to_nothing_without_nan():
    # The book's -1e6 fill would give uniform weights here; we give zeros.
    w = masked_softmax(torch.randn(2, 3, 4), torch.tensor([[0, 2, 0], [4, 0, 1]]))
    assert not torch.isnan(w).any()
    assert torch.all(w[0, 0] == 0) and torch.all(w[0, 2] == 0) and torch.all(w[1, 1] == 0)
    assert_close(w[0, 1].sum(), torch.tensor(1.0))
    out, weights = DotProductAttention()(torch.randn(2, 3, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 6),
                                         torch.tensor([0, 4]))
    assert torch.all(out[0] == 0) and torch.all(weights[0] == 0)
    assert not torch.isnan(out).any()


def test_lengths_of_n_k_or_more_mean_all_keys():
    X = torch.randn(2, 3, 4)
    full = torch.softmax(X, -1)
    assert_close(masked_softmax(X, torch.tensor([4, 100])), full)
    assert_close(masked_softmax(X, torch.tensor([[4, 5, 6], [9, 4, 4]])), full)


def test_masked_softmax_broadcasts_lengths_over_heads():
    X = torch.randn(2, 5, 3, 4)  # (batch, heads, n_q, n_k)
    lens = torch.tensor([[1, 2, 3], [4, 0, 2]])
    w = masked_softmax(X, lens)
    for h in range(5):
        assert_close(w[:, h], masked_softmax(X[:, h], lens))


def test_masked_softmax_rejects_3d_lengths():
    with pytest.raises(ValueError, match="1-D or 2-D"):
        masked_softmax(torch.randn(2, 3, 4), torch.ones(2, 3, 1, dtype=torch.long))


# --- the book's toy examples ----------------------------------------------------------------

def _toy():
    keys = torch.ones((2, 10, 2))
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    return keys, values, torch.tensor([2, 6])


def _uniform(lens, n_k=10):
    return torch.stack([torch.cat([torch.full((n,), 1 / n), torch.zeros(n_k - n)]) for n in lens])[:, None, :]


def test_additive_toy_example():
    keys, values, valid_lens = _toy()
    attention = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    out, weights = attention(torch.normal(0, 1, (2, 1, 20)), keys, values, valid_lens)
    assert_close(out, torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]))
    assert_close(weights, _uniform([2, 6]))


def test_dot_product_toy_example():
    keys, values, valid_lens = _toy()
    attention = DotProductAttention(dropout=0.5).eval()
    out, weights = attention(torch.normal(0, 1, (2, 1, 2)), keys, values, valid_lens)
    assert_close(out, torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]]))
    assert_close(weights, _uniform([2, 6]))


def test_multi_head_example_shapes():
    num_hiddens, num_heads = 100, 5
    attention = MultiHeadAttention(num_hiddens, num_hiddens, num_hiddens, num_hiddens, num_heads, 0.5).eval()
    X = torch.ones((2, 4, num_hiddens))
    out, weights = attention(X, X, X, torch.tensor([3, 2]))
    assert out.shape == (2, 4, 100)
    assert weights.shape == (2, 5, 4, 4)
    assert torch.all(weights[0, :, :, 3:] == 0) and torch.all(weights[1, :, :, 2:] == 0)


def test_multi_head_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        MultiHeadAttention(10, 10, 10, 100, 3)


def test_eval_mode_turns_dropout_off():
    attention = MultiHeadAttention(8, 8, 8, 8, 2, dropout=0.9).eval()
    X = torch.randn(2, 3, 8)
    assert_close(attention(X, X, X)[0], attention(X, X, X)[0])


# --- the plain-math oracle on random inputs -------------------------------------------------

SHAPES = [(1, 1, 1), (2, 3, 5), (3, 4, 2), (4, 6, 6)]
LENS = ["none", "1d", "2d"]


def _random_lens(kind, batch, n_q, n_k):
    if kind == "none":
        return None
    shape = (batch,) if kind == "1d" else (batch, n_q)
    return torch.randint(0, n_k + 2, shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lens_kind", LENS)
def test_dot_product_matches_the_formula(shape, lens_kind):
    batch, n_q, n_k = shape
    Q, K, V = torch.randn(batch, n_q, 3), torch.randn(batch, n_k, 3), torch.randn(batch, n_k, 5)
    lens = _random_lens(lens_kind, batch, n_q, n_k)
    out, weights = DotProductAttention()(Q, K, V, lens)
    ref_out, ref_w = oracle.dot_product(Q.double().numpy(), K.double().numpy(), V.double().numpy(), lens)
    assert_close(out, torch.from_numpy(ref_out).float())
    assert_close(weights, torch.from_numpy(ref_w).float())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lens_kind", LENS)
def test_additive_matches_the_formula(shape, lens_kind):
    batch, n_q, n_k = shape
    attention = AdditiveAttention(key_size=3, query_size=4, num_hiddens=6).eval()
    Q, K, V = torch.randn(batch, n_q, 4), torch.randn(batch, n_k, 3), torch.randn(batch, n_k, 2)
    lens = _random_lens(lens_kind, batch, n_q, n_k)
    out, weights = attention(Q, K, V, lens)
    p = {k: v.double().numpy() for k, v in attention.state_dict().items()}
    ref_out, ref_w = oracle.additive(p["W_q.weight"], p["W_k.weight"], p["w_v.weight"][0],
                                     Q.double().numpy(), K.double().numpy(), V.double().numpy(), lens)
    assert_close(out, torch.from_numpy(ref_out).float())
    assert_close(weights, torch.from_numpy(ref_w).float())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lens_kind", LENS)
def test_multi_head_matches_the_formula(shape, lens_kind):
    batch, n_q, n_k = shape
    attention = MultiHeadAttention(key_size=5, query_size=3, value_size=4, num_hiddens=12, num_heads=3).eval()
    Q, K, V = torch.randn(batch, n_q, 3), torch.randn(batch, n_k, 5), torch.randn(batch, n_k, 4)
    lens = _random_lens(lens_kind, batch, n_q, n_k)
    out, weights = attention(Q, K, V, lens)
    p = {k: v.double().numpy() for k, v in attention.state_dict().items()}
    ref_out, ref_w = oracle.multi_head(p["W_q.weight"], p["W_k.weight"], p["W_v.weight"], p["W_o.weight"], 3,
                                       Q.double().numpy(), K.double().numpy(), V.double().numpy(), lens)
    assert_close(out, torch.from_numpy(ref_out).float())
    assert_close(weights, torch.from_numpy(ref_w).float())


# --- the book's classes: same numbers, and their state_dicts load unchanged ------------------

@pytest.mark.parametrize("bias", [False, True])
def test_multi_head_matches_the_book_and_loads_its_state_dict(bias):
    theirs = book.MultiHeadAttention(6, 4, 5, 20, 4, 0.5, bias=bias).eval()
    ours = MultiHeadAttention(6, 4, 5, 20, 4, 0.5, bias=bias).eval()
    ours.load_state_dict(theirs.state_dict())  # strict: names and shapes are the book's
    Q, K, V = torch.randn(3, 2, 4), torch.randn(3, 7, 6), torch.randn(3, 7, 5)
    for lens in (None, torch.tensor([1, 7, 3]), torch.randint(1, 8, (3, 2))):
        out, weights = ours(Q, K, V, lens)
        assert_close(out, theirs(Q, K, V, lens))
        # The book keeps (batch * num_heads, n_q, n_k), row b * num_heads + h.
        assert_close(weights.reshape(-1, 2, 7), theirs.attention.attention_weights)


def test_additive_loads_the_books_state_dict():
    theirs = book.AdditiveAttention(2, 20, 8, 0.1).eval()
    ours = AdditiveAttention(2, 20, 8, 0.1).eval()
    ours.load_state_dict(theirs.state_dict())
    Q, K, V = torch.randn(2, 3, 20), torch.randn(2, 5, 2), torch.randn(2, 5, 4)
    lens = torch.tensor([2, 5])
    out, weights = ours(Q, K, V, lens)
    assert_close(out, theirs(Q, K, V, lens))
    assert_close(weights, theirs.attention_weights)


def test_dot_product_matches_the_book():
    Q, K, V = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    theirs = book.DotProductAttention(0.0)
    for lens in (None, torch.tensor([2, 5]), torch.tensor([[1, 2, 3], [5, 4, 3]])):
        out, weights = DotProductAttention()(Q, K, V, lens)
        assert_close(out, theirs(Q, K, V, lens))
        assert_close(weights, theirs.attention_weights)


def test_oracle_is_not_trivially_satisfied():
    # Guard against an oracle that agrees with anything: a wrong scale must be caught.
    Q, K, V = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 6)
    out, _ = DotProductAttention()(Q * 2, K, V)
    ref_out, _ = oracle.dot_product(Q.double().numpy(), K.double().numpy(), V.double().numpy(), None)
    assert not np.allclose(out.numpy(), ref_out, atol=1e-3)


def test_masked_softmax_module_returns_the_weights_twice():
    from models import MaskedSoftmax

    scores, lens = torch.rand(2, 2, 4), torch.tensor([[1, 3], [2, 4]])
    outputs, weights = MaskedSoftmax()(scores, lens)
    assert_close(weights, masked_softmax(scores, lens))
    assert outputs is weights
