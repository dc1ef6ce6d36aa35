"""Whole decode-step blocks in one compiled call each, for the common llama-shaped layer.

A small model's decode step is ~30 layers x ~15 Python-level operations (norm, matvec
wrapper, slicing, RoPE, cache write, attention, residual add...), each a few microseconds of
interpreter and dispatch overhead: about 1 ms of SmolLM2's ~4.5 ms per token. These functions
run the same kernels in the same order from inside numba (the parallel matvec and attention
kernels keep their own thread pool when called from here). colibri.models.common's
step-by-step path stays the reference and the fallback for every layer these do not cover
(MLA, unfused q/k/v or gate/up, non-int4 weights, prefill); the two agree within float32
rounding, not bit for bit: the kernels' small reductions reassociate, and LLVM picks the order
per compiled specialization (tests/models/harness.py checks every family).

A weight is passed as the tuple colibri.kernels.cpu.int4_weight(t) returns:
(q, scales, offs, coef, half, cshift). Every block takes `act`, colibri.kernels.idot.marker() of
the model's activation mode: its type picks the exact or the int8-activation row code.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.typed import List

from . import ops
from .idot import matmul_rows_into, matvec_into


@njit(cache=True)
def _mv(w, x, nthreads, act):
    y = np.empty(w[0].shape[0], np.float32)
    matvec_into(w, x, y, nthreads, act)
    return y


@njit(cache=True)
def _mv_rows(w, x, nthreads, act):
    """_mv of each row of x [B, n], the same bits, the weights read once for all rows."""
    y = np.empty((x.shape[0], w[0].shape[0]), np.float32)
    matmul_rows_into(w, x, y, nthreads, act)
    return y


# qk_norm codes for attention_block: what colibri.models.common.Attention calls None, "head"
# (Qwen3: RMSNorm over each head's Dh) and "full" (OLMoE: over all heads' H * Dh).
QK_NORM_CODES = {None: 0, "head": 1, "full": 2}


@njit(cache=True)
def _clip(a, c):
    for i in range(a.shape[0]):
        a[i] = min(max(a[i], -c), c)


@njit(cache=True)
def attention_block(x, norm_w, eps, qkv, qkv_bias, o, o_bias, cos, sin, rot,
                    kc, vc, pos, n_heads, n_kv, head_dim, scale, nthreads,
                    qk_norm, q_norm, k_norm, norm_eps, clip, act):
    """x [1, D] -> x + o_proj(attention(rope(qkv(rms_norm(x))))), writing this position's
    K and V into kc/vc [KV, cap, Dh] at `pos`. Biases are empty arrays when absent.
    qk_norm: QK_NORM_CODES value, with q_norm/k_norm weights (unused for 0); clip: q, k and v
    are clipped to [-clip, clip] after a full norm (np.inf: no clipping), as in
    Attention.__call__."""
    h = ops.rms_norm(x, norm_w, eps)
    qkv_out = _mv(qkv, h[0], nthreads, act)
    if qkv_bias.shape[0]:
        qkv_out += qkv_bias
    q = np.empty((1, n_heads, head_dim), np.float32)
    _prepare_row(qkv_out, cos, sin, rot, kc, vc, pos, n_heads, n_kv, head_dim, qk_norm, q_norm, k_norm,
                 norm_eps, clip, q[0])
    kcs, vcs = List(), List()  # one token's attention is attention_rows' with one row: both round alike
    kcs.append(kc)
    vcs.append(vc)
    ends = np.empty(1, np.int64)
    ends[0] = pos + 1
    att = ops.attend_rows(q, kcs, vcs, ends, scale)
    out = _mv(o, att[0], nthreads, act)
    if o_bias.shape[0]:
        out += o_bias
    return x + out.reshape((1, -1))


@njit(cache=True)
def _prepare_row(qkv_out, cos, sin, rot, kc, vc, pos, n_heads, n_kv, head_dim, qk_norm, q_norm, k_norm,
                 norm_eps, clip, q_out):
    """One token's fused q/k/v projection [(H + 2 KV) Dh] (bias added) -> q/k norms, clipping,
    RoPE (cos/sin [1, rot]); K and V written to the cache at `pos`, q into q_out [H, Dh]."""
    nq, nk = n_heads * head_dim, n_kv * head_dim
    q = qkv_out[:nq].copy().reshape((1, nq))
    k = qkv_out[nq:nq + nk].copy().reshape((1, nk))
    v = qkv_out[nq + nk:].copy()
    if qk_norm == 2:
        q = ops.rms_norm(q, q_norm, norm_eps)
        k = ops.rms_norm(k, k_norm, norm_eps)
    if clip < np.inf:
        _clip(q[0], clip)
        _clip(k[0], clip)
        _clip(v, clip)
    if qk_norm == 1:
        q = ops.rms_norm(q.reshape((n_heads, head_dim)), q_norm, norm_eps)
        k = ops.rms_norm(k.reshape((n_kv, head_dim)), k_norm, norm_eps)
    q3 = q.reshape((1, n_heads, head_dim))
    k3 = k.reshape((1, n_kv, head_dim))
    ops.rope(q3, cos, sin, rot)
    ops.rope(k3, cos, sin, rot)
    # Element loops, not slice assignment: numba compiles a slice store with its shape-mismatch
    # error path, ~5 s of the first start's compile for the same stores.
    for g in range(n_kv):
        for d in range(head_dim):
            ops.kv_put(kc, g, pos, d, k3[0, g, d])
            ops.kv_put(vc, g, pos, d, v[g * head_dim + d])
    for hh in range(n_heads):
        for d in range(head_dim):
            q_out[hh, d] = q3[0, hh, d]


# Several tokens at once (DecoderModel.forward_rows: a batch of sequences, or drafted tokens):
# attention_rows runs the projections of all rows through the multi-row kernels, prepares each
# row on its own cache, and attends all rows in one parallel region. Each row's result is
# attention_block's, bit for bit (tests/models/harness.py).


@njit(cache=True)
def attention_rows(x, norm_w, eps, qkv, qkv_bias, o, o_bias, cos, sin, rot, kcs, vcs, pos,
                   n_heads, n_kv, head_dim, scale, nthreads, qk_norm, q_norm, k_norm, norm_eps, clip, act):
    """attention_block for each row of x [B, D]: row r at position pos[r] of the cache kcs[r] /
    vcs[r] (numba typed lists of [KV, cap, Dh] arrays), with cos/sin [B, rot]. Rows sharing a
    cache are consecutive positions in row order; every row's K and V are written before any
    row attends, and row r attends to its first pos[r] + 1 keys only."""
    qkv_out = qkv_rows(x, norm_w, eps, qkv, qkv_bias, nthreads, act)
    B = x.shape[0]
    q = np.empty((B, n_heads, head_dim), np.float32)
    for r in range(B):
        _prepare_row(qkv_out[r], cos[r:r + 1], sin[r:r + 1], rot, kcs[r], vcs[r], pos[r], n_heads, n_kv,
                     head_dim, qk_norm, q_norm, k_norm, norm_eps, clip, q[r])
    att = ops.attend_rows(q, kcs, vcs, pos + 1, scale)
    return out_rows(x, att, o, o_bias, nthreads, act)


@njit(cache=True)
def qkv_rows(x, norm_w, eps, qkv, qkv_bias, nthreads, act):
    """x [B, D] -> each row's fused q/k/v projection of rms_norm(x), bias added: [B, (H + 2 KV) Dh]."""
    y = _mv_rows(qkv, ops.rms_norm(x, norm_w, eps), nthreads, act)
    if qkv_bias.shape[0]:
        for a in range(y.shape[0]):
            y[a] += qkv_bias
    return y


