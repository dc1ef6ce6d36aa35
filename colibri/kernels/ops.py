"""Small fused numba kernels for the decode step's glue: RMSNorm, RoPE, one-query attention
over the KV cache, SiLU-gated product. Each replaces 5-15 numpy calls whose per-call overhead
(~1-3 us each, x 30 layers) was a large share of a small model's decode step. Sums accumulate
in float64, so results stay within float32 rounding of the numpy references in
tests/kernels/test_ops.py (which follow transformers' formulas)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


@njit(cache=True)
def rms_norm(x, w, eps):
    """x [L, D] float32 -> w * x / sqrt(mean(x^2) + eps), row by row."""
    L, D = x.shape
    out = np.empty_like(x)
    for i in range(L):
        acc = 0.0
        for j in range(D):
            v = np.float64(x[i, j])
            acc += v * v
        inv = np.float32(1.0 / math.sqrt(np.float32(acc / D) + eps))
        for j in range(D):
            out[i, j] = w[j] * (x[i, j] * inv)
    return out


@njit(cache=True)
def rope(x, cos, sin, rot):
    """x [L, H, Dh] float32, rotated in place on its first `rot` dims (rotate_half convention:
    pairs (j, j + rot/2)); cos/sin [L, rot]."""
    L, H, _ = x.shape
    half = rot // 2
    for i in range(L):
        for h in range(H):
            for j in range(half):
                a = x[i, h, j]
                b = x[i, h, j + half]
                x[i, h, j] = a * cos[i, j] - b * sin[i, j]
                x[i, h, j + half] = b * cos[i, j + half] + a * sin[i, j + half]


@njit(cache=True, parallel=True, fastmath={"reassoc", "contract"})
def attend_one(q, k, v, n, scale):
    """One query position over the first n cached keys (decode). q [H, Dk]; k [KV, cap, Dk];
    v [KV, cap, Dv] -> [H * Dv]. Query heads share KV heads in groups of H // KV (GQA).
    Heads run in parallel; reassociation lets LLVM vectorize the q.k dot products."""
    H, Dk = q.shape
    KV, _, Dv = v.shape
    G = H // KV
    out = np.zeros(H * Dv, np.float32)
    for h in prange(H):
        kv = h // G
        scores = np.empty(n, np.float32)
        m = np.float32(-np.inf)
        for t in range(n):
            s = np.float32(0.0)
            for d in range(Dk):
                s += q[h, d] * k[kv, t, d]
            s *= scale
            scores[t] = s
            m = max(m, s)
        total = 0.0
        for t in range(n):
            e = np.exp(scores[t] - m)
            scores[t] = e
            total += e
        inv = np.float32(1.0 / total)
        for t in range(n):
            p = scores[t] * inv
            for d in range(Dv):
                out[h * Dv + d] += p * v[kv, t, d]
    return out


@njit(cache=True)
def silu_mul(gu, n):
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n]."""
    L = gu.shape[0]
    out = np.empty((L, n), np.float32)
    for i in range(L):
        for j in range(n):
            g = gu[i, j]
            out[i, j] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * gu[i, n + j]
    return out
