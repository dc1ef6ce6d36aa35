"""Whole decode-step blocks in one compiled call each, for the common llama-shaped layer.

A small model's decode step is ~30 layers x ~15 Python-level operations (norm, matvec
wrapper, slicing, RoPE, cache write, attention, residual add...), each a few microseconds of
interpreter and dispatch overhead: about 1 ms of SmolLM2's ~4.5 ms per token. These functions
run the same kernels in the same order from inside numba (the parallel matvec and attention
kernels keep their own thread pool when called from here). colibri.models' (layers.py, attention.py, decoder.py)
step-by-step path stays the reference and the fallback for every layer these do not cover
(MLA, unfused q/k/v or gate/up, non-int4 weights, prefill); the two agree within float32
rounding, not bit for bit: the kernels' small reductions reassociate, and LLVM picks the order
per compiled specialization (tests/models/harness.py checks every family).

A weight is passed as the tuple colibri.kernels.cpu.int4_weight(t) returns:
(q, scales, offs, coef, half, cshift, ilv). Every block takes `act`, colibri.kernels.idot.marker() of
the model's activation mode: its type picks the exact or the int8-activation row code.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.typed import List

from . import ops
from .idot import matmul_rows_into, matvec_into, prepare, rows8_into, tail_rows_into
from .team import claim, counters_size, finish, run_team, unmanaged


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


# qk_norm codes for attention_block: what colibri.models.attention.Attention calls None, "head"
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
    ops.silu_gate_into(g, _mv(up, x, nthreads, act), a)
    return _mv(down, a, nthreads, act)


# A whole token's layers in one call (DecoderModel.forward, one token, every layer covered by
# the two blocks above): the team of colibri.kernels.team runs attention_block and mlp_block's
# operations in their order, each row and attention chunk by the same kernels, so the result
# is theirs, bit for bit (tests/kernels/test_token_layers.py).

ROWS_PIECE = 4  # blocks of eight rows per piece a thread takes: 32 rows


@njit(cache=True)
def _rows_phase(w, x, xp, y, ctr, phase, nthreads, t, act, d, state):
    """y = W @ x (xp = idot.prepare(x)), the team's rows: pieces of ROWS_PIECE blocks of eight,
    then the rows past the last block as one piece."""
    q, scales, offs, coef, half, cshift, ilv = w
    out = q.shape[0]
    nblk = out // 8
    nfull = (nblk + ROWS_PIECE - 1) // ROWS_PIECE
    n = nfull + (1 if out % 8 else 0)
    state[0] = 0
    state[1] = 0
    while True:
        k = claim(ctr, phase, n, nthreads, t, state)
        if k < 0:
            break
        if k < nfull:
            for blk in range(k * ROWS_PIECE, min(nblk, (k + 1) * ROWS_PIECE)):
                r = 8 * blk
                rows8_into(q, scales, offs, coef, half, cshift, ilv, x, xp, r, d, act)
                for j in range(8):
                    y[r + j] = d[j]
        else:
            tail_rows_into(q, scales, offs, coef, half, x, xp, y, act)
    finish(ctr, phase, n, nthreads, state)


@njit(cache=True)
def _attention_phase(q, kc, vc, n_keys, scale, ms, ls, accs, scratch, ctr, phase, nthreads, t, state):
    """ops.attend_rows' (KV head, chunk) items of one query, shared out to the team."""
    KV, nc = ms.shape[0], ms.shape[1]
    C = ops.ATTEND_CHUNK
    state[0] = 0
    state[1] = 0
    while True:
        k = claim(ctr, phase, KV * nc, nthreads, t, state)
        if k < 0:
            break
        kv = k // nc
        c = k - kv * nc
        a = accs[kv, c]
        for g in range(a.shape[0]):
            for e in range(a.shape[1]):
                a[g, e] = 0.0
        ops._attend_chunk(q, kc, vc, kv, c * C, min(n_keys - c * C, C), scale, scratch, ms[kv, c], ls[kv, c], a)
    finish(ctr, phase, KV * nc, nthreads, state)


@njit(cache=True)
def _unmanaged_weight(w):
    return unmanaged(w[0]), unmanaged(w[1]), unmanaged(w[2]), w[3], w[4], w[5], w[6]


