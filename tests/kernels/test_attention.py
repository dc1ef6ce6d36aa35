"""Blockwise prefill attention (kernels/attention.py) against the plain full-softmax reference."""
import numpy as np
import pytest

from colibri.kernels import attention
from colibri.kernels.attention import OnlineSoftmax, causal_attention, reference_attention


def causal_reference(q, k, v, pos0, scale):
    L, H, _ = q.shape
    KV = k.shape[0]
    G = H // KV
    N = pos0 + L
    visible = np.arange(N)[None, :] <= (pos0 + np.arange(L))[:, None]
    out = [reference_attention(q[None, :, h], k[h // G][None, :N], v[h // G][None, :N], visible, scale)[0]
           for h in range(H)]                                                   # H x [L, Dv]
    return np.stack(out, axis=1).reshape(L, -1)


@pytest.mark.parametrize("L,pos0,H,KV,D,block", [(1, 0, 2, 1, 8, 64), (7, 0, 4, 2, 16, 3), (33, 20, 6, 3, 8, 5),
                                                 (64, 100, 4, 4, 32, 64), (130, 0, 8, 2, 16, 17)])
@pytest.mark.parametrize("threads", [1, 2])
def test_causal_attention_matches_reference(monkeypatch, L, pos0, H, KV, D, block, threads):
    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", 1)
    monkeypatch.setattr(attention, "MIN_BLOCK", block)
    rng = np.random.default_rng(L + pos0)
    N = pos0 + L + 3  # the cache may hold more than the visible keys
    q = rng.standard_normal((L, H, D), dtype=np.float32)
    k = rng.standard_normal((KV, N, D), dtype=np.float32)
    v = rng.standard_normal((KV, N, D), dtype=np.float32)
    scale = np.float32(D ** -0.5)
    got = causal_attention(q, k, v, pos0, scale, threads)
    np.testing.assert_allclose(got, causal_reference(q, k, v, pos0, scale), rtol=1e-5, atol=2e-6)


def test_online_softmax_rows_with_nothing_visible_in_a_block():
    """A row whose first blocks are all masked (a sparse selection) must not turn into NaN."""
    rng = np.random.default_rng(0)
    s = rng.standard_normal((3, 10), dtype=np.float32)
    v = rng.standard_normal((10, 4), dtype=np.float32)
    visible = np.ones((3, 10), bool)
    visible[1, :6] = False
    acc = OnlineSoftmax((3,), 4)
    for n0 in range(0, 10, 3):
        blk = np.where(visible[:, n0:n0 + 3], s[:, n0:n0 + 3], np.float32(-np.inf))
        acc.update(blk, v[n0:n0 + 3])
    p = np.where(visible, np.exp(s - s.max(axis=1, keepdims=True)), 0)
    want = (p / p.sum(axis=1, keepdims=True)) @ v
    np.testing.assert_allclose(acc.result(), want, rtol=1e-5, atol=1e-6)


def test_key_block_bounds_the_scores():
    assert attention.key_block(1) == attention.MAX_BLOCK
    assert attention.key_block(10**9) == attention.MIN_BLOCK
    rows = 4096
    assert rows * attention.key_block(rows) * 4 <= attention.SCORE_BLOCK_BYTES


@pytest.mark.parametrize("visible0,period", [(0, 4), (3, 4), (-2, 5), (9, 3), (40, 4)])
def test_causal_block_equals_its_masked_scores(visible0, period):
    """update(visible0=, period=) hides the scores past each row's visible count without a
    mask: the same as the block with those scores set to -inf (the same row max, taken over
    the visible ones only, in 16-lane maxima plus a tail: widths around 16; sums within
    rounding, as the vectorized sum's tail moves with the count)."""
    rng = np.random.default_rng(visible0 + 7 * period)
    for width in (5, 16, 37):
        s = rng.standard_normal((2 * period, width), dtype=np.float32) * 4
        v = rng.standard_normal((width, 3), dtype=np.float32)
        counts = np.clip(visible0 + np.arange(2 * period) % period, 0, width)
        masked = np.where(np.arange(width)[None, :] < counts[:, None], s, np.float32(-np.inf))
        a, b = OnlineSoftmax((2 * period,), 3), OnlineSoftmax((2 * period,), 3)
        for acc in (a, b):  # a first block every row sees, so rows with nothing visible stay finite
            acc.update(np.zeros((2 * period, 2), np.float32), np.ones((2, 3), np.float32))
        a.update(s.copy(), v, visible0=visible0, period=period)
        b.update(masked, v)
        assert np.array_equal(a.m, b.m)
        np.testing.assert_allclose(a.l, b.l, rtol=1e-6)
        np.testing.assert_allclose(a.result(), b.result(), rtol=1e-5, atol=1e-6)
