"""Small fused numba kernels for the decode step's glue: RMSNorm, RoPE, one-query attention
over the KV cache, SiLU-gated product. Each replaces 5-15 numpy calls whose per-call overhead
(~1-3 us each, x 30 layers) was a large share of a small model's decode step. Sums accumulate
in float64, so results stay within float32 rounding of the numpy references in
tests/kernels/test_ops.py (which follow transformers' formulas)."""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic


@intrinsic
def _pow2i(typingctx, n):
    """int32 n in [-127, 127] -> float32 2**n through the exponent bits (n = -127 gives 0)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True, inline="always", fastmath={"contract"})
def expf(x):
    """float32 exp within 1 ulp of the exact value on [-87, 88] (inputs are clamped there).

    numba's math.exp is a libm call per element, so loops around it stay scalar (the softmax
    of decode attention and SiLU spent most of their time there); this is straight-line
    arithmetic that LLVM vectorizes. Cephes' expf: x = n ln2 + r with ln2 split in two
    for an exact reduction, a degree-7 polynomial for e^r, and 2^n built in the exponent.
    """
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))  # float32, not int
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _pow2i(np.int32(n))


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


# Keys per work item of decode attention. Fixed (not derived from the thread count), so the
# chunked softmax below sums in the same order with any number of threads.
ATTEND_CHUNK = 128


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _attend_chunk(q, k, v, kv, t0, m_len, scale, s, ms, ls, accs):
    """Keys t0 .. t0+m_len of KV head kv for its G query heads: each head's max score into ms,
    its exp-sum into ls and its exp-weighted value sum into accs (zeros on entry); s is a
    [G, >= m_len] scratch. Element loops only: a slice store compiles its shape-mismatch error
    path, seconds of a first start's compile."""
    G, Dk, Dv = ms.shape[0], q.shape[1], accs.shape[1]
    for j in range(m_len):
        t = t0 + j
        for g in range(G):
            a = np.float32(0.0)
            for d in range(Dk):
                a += q[kv * G + g, d] * k[kv, t, d]
            s[g, j] = a * scale
    for g in range(G):
        m = np.float32(-np.inf)
        for j in range(m_len):
            m = max(m, s[g, j])
        total = np.float32(0.0)
        for j in range(m_len):
            e = expf(s[g, j] - m)
            s[g, j] = e
            total += e
        ms[g] = m
        ls[g] = total
    j = 0
    # Four keys per pass over the accumulators: a quarter of their loads and stores (the kernel
    # alone, SmolLM2's shapes: 28.0 -> 25.1 ms a token at 8k of context, 2.26 -> 1.81 at 1k).
    while j + 4 <= m_len:
        t = t0 + j
        for g in range(G):
            p0, p1, p2, p3 = s[g, j], s[g, j + 1], s[g, j + 2], s[g, j + 3]
            for d in range(Dv):
                accs[g, d] += (p0 * v[kv, t, d] + p1 * v[kv, t + 1, d]) + (p2 * v[kv, t + 2, d] + p3 * v[kv, t + 3, d])
        j += 4
    while j < m_len:
        t = t0 + j
        for g in range(G):
            p = s[g, j]
            for d in range(Dv):
                accs[g, d] += p * v[kv, t, d]
        j += 1