@njit(cache=True)
def _unmanaged_layer(layer):
    in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down, q_norm, k_norm = layer
    return (unmanaged(in_norm), _unmanaged_weight(qkv), unmanaged(qkv_bias), _unmanaged_weight(o),
            unmanaged(o_bias), unmanaged(post_norm), _unmanaged_weight(gate_up), _unmanaged_weight(down),
            unmanaged(q_norm), unmanaged(k_norm))


@njit(cache=True)
def unmanaged_layer_list(layer):
    """A typed list holding one layer's token_layers arguments with every array
    team.unmanaged; add_unmanaged_layer appends the others. Built once per model (which keeps
    the arrays), so the team's threads read the shared weights without counting references.
    Filled here, one layer per call, not from Python (a typed list filled from Python compiles
    its methods for the item type, uncached: ~1.3 s of every start) nor from a tuple of all
    layers (compiling for a 30-layer tuple took 40 s)."""
    out = List()
    out.append(_unmanaged_layer(layer))
    return out


@njit(cache=True)
def add_unmanaged_layer(layers, layer):
    layers.append(_unmanaged_layer(layer))


@njit(cache=True)
def array_list(a):
    """A typed list holding `a`; add_array appends (the several-rows blocks' K/V lists). Filled
    in compiled code: a typed list filled from Python compiles its methods for the item type at
    every start, uncached (~1 s at a cached server's first batch)."""
    out = List()
    out.append(a)
    return out


@njit(cache=True)
def add_array(arrays, a):
    arrays.append(a)


@njit(cache=True)
def unmanaged_arrays(arrays):
    """A typed list of a tuple's arrays, each team.unmanaged (a KV cache's, kept by the cache)."""
    out = List()
    for a in arrays:
        out.append(unmanaged(a))
    return out


@njit(cache=True)
def _token_buffers(layers, n_kv, nc, G, Dv, D, n_gu, nthreads):
    """The phases' shared outputs, one per layer (never reused within the token: team.py)."""
    L, nqkv = len(layers), layers[0][1][0].shape[0]
    return (np.zeros(counters_size(5 * L, nthreads), np.int64), np.empty((L, nqkv), np.float32),
            np.empty((L, n_kv, nc, G), np.float32), np.empty((L, n_kv, nc, G), np.float32),
            np.empty((L, n_kv, nc, G, Dv), np.float32), np.empty((L, D), np.float32),
            np.empty((L, n_gu), np.float32), np.empty((L, D), np.float32), np.empty((1, D), np.float32))


