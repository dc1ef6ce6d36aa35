"""Whole decode-step blocks in one compiled call each, for the common llama-shaped layer.

A small model's decode step is ~30 layers x ~15 Python-level operations (norm, matvec
wrapper, slicing, RoPE, cache write, attention, residual add...), each a few microseconds of
interpreter and dispatch overhead: about 1 ms of SmolLM2's ~4.5 ms per token. These functions
run the same kernels in the same order from inside numba (the parallel matvec and attention
kernels keep their own thread pool when called from here), so the results are bit-identical
to the unfused path in colibri.models.common, which remains the reference and the fallback for
every layer these do not cover (q/k norms, clipping, MLA, non-int4 weights, prefill).

A weight is passed as the tuple `int4_weight(t)` returns: (q, scales, offs, coef, half, cshift).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import ops
from .cpu import _chunk_shift, _matvec_int4
from .quant import GROUP_SIZE, INT4_SCHEMES, QTensor


def int4_weight(t: QTensor) -> tuple | None:
    """The arguments of the int4 matvec kernel for t, or None when t is not an int4 scheme."""
    if t.scheme not in INT4_SCHEMES:
        return None
    from .cpu import _check_tensor

    _check_tensor(t)
    half = GROUP_SIZE[t.scheme] // 2
    offs, coef = (t.mins, 1.0) if t.scheme == "q4_1" else (t.scales, -8.0)
    return t.q, t.scales, offs, np.float32(coef), half, _chunk_shift(half)


@njit(cache=True)
def _mv(w, x, nthreads):
    q, scales, offs, coef, half, cshift = w
    y = np.empty(q.shape[0], np.float32)
    _matvec_int4(q, scales, offs, coef, half, cshift, x, y, nthreads)
    return y


@njit(cache=True)
def attention_block(x, norm_w, eps, qkv, qkv_bias, o, o_bias, cos, sin, rot,
                    kc, vc, pos, n_heads, n_kv, head_dim, scale, nthreads):
    """x [1, D] -> x + o_proj(attention(rope(qkv(rms_norm(x))))), writing this position's
    K and V into kc/vc [KV, cap, Dh] at `pos`. Biases are empty arrays when absent."""
    h = ops.rms_norm(x, norm_w, eps)
    qkv_out = _mv(qkv, h[0], nthreads)
    if qkv_bias.shape[0]:
        qkv_out += qkv_bias
    nq, nk = n_heads * head_dim, n_kv * head_dim
    q = qkv_out[:nq].copy().reshape((1, n_heads, head_dim))
    k = qkv_out[nq:nq + nk].copy().reshape((1, n_kv, head_dim))
    v = qkv_out[nq + nk:].reshape((n_kv, head_dim))
    ops.rope(q, cos, sin, rot)
    ops.rope(k, cos, sin, rot)
    kc[:, pos, :] = k[0]
    vc[:, pos, :] = v
    att = ops.attend_one(q[0], kc, vc, pos + 1, scale)
    out = _mv(o, att, nthreads)
    if o_bias.shape[0]:
        out += o_bias
    return x + out.reshape((1, -1))


@njit(cache=True)
def mlp_block(x, norm_w, eps, gate_up, n_inter, down, nthreads):
    """x [1, D] -> x + down(silu(gate(h)) * up(h)), h = rms_norm(x); gate_up is the fused
    [gate; up] weight."""
    h = ops.rms_norm(x, norm_w, eps)
    gu = _mv(gate_up, h[0], nthreads)
    act = ops.silu_mul(gu.reshape((1, -1)), n_inter)
    return x + _mv(down, act[0], nthreads).reshape((1, -1))


@njit(cache=True)
def swiglu(x, gate, up, down, nthreads):
    """x [D] -> down(silu(gate(x)) * up(x)): one routed expert (or unfused MLP) for one token."""
    g = _mv(gate, x, nthreads)
    act = np.empty_like(g)
    ops._silu_gate(g, _mv(up, x, nthreads), act)
    return _mv(down, act, nthreads)