@njit(cache=True, parallel=True, fastmath={"reassoc", "contract", "nsz"})
def attend_one(q, k, v, n, scale):
    """One query position over the first n cached keys (decode). q [H, Dk]; k [KV, cap, Dk];
    v [KV, cap, Dv] -> [H * Dv]. Query heads share KV heads in groups of G = H // KV (GQA).

    Flash-decoding: the keys are cut into chunks of ATTEND_CHUNK, and each (KV head, chunk)
    work item serves all G query heads of its group, so every cached key and value is read
    from memory once per token, not G times (at 8k tokens of context, SmolLM2's cache is
    ~12 MB a layer: this read, not the weights, is what a long conversation's token costs).
    An item keeps its chunk's max score, exp-sum and weighted value sum; one serial pass merges
    the chunks in order (online softmax), so the result does not depend on the threads."""
    H = q.shape[0]
    KV, _, Dv = v.shape
    G = H // KV
    C = ATTEND_CHUNK
    nc = (n + C - 1) // C
    ms = np.empty((KV, nc, G), np.float32)
    ls = np.empty((KV, nc, G), np.float32)
    accs = np.zeros((KV, nc, G, Dv), np.float32)
    scratch = np.empty((KV * nc, G, C), np.float32)
    for item in prange(KV * nc):
        kv = item // nc
        c = item - kv * nc
        _attend_chunk(q, k, v, kv, c * C, min(n - c * C, C), scale, scratch[item], ms[kv, c], ls[kv, c],
                      accs[kv, c])
    out = np.empty(H * Dv, np.float32)
    _merge_chunks(ms, ls, accs, nc, out)
    return out


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _merge_chunks(ms, ls, accs, nc, out):
    """One query's chunks merged in order (online softmax): ms/ls [KV, >= nc, G], accs
    [KV, >= nc, G, Dv] -> out [H * Dv]."""
    KV, _, G, Dv = accs.shape
    row = np.empty(Dv, np.float32)
    for h in range(KV * G):
        kv = h // G
        g = h - kv * G
        top = np.float32(-np.inf)
        for c in range(nc):
            top = max(top, ms[kv, c, g])
        total = np.float32(0.0)
        for d in range(Dv):
            row[d] = 0.0
        for c in range(nc):
            w = expf(ms[kv, c, g] - top)
            total += w * ls[kv, c, g]
            for d in range(Dv):
                row[d] += w * accs[kv, c, g, d]
        inv = np.float32(1.0) / total
        for d in range(Dv):
            out[h * Dv + d] = row[d] * inv


@njit(cache=True, parallel=True, fastmath={"reassoc", "contract", "nsz"})
def attend_rows(q, kcs, vcs, n, scale):
    """attend_one for several queries at once (the fused decode blocks, one token or several):
    q [B, H, Dk]; query r over the first n[r] keys of kcs[r] / vcs[r] (numba typed lists of
    [KV, cap, D] arrays; rows may share a cache) -> [B, H * Dv]. One parallel region for all
    rows' (KV head, chunk) work items, so a few short rows do not each pay a region's start.
    A row's result does not depend on the other rows: the same items, merged in the same order,
    whatever B is; one token and a batch both go through here."""
    B, H, _ = q.shape
    KV, _, Dv = vcs[0].shape
    G = H // KV
    C = ATTEND_CHUNK
    nc = np.empty(B, np.int64)
    first = np.zeros(B + 1, np.int64)  # rows' first work items
    for r in range(B):
        nc[r] = (n[r] + C - 1) // C
        first[r + 1] = first[r] + KV * nc[r]
    most = 0
    for r in range(B):
        most = max(most, nc[r])
    ms = np.empty((B, KV, most, G), np.float32)
    ls = np.empty((B, KV, most, G), np.float32)
    accs = np.zeros((B, KV, most, G, Dv), np.float32)
    scratch = np.empty((first[B], G, C), np.float32)
    for item in prange(first[B]):
        r = 0
        while first[r + 1] <= item:
            r += 1
        kv = (item - first[r]) // nc[r]
        c = item - first[r] - kv * nc[r]
        _attend_chunk(q[r], kcs[r], vcs[r], kv, c * C, min(n[r] - c * C, C), scale, scratch[item],
                      ms[r, kv, c], ls[r, kv, c], accs[r, kv, c])
    out = np.empty((B, H * Dv), np.float32)
    for r in range(B):
        _merge_chunks(ms[r], ls[r], accs[r], nc[r], out[r])
    return out


# error_model="numpy": numba's default checks every float division for a zero divisor, a
# branch that keeps the loop scalar (5x slower here).
@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def _silu_gate(g, u, out):
    for i in range(g.shape[0]):
        v = g[i]
        out[i] = v / (np.float32(1.0) + expf(-v)) * u[i]


@njit(cache=True)
def silu_mul(gu, n):
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n]."""
    L = gu.shape[0]
    out = np.empty((L, n), np.float32)
    for i in range(L):
        _silu_gate(gu[i, :n], gu[i, n:], out[i])
    return out


def silu_gate(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u for float32 arrays of one shape (the SwiGLU of unfused gate/up weights)."""
    out = np.empty_like(g)
    _silu_gate(g.reshape(-1), u.reshape(-1), out.reshape(-1))
    return out
