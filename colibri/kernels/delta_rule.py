"""Gated DeltaNet's recurrent kernels (Qwen3-Next / Qwen3.5 linear attention): the short causal
convolution over q/k/v, the gated delta rule one token at a time (decode) and its chunked
form (prefill), after transformers' torch_recurrent_gated_delta_rule and
torch_chunk_gated_delta_rule (Yang et al. 2024, "Gated Delta Networks"); and Kimi Delta
Attention (Kimi Linear), the same rule with a decay per key channel (kda_step, kda_chunked).

Per value head h the state S [Dk, Dv] maps keys to values. For each token, with q and k
L2-normalized (and q scaled by Dk^-1/2):

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

The chunked form computes the same outputs C tokens at a time: within a chunk the delta
updates are one unit-lower-triangular solve (the UT transform), and the state is read and
written once per chunk, not once per token. The two forms are equal up to float32 rounding;
each is deterministic, and each head is one thread's work (prange over heads), so the thread
count changes no bit. References in numpy: tests/kernels/test_delta_rule.py.

Shape letters: L tokens, C channels (the convolution's, q|k|v), K kernel width, Hk key heads,
Hv value heads (each key head serves Hv/Hk consecutive value heads), Dk / Dv head dims,
n tokens in a chunk.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .cpu.fpenv import flush_subnormals, restore_fp
from .ops import expf

FAST = {"reassoc", "contract", "nsz"}  # sums may reassociate (vectorized); each head is one thread's, so
# the thread count still changes no bit
CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's chunk size)
L2_EPS = 1e-6  # the L2 norm's epsilon (FLA's, which transformers follows)


@njit(cache=True, inline="always")
def _silu(x):
    return x / (np.float32(1.0) + expf(-x))


@njit(cache=True, parallel=True)
def causal_conv(x, state, w):
    """Depthwise causal convolution with SiLU: x [L, C], state [K-1, C] (the K-1 inputs before
    x[0]; updated in place to the last K-1 inputs), w [C, K] -> [L, C]. Tokens in parallel, each
    tap's weights read as one contiguous row over the channels (w.T): per element the same
    products summed in tap order, whatever the thread count."""
    L, C = x.shape
    K = w.shape[1]
    window = np.empty((K - 1 + L, C), np.float32)
    window[: K - 1] = state
    window[K - 1:] = x
    taps = np.ascontiguousarray(w.T)  # [K, C]
    out = np.zeros((L, C), np.float32)
    for t in prange(L):
        o = out[t]
        for j in range(K):
            row, wj = window[t + j], taps[j]
            for c in range(C):
                o[c] += wj[c] * row[c]
        for c in range(C):
            o[c] = _silu(o[c])
    state[:] = window[L:]
    return out


@njit(cache=True, inline="always")
def _unit(x, eps):
    """1 / |x|_2 (with the L2 norm's epsilon)."""
    s = 0.0
    for i in range(x.shape[0]):
        s += x[i] * x[i]
    return np.float32(1.0 / math.sqrt(s + eps))


@njit(cache=True, parallel=True, fastmath=FAST)
def delta_step(state, q, k, v, g, beta):
    """One token: state [Hv, Dk, Dv] updated in place; q, k [Hk, Dk] as projected (normalized
    here), v [Hv, Dv], g [Hv] (log decay, <= 0), beta [Hv] -> o [Hv, Dv]. Two passes over the
    state: S^T k read alone (the decay applied to the sum), then the decayed update and the
    output together (the state is the step's memory traffic: 2 MiB a layer at Qwen3.6's shapes)."""
    Hv, Dk, Dv = state.shape
    group = Hv // q.shape[0]
    out = np.empty((Hv, Dv), np.float32)
    qscale = np.float32(Dk ** -0.5)
    for h in prange(Hv):
        fp = flush_subnormals()  # (cpu/fpenv.py: the decays make subnormals by the million)
        kh = h // group
        qn = _unit(q[kh], L2_EPS) * qscale
        kn = _unit(k[kh], L2_EPS)
        decay = expf(g[h])
        S = state[h]
        mem = np.zeros(Dv, np.float32)
        for i in range(Dk):
            ki = k[kh, i] * kn
            for j in range(Dv):
                mem[j] += S[i, j] * ki
        delta = np.empty(Dv, np.float32)
        for j in range(Dv):
            delta[j] = (v[h, j] - decay * mem[j]) * beta[h]
        o = np.zeros(Dv, np.float32)
        for i in range(Dk):
            ki = k[kh, i] * kn
            qi = q[kh, i] * qn
            for j in range(Dv):
                x = S[i, j] * decay + ki * delta[j]
                S[i, j] = x
                o[j] += x * qi
        out[h] = o
        restore_fp(fp)
    return out


@njit(cache=True, parallel=True, fastmath=FAST)
def delta_chunked(state, q, k, v, g, beta):
    """L tokens, CHUNK at a time: state [Hv, Dk, Dv] in place; q, k [L, Hk, Dk], v [L, Hv, Dv],
    g, beta [L, Hv] -> o [L, Hv, Dv]. Per chunk of n tokens and head, with cumulative log
    decay c (c_i = g_0 + ... + g_i within the chunk):

        T = I + strictly_lower(beta_i k_i.k_j e^(c_i - c_j))      (the UT system)
        U = T^-1 (beta v),   W = T^-1 (beta e^c k)                 (forward substitution)
        V' = U - W S                                                (the delta corrections)
        o  = e^c q S + lower(q_i.k_j e^(c_i - c_j)) V'
        S <- e^(c_last) S + (e^(c_last - c) k)^T V'

    Every inner loop runs along a contiguous row (the dot products too, against transposed
    keys), so LLVM vectorizes them."""
    L, Hk, Dk = k.shape
    Hv, Dv = v.shape[1], v.shape[2]
    group = Hv // Hk
    out = np.zeros((L, Hv, Dv), np.float32)
    qscale = np.float32(Dk ** -0.5)
    for h in prange(Hv):
        fp = flush_subnormals()  # (cpu/fpenv.py: the decays make subnormals by the million)
        kh = h // group
        S = state[h]
        Q = np.empty((CHUNK, Dk), np.float32)
        Kn = np.empty((CHUNK, Dk), np.float32)
        KT = np.empty((Dk, CHUNK), np.float32)
        c = np.empty(CHUNK, np.float32)
        b = np.empty(CHUNK, np.float32)
        U = np.empty((CHUNK, Dv), np.float32)
        W = np.empty((CHUNK, Dk), np.float32)
        A = np.empty((CHUNK, CHUNK), np.float32)   # q_i.k_m e^(c_i - c_m), m <= i
        T = np.empty((CHUNK, CHUNK), np.float32)   # beta_i k_i.k_m e^(c_i - c_m), m < i
        for t0 in range(0, L, CHUNK):
            n = min(CHUNK, L - t0)
            acc = np.float32(0.0)
            for i in range(n):
                t = t0 + i
                qs = _unit(q[t, kh], L2_EPS) * qscale
                ks = _unit(k[t, kh], L2_EPS)
                for d in range(Dk):
                    Q[i, d] = q[t, kh, d] * qs
                    Kn[i, d] = k[t, kh, d] * ks
                    KT[d, i] = Kn[i, d]
                acc += g[t, h]
                c[i] = acc
                b[i] = beta[t, h]
            for i in range(n):
                A[i, :n] = 0.0
                T[i, :n] = 0.0
                for d in range(Dk):
                    qd, kd = Q[i, d], Kn[i, d]
                    for m in range(n):
                        A[i, m] += qd * KT[d, m]
                        T[i, m] += kd * KT[d, m]
                for m in range(n):
                    e = expf(c[i] - c[m]) if m <= i else np.float32(0.0)
                    A[i, m] *= e
                    T[i, m] *= b[i] * e
            # U = T^-1 (beta v) and W = T^-1 (beta e^c k), row by row (forward substitution).
            for i in range(n):
                ec = expf(c[i])
                for j in range(Dv):
                    U[i, j] = v[t0 + i, h, j] * b[i]
                for d in range(Dk):
                    W[i, d] = Kn[i, d] * b[i] * ec
                for m in range(i):
                    tim = T[i, m]
                    for j in range(Dv):
                        U[i, j] -= tim * U[m, j]
                    for d in range(Dk):
                        W[i, d] -= tim * W[m, d]
            # V' = U - W S (in U); o = e^c Q S + A V'
            for i in range(n):
                ec = expf(c[i])
                oi = out[t0 + i, h]
                for d in range(Dk):
                    w_d = W[i, d]
                    q_d = Q[i, d] * ec
                    for j in range(Dv):
                        s_dj = S[d, j]
                        U[i, j] -= w_d * s_dj
                        oi[j] += q_d * s_dj
            for i in range(n):
                oi = out[t0 + i, h]
                for m in range(i + 1):
                    a = A[i, m]
                    for j in range(Dv):
                        oi[j] += a * U[m, j]
            # S <- e^(c_last) S + (e^(c_last - c) k)^T V'
            last = c[n - 1]
            el = expf(last)
            for i in range(n):
                b[i] = expf(last - c[i])  # (beta is no longer needed: reuse its row for the key decay)
            for d in range(Dk):
                for j in range(Dv):
                    S[d, j] *= el
                for i in range(n):
                    kd = Kn[i, d] * b[i]
                    for j in range(Dv):
                        S[d, j] += kd * U[i, j]
        restore_fp(fp)
    return out


@njit(cache=True)
def gated_rms_norm(x, gate, w, eps):
    """x, gate [N, Dv] -> w * x / rms(x) * silu(gate) (Qwen3-Next's RMSNormGated: norm first,
    then the gate)."""
    N, D = x.shape
    out = np.empty((N, D), np.float32)
    for r in range(N):
        s = 0.0
        for i in range(D):
            s += x[r, i] * x[r, i]
        inv = np.float32(1.0 / math.sqrt(s / D + eps))
        for i in range(D):
            out[r, i] = w[i] * (x[r, i] * inv) * _silu(gate[r, i])
    return out


# ----------------------------------------------------------------------------- Kimi Delta Attention
# KDA (Kimi Linear): the gated delta rule with a decay per key channel instead of one per head,
# after transformers' recurrent_kimi_delta_attention / chunk_kimi_delta_attention
# (models/kimi_linear/modeling_kimi_linear.py). Per head, with g [Dk] the token's log decays:
#
#     S <- diag(exp(g)) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q
#
# q, k and v have the same heads (H). Shape letters as above, H heads, Dk = Dv = the head dim
# in Kimi Linear (the kernels take any Dv).


@njit(cache=True, parallel=True, fastmath=FAST)
def kda_step(state, q, k, v, g, beta):
    """One token: state [H, Dk, Dv] updated in place; q, k [H, Dk] as projected (normalized
    here), v [H, Dv], g [H, Dk] (log decay per key channel, <= 0), beta [H] -> o [H, Dv]. Two
    passes over the state, as delta_step: S^T (e^g k) read alone, then the decayed update and
    the output together."""
    H, Dk, Dv = state.shape
    out = np.empty((H, Dv), np.float32)
    qscale = np.float32(Dk ** -0.5)
    for h in prange(H):
        fp = flush_subnormals()  # (cpu/fpenv.py: the decays make subnormals by the million)
        qn = _unit(q[h], L2_EPS) * qscale
        kn = _unit(k[h], L2_EPS)
        S = state[h]
        decay = np.empty(Dk, np.float32)
        mem = np.zeros(Dv, np.float32)
        for i in range(Dk):
            decay[i] = expf(g[h, i])
            ki = k[h, i] * kn * decay[i]
            for j in range(Dv):
                mem[j] += S[i, j] * ki
        delta = np.empty(Dv, np.float32)
        for j in range(Dv):
            delta[j] = (v[h, j] - mem[j]) * beta[h]
        o = np.zeros(Dv, np.float32)
        for i in range(Dk):
            ki = k[h, i] * kn
            qi = q[h, i] * qn
            di = decay[i]
            for j in range(Dv):
                x = S[i, j] * di + ki * delta[j]
                S[i, j] = x
                o[j] += x * qi
        out[h] = o
        restore_fp(fp)
    return out


@njit(cache=True, parallel=True, fastmath=FAST)
def kda_chunked(state, q, k, v, g, beta):
    """L tokens, CHUNK at a time: state [H, Dk, Dv] in place; q, k [L, H, Dk], v [L, H, Dv],
    g [L, H, Dk], beta [L, H] -> o [L, H, Dv]. delta_chunked's UT form with the cumulative log
    decay c [n, Dk] a vector per token (c_i = g_0 + ... + g_i within the chunk, per channel):

        T = I + strictly_lower(beta_i sum_d k_id k_md e^(c_id - c_md))
        U = T^-1 (beta v),   W = T^-1 (beta e^c * k)
        V' = U - W S
        o  = (e^c * q) S + lower(sum_d q_id k_md e^(c_id - c_md)) V'
        S <- diag(e^(c_last)) S + (e^(c_last - c) * k)^T V'

    With a scalar decay the pair factor e^(c_i - c_m) leaves the dot product; per channel it
    cannot, so each pair's factors are computed inside the dot product, from the difference
    c_id - c_md (<= 0 for m <= i), never as e^c_i * e^-c_m: e^-c overflows float32 within a
    chunk once the decays are strong (a channel decaying by e^-2 per token passes e^88 in 44
    tokens), while every exponent here is <= 0, so every factor is in [0, 1] and the form is
    as sound in float32 as the token loop. The price is n(n+1)/2 Dk exponentials per chunk and
    head (expf is straight-line code, so these loops vectorize), beside the ~3 n Dk Dv
    multiply-adds of the chunk's state products."""
    L, H, Dk = k.shape
    Dv = v.shape[2]
    out = np.zeros((L, H, Dv), np.float32)
    qscale = np.float32(Dk ** -0.5)
    for h in prange(H):
        fp = flush_subnormals()  # (cpu/fpenv.py: the decays make subnormals by the million)
        S = state[h]
        Q = np.empty((CHUNK, Dk), np.float32)
        Kn = np.empty((CHUNK, Dk), np.float32)
        C = np.empty((CHUNK, Dk), np.float32)     # cumulative log decay per channel
        b = np.empty(CHUNK, np.float32)
        U = np.empty((CHUNK, Dv), np.float32)
        W = np.empty((CHUNK, Dk), np.float32)
        A = np.empty((CHUNK, CHUNK), np.float32)  # sum_d q_id k_md e^(c_id - c_md), m <= i
        T = np.empty((CHUNK, CHUNK), np.float32)  # beta_i sum_d k_id k_md e^(c_id - c_md), m < i
        for t0 in range(0, L, CHUNK):
            n = min(CHUNK, L - t0)
            for i in range(n):
                t = t0 + i
                qs = _unit(q[t, h], L2_EPS) * qscale
                ks = _unit(k[t, h], L2_EPS)
                for d in range(Dk):
                    Q[i, d] = q[t, h, d] * qs
                    Kn[i, d] = k[t, h, d] * ks
                    C[i, d] = (C[i - 1, d] if i > 0 else np.float32(0.0)) + g[t, h, d]
                b[i] = beta[t, h]
            for i in range(n):
                for m in range(i + 1):
                    a = np.float32(0.0)
                    s = np.float32(0.0)
                    for d in range(Dk):
                        kd = Kn[m, d] * expf(C[i, d] - C[m, d])
                        a += Q[i, d] * kd
                        s += Kn[i, d] * kd
                    A[i, m] = a
                    T[i, m] = b[i] * s
            # U = T^-1 (beta v) and W = T^-1 (beta e^c k), row by row (forward substitution).
            for i in range(n):
                for j in range(Dv):
                    U[i, j] = v[t0 + i, h, j] * b[i]
                for d in range(Dk):
                    W[i, d] = Kn[i, d] * b[i] * expf(C[i, d])
                for m in range(i):
                    tim = T[i, m]
                    for j in range(Dv):
                        U[i, j] -= tim * U[m, j]
                    for d in range(Dk):
                        W[i, d] -= tim * W[m, d]
            # V' = U - W S (in U); o = (e^c Q) S + A V'
            for i in range(n):
                oi = out[t0 + i, h]
                for d in range(Dk):
                    w_d = W[i, d]
                    q_d = Q[i, d] * expf(C[i, d])
                    for j in range(Dv):
                        s_dj = S[d, j]
                        U[i, j] -= w_d * s_dj
                        oi[j] += q_d * s_dj
            for i in range(n):
                oi = out[t0 + i, h]
                for m in range(i + 1):
                    a = A[i, m]
                    for j in range(Dv):
                        oi[j] += a * U[m, j]
            # S <- diag(e^(c_last)) S + (e^(c_last - c) k)^T V'
            last = n - 1
            for d in range(Dk):
                el = expf(C[last, d])
                for j in range(Dv):
                    S[d, j] *= el
                for i in range(n):
                    kd = Kn[i, d] * expf(C[last, d] - C[i, d])
                    for j in range(Dv):
                        S[d, j] += kd * U[i, j]
        restore_fp(fp)
    return out


@njit(cache=True)
def sigmoid_gated_rms_norm(x, gate, w, eps):
    """x, gate [N, Dv] -> w * x / rms(x) * sigmoid(gate) (Kimi Linear's RMSNormGated: norm
    first, then the sigmoid gate)."""
    N, D = x.shape
    out = np.empty((N, D), np.float32)
    one = np.float32(1.0)
    for r in range(N):
        s = 0.0
        for i in range(D):
            s += x[r, i] * x[r, i]
        inv = np.float32(1.0 / math.sqrt(s / D + eps))
        for i in range(D):
            out[r, i] = w[i] * (x[r, i] * inv) * (one / (one + expf(-gate[r, i])))
    return out