def token_layers(x0, layers, kcs, vcs, pos, cos, sin, rot, n_heads, n_kv, head_dim, scale, eps,
                 qk_norm, norm_eps, clip, n_inter, nthreads, act):
    """One token x0 [1, D] at position `pos` through every layer: attention_block then
    mlp_block per layer, with the same arguments, returned as x [1, D]. layers: a typed list
    of (input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down, q_norm, k_norm) per
    layer (weights as cpu.int4_weight tuples) and kcs / vcs: typed lists of each layer's cache
    arrays (this position's K and V written to them), all with unmanaged arrays
    (unmanaged_layer_list, unmanaged_arrays: the threads share them). Run by team.run_team:
    the calling thread and nthreads - 1 helpers (plain threads, not a numba parallel region:
    compiling one around this took 22 s more at the first start)."""
    nc = (pos + 1 + ops.ATTEND_CHUNK - 1) // ops.ATTEND_CHUNK
    # (The typed list is read in compiled code only: its methods called from Python compile
    # for the item type, uncached, at every start.)
    buffers = _token_buffers(layers, n_kv, nc, n_heads // n_kv, head_dim, x0.shape[1], 2 * n_inter, nthreads)
    run_team(_token_thread, nthreads, x0, layers, kcs, vcs, pos, cos, sin, rot, n_heads, n_kv, head_dim, scale,
             eps, qk_norm, norm_eps, clip, n_inter, nthreads, act, buffers)
    return buffers[-1]


@njit(cache=True, nogil=True)
def _token_thread(t, x0, layers, kcs, vcs, pos, cos, sin, rot, n_heads, n_kv, head_dim, scale, eps, qk_norm,
                  norm_eps, clip, n_inter, nthreads, act, buffers):
    """Thread t's part of token_layers: the glue on its own buffers, the phases shared."""
    ctr, qkv_out, ms, ls, accs, o_out, gu, dn, result = buffers
    # The shared buffers and inputs without reference counts (team.unmanaged): the call holds them.
    ctr, qkv_out, ms, ls, accs = unmanaged(ctr), unmanaged(qkv_out), unmanaged(ms), unmanaged(ls), unmanaged(accs)
    o_out, gu, dn, cos, sin = unmanaged(o_out), unmanaged(gu), unmanaged(dn), unmanaged(cos), unmanaged(sin)
    nc = ms.shape[2]
    d = np.empty(8, np.float32)
    state = np.zeros(2, np.int64)
    scratch = np.empty((n_heads // n_kv, ops.ATTEND_CHUNK), np.float32)
    x = x0.copy()
    for i in range(len(layers)):
        in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down, q_norm, k_norm = layers[i]
        # attention_block
        h = ops.rms_norm(x, in_norm, eps)
        _rows_phase(qkv, h[0], prepare(h[0], qkv[4], act), qkv_out[i], ctr, 5 * i, nthreads, t, act, d, state)
        row = qkv_out[i].copy()
        if qkv_bias.shape[0]:
            row += qkv_bias
        q = np.empty((1, n_heads, head_dim), np.float32)
        # Every thread writes this position's K and V (the same bits) before it attends.
        _prepare_row(row, cos, sin, rot, kcs[i], vcs[i], pos, n_heads, n_kv, head_dim, qk_norm, q_norm, k_norm,
                     norm_eps, clip, q[0])
        _attention_phase(q[0], kcs[i], vcs[i], pos + 1, scale, ms[i], ls[i], accs[i], scratch, ctr, 5 * i + 1,
                         nthreads, t, state)
        att = np.empty((1, n_heads * head_dim), np.float32)
        ops._merge_chunks(ms[i], ls[i], accs[i], nc, att[0])
        _rows_phase(o, att[0], prepare(att[0], o[4], act), o_out[i], ctr, 5 * i + 2, nthreads, t, act, d, state)
        out = o_out[i].copy()
        if o_bias.shape[0]:
            out += o_bias
        x = x + out.reshape((1, -1))
        # mlp_block
        h = ops.rms_norm(x, post_norm, eps)
        _rows_phase(gate_up, h[0], prepare(h[0], gate_up[4], act), gu[i], ctr, 5 * i + 3, nthreads, t, act, d, state)
        a = ops.silu_mul(gu[i].reshape((1, -1)), n_inter)
        _rows_phase(down, a[0], prepare(a[0], down[4], act), dn[i], ctr, 5 * i + 4, nthreads, t, act, d, state)
        x = x + dn[i].reshape((1, -1))
    if t == 0:  # (an element loop: a slice store compiles numba's shape-mismatch error path, ~1 s)
        for j in range(x.shape[1]):
            result[0, j] = x[0, j]


# A first start (colibri.warmup) compiles token_layers' kernels in a process of its own, ~20 s
# on 2 cores, while its first answer decodes through token_steps: the same phases for a team of
# one thread, called one by one from Python with the same kernels (a piece's result does not
# depend on the thread that computes it), so the same bits (tests/models/test_token_layers.py).
# Its kernels are token_layers' own (compiled for it anyway) and the prefill's (rms_norm_into,
# silu_mul_into): ~8 s of compiling instead of ~20.


@njit(cache=True, nogil=True)
def rows_phase(w, x, y, ctr, phase, nthreads, t, act, d, state):
    """_rows_phase with x prepared for w here, as token_layers' thread does for each matrix."""
    _rows_phase(w, x, prepare(x, w[4], act), y, ctr, phase, nthreads, t, act, d, state)


def _call(kernel, *args):
    return kernel(*args)


def token_steps(x0, layers, ks, vs, pos, cos, sin, rot, n_heads, n_kv, head_dim, scale, eps, qk_norm,
                norm_eps, clip, n_inter, act, call=_call):
    """token_layers' result, its operations run from Python on this thread: `layers` the same
    per-layer tuples as plain Python tuples (any arrays, not unmanaged ones), ks / vs each
    layer's cache arrays. `call(kernel, *args)` runs each compiled step (colibri.warmup passes
    one that records the kernels and their arguments instead)."""
    L, D = len(layers), x0.shape[1]
    nc = (pos + 1 + ops.ATTEND_CHUNK - 1) // ops.ATTEND_CHUNK
    G = n_heads // n_kv
    ctr = np.zeros(counters_size.py_func(5 * L, 1), np.int64)
    d, state = np.empty(8, np.float32), np.zeros(2, np.int64)
    scratch = np.empty((G, ops.ATTEND_CHUNK), np.float32)
    h = np.empty((1, D), np.float32)
    qkv_out = np.empty(layers[0][1][0].shape[0], np.float32)
    q = np.empty((1, n_heads, head_dim), np.float32)
    ms, ls = np.empty((n_kv, nc, G), np.float32), np.empty((n_kv, nc, G), np.float32)
    accs = np.empty((n_kv, nc, G, head_dim), np.float32)
    att = np.empty((1, n_heads * head_dim), np.float32)
    o_out, dn = np.empty(D, np.float32), np.empty(D, np.float32)
    gu, a = np.empty((1, 2 * n_inter), np.float32), np.empty((1, n_inter), np.float32)
    x = x0.copy()
    for i in range(L):
        in_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, down, q_norm, k_norm = layers[i]
        # attention_block
        call(ops.rms_norm_into, x, in_norm, eps, h)
        call(rows_phase, qkv, h[0], qkv_out, ctr, 5 * i, 1, 0, act, d, state)
        row = qkv_out + qkv_bias if qkv_bias.shape[0] else qkv_out.copy()
        call(_prepare_row, row, cos, sin, rot, ks[i], vs[i], pos, n_heads, n_kv, head_dim, qk_norm, q_norm, k_norm,
             norm_eps, clip, q[0])
        call(_attention_phase, q[0], ks[i], vs[i], pos + 1, scale, ms, ls, accs, scratch, ctr, 5 * i + 1, 1, 0, state)
        call(ops._merge_chunks, ms, ls, accs, nc, att[0])
        call(rows_phase, o, att[0], o_out, ctr, 5 * i + 2, 1, 0, act, d, state)
        x = x + (o_out + o_bias if o_bias.shape[0] else o_out).reshape((1, -1))
        # mlp_block
        call(ops.rms_norm_into, x, post_norm, eps, h)
        call(rows_phase, gate_up, h[0], gu[0], ctr, 5 * i + 3, 1, 0, act, d, state)
        call(ops.silu_mul_into, gu, n_inter, a)
        call(rows_phase, down, a[0], dn, ctr, 5 * i + 4, 1, 0, act, d, state)
        x = x + dn.reshape((1, -1))
    return x


def token_layers_signatures(x0, layers, ks, vs, pos, cos, sin, rot, n_heads, n_kv, head_dim, scale, eps, qk_norm,
                            norm_eps, clip, n_inter, nthreads, act) -> list:
    """[(kernel, numba signature)] of every compiled call token_layers makes for these
    arguments (given as token_steps takes them), the typed lists it reads included, found
    without compiling anything: what a process of its own compiles for it (colibri.warmup)."""
    from numba import typeof, types

    item = typeof(tuple(layers[0]))
    layer_list = types.ListType(item)
    k_list, v_list = types.ListType(typeof(ks[0])), types.ListType(typeof(vs[0]))
    nc = (pos + 1 + ops.ATTEND_CHUNK - 1) // ops.ATTEND_CHUNK
    shape_args = (n_kv, nc, n_heads // n_kv, head_dim, x0.shape[1], 2 * n_inter, nthreads)
    # _token_buffers' result: its arrays' kinds (the sizes do not matter to the type)
    buffers = tuple(np.empty((0,) * n, t) for n, t in ((1, np.int64), (2, np.float32), (4, np.float32),
                                                       (4, np.float32), (5, np.float32), (2, np.float32),
                                                       (2, np.float32), (2, np.float32), (2, np.float32)))

    def sig(*args):
        return tuple(a if isinstance(a, types.Type) else typeof(a) for a in args)

    return [
        (unmanaged_layer_list, sig(item)),
        (add_unmanaged_layer, sig(layer_list, item)),
        (unmanaged_arrays, sig(typeof(tuple(ks)))),
        (unmanaged_arrays, sig(typeof(tuple(vs)))),
        (_token_buffers, sig(layer_list, *shape_args)),
        (_token_thread, sig(0, x0, layer_list, k_list, v_list, pos, cos, sin, rot, n_heads, n_kv, head_dim, scale,
                            eps, qk_norm, norm_eps, clip, n_inter, nthreads, act, buffers)),
    ]