@njit(cache=True)
def out_rows(x, att, o, o_bias, nthreads, act):
    """x [B, D] + o_proj(att [B, H * Dh]) (+ bias), row by row."""
    out = _mv_rows(o, att, nthreads, act)
    if o_bias.shape[0]:
        for a in range(out.shape[0]):
            out[a] += o_bias
    return x + out


@njit(cache=True)
def mlp_rows(x, norm_w, eps, gate_up, n_inter, down, nthreads, act):
    """mlp_block of each row of x [B, D], the same bits, the weights read once for all rows."""
    h = ops.rms_norm(x, norm_w, eps)
    gu = _mv_rows(gate_up, h, nthreads, act)
    a = ops.silu_mul(gu, n_inter)
    return x + _mv_rows(down, a, nthreads, act)


@njit(cache=True)
def mlp_block(x, norm_w, eps, gate_up, n_inter, down, nthreads, act):
    """x [1, D] -> x + down(silu(gate(h)) * up(h)), h = rms_norm(x); gate_up is the fused
    [gate; up] weight."""
    h = ops.rms_norm(x, norm_w, eps)
    gu = _mv(gate_up, h[0], nthreads, act)
    a = ops.silu_mul(gu.reshape((1, -1)), n_inter)
    return x + _mv(down, a[0], nthreads, act).reshape((1, -1))


@njit(cache=True)
def swiglu(x, gate, up, down, nthreads, act):
    """x [D] -> down(silu(gate(x)) * up(x)): one routed expert (or unfused MLP) for one token."""
    g = _mv(gate, x, nthreads, act)
    a = np.empty_like(g)
    ops._silu_gate(g, _mv(up, x, nthreads, act), a)
    return _mv(down, a, nthreads, act)
