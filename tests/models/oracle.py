"""Plain-math oracle: the chapter's formulas, one query at a time, in float64 NumPy."""

import numpy as np


def softmax_valid(scores: np.ndarray, valid: int) -> np.ndarray:
    """alpha_i = exp(a_i) / sum_{j < valid} exp(a_j) for i < valid, else 0 (all 0 when valid <= 0)."""
    weights = np.zeros_like(scores)
    valid = min(int(valid), len(scores))
    if valid > 0:
        e = np.exp(scores[:valid] - scores[:valid].max())
        weights[:valid] = e / e.sum()
    return weights


def lens_for(valid_lens, b: int, i: int, n_k: int) -> int:
    if valid_lens is None:
        return n_k
    lens = np.asarray(valid_lens)
    return int(lens[b] if lens.ndim == 1 else lens[b, i])


def attention(score, Q, K, V, valid_lens):
    """f(q, (k_1, v_1), ...) = sum_i alpha(q, k_i) v_i for every example and query."""
    batch, n_q, n_k = Q.shape[0], Q.shape[1], K.shape[1]
    out = np.zeros((batch, n_q, V.shape[2]))
    W = np.zeros((batch, n_q, n_k))
    for b in range(batch):
        for i in range(n_q):
            a = np.array([score(Q[b, i], K[b, j]) for j in range(n_k)])
            W[b, i] = softmax_valid(a, lens_for(valid_lens, b, i, n_k))
            out[b, i] = W[b, i] @ V[b]
    return out, W


def dot_product(Q, K, V, valid_lens):
    """a(q, k) = q^T k / sqrt(d)."""
    d = Q.shape[-1]
    return attention(lambda q, k: q @ k / np.sqrt(d), Q, K, V, valid_lens)


def additive(W_q, W_k, w_v, Q, K, V, valid_lens):
    """a(q, k) = w_v^T tanh(W_q q + W_k k)."""
    return attention(lambda q, k: w_v @ np.tanh(W_q @ q + W_k @ k), Q, K, V, valid_lens)


def multi_head(W_q, W_k, W_v, W_o, num_heads, Q, K, V, valid_lens):
    """h_i = f(W_q^(i) q, W_k^(i) k, W_v^(i) v); output W_o [h_1; ...; h_H]. Biases are zero."""
    p = W_q.shape[0] // num_heads
    heads, weights = [], []
    for h in range(num_heads):
        rows = slice(h * p, (h + 1) * p)
        out, W = dot_product(Q @ W_q[rows].T, K @ W_k[rows].T, V @ W_v[rows].T, valid_lens)
        heads.append(out)
        weights.append(W)
    return np.concatenate(heads, axis=-1) @ W_o.T, np.stack(weights, axis=1)


def positional_encoding(n: int, d: int) -> np.ndarray:
    """p_{i,2j} = sin(i / 10000^(2j/d)), p_{i,2j+1} = cos(i / 10000^(2j/d))."""
    P = np.zeros((n, d))
    for i in range(n):
        for j in range(0, d, 2):
            P[i, j] = np.sin(i / 10000 ** (j / d))
            if j + 1 < d:
                P[i, j + 1] = np.cos(i / 10000 ** (j / d))
    return P
