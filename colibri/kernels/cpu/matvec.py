"""matvec for decode (one token) and matvec_rows (a few tokens at once, each token's result
the same bits), over every QTensor scheme (the GGUF block schemes' kernels: blocks.py).

- Decode is bound by streaming weights, so matvec never materialises a dequantized row. The
  offset term (-8*s, or q4_1's min m) does not depend on the nibble, so it leaves the inner
  loop: dot(w_g, x_g) = s * dot(nib, x_g) + c * sum(x_g), with x's group sums taken once per
  call.
- Quantized matvec works on blocks of eight rows (two for rows of PAIR_ROW_BYTES or more)
  sharing each load of x, through the IR tiles of codegen.py, with the next block's bytes
  prefetched.
- Every kernel is parallel over output rows (prange); the Python entry points check their
  arguments first (checks.py).
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange

from colibri.formats.qtensor import GROUP_SIZE, INT4_SCHEMES, PAIR_ROW_BYTES, QTensor, chunk_shift

from .blocks import TYPE_CODE, matmul_rows_blocks, matvec_blocks
from .checks import check_tensor, checked_x, result_array
from .codegen import (
    FASTMATH,
    PARTS,
    TILE_A,
    TILE_W,
    bf16_f32,
    f16_f32,
    int4_dot2,
    int4_dot8,
    int4_tile1,
    int4_tile2,
    int4_tile3,
    int4_tile4,
    int8_f32,
    nibble_hi,
    nibble_lo,
    q8_dot2,
    q8_dot8,
    q8_tile1,
    q8_tile2,
    q8_tile3,
    q8_tile4,
    with_offset,
    with_offsets8,
    with_offsets_tile,
)

# The small reductions around the int4 dot products (group sums of x, the offset term, a tail
# row's lane sum) are written out in one fixed order, without fastmath: a fastmath loop is
# vectorized as LLVM sees fit in each function it is inlined into, so the same row could round
# differently in the one-row kernel, the multi-row kernel and the fused MoE kernel. With a
# written order every kernel computes a (weight row, activation row) pair with the same
# operations, and batching never changes a bit (tests/kernels/test_rows.py).


@njit(cache=True)
def group_sums_into(x, group, xs):
    """xs[g] = sum of x's group g: eight interleaved partial sums, then a fixed tree."""
    for g in range(xs.shape[0]):
        x0 = g * group
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for k in range(0, group, 8):
            a0 += x[x0 + k]
            a1 += x[x0 + k + 1]
            a2 += x[x0 + k + 2]
            a3 += x[x0 + k + 3]
            a4 += x[x0 + k + 4]
            a5 += x[x0 + k + 5]
            a6 += x[x0 + k + 6]
            a7 += x[x0 + k + 7]
        xs[g] = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(cache=True)
def group_sums(x, group):
    xs = np.empty(x.shape[0] // group, np.float32)
    group_sums_into(x, group, xs)
    return xs


def _block_source(bi: int, m: int, cshift: int) -> int:
    """The element of x that prepared position 128 bi + m stands for (see prepare_x_into)."""
    k, i = m >> 4, m & 15
    chunk = 4 * bi + (i >> 2)  # lane i's 16-byte chunk and its byte in it hold nibble k
    byte = 4 * (i & 3) + (k >> 1)
    g, half = chunk >> cshift, 16 << cshift
    return g * 2 * half + (chunk - (g << cshift)) * 16 + byte + (k & 1) * half


_block_source_compiled = njit(cache=True)(_block_source)

# Groups of up to 128 elements: a block's elements are its own 128, in an order that does not
# depend on the block (a table); wider groups interleave two blocks' halves.
_BLOCK_ORDER = np.array([[_block_source(0, m, c) for m in range(128)] for c in range(3)], np.int64)
_BLOCK_SCALE = np.array([2.0 ** (-4 * k) for k in range(7)] + [1.0], np.float32)


@njit(cache=True)
def prepare_x_into(x, half, xp):
    """x laid out for _int4_block: in each whole 64-byte block of a row (128 elements), vector
    k's lane i is the element that nibble k of the row's bytes 4i..4i+3 multiplies, scaled by
    16^-k (nibble 7 is shifted down, not masked: unscaled). Powers of two: exact, so every
    product is the one the unprepared x would give. The elements past the last whole block
    (the per-chunk loop's) stay where they are."""
    n = x.shape[0]
    cshift = 0
    while (16 << cshift) < half:
        cshift += 1
    nblocks = n // 128
    if cshift < _BLOCK_ORDER.shape[0]:
        order = _BLOCK_ORDER[cshift]
        for bi in range(nblocks):
            b = 128 * bi
            for m in range(128):
                xp[b + m] = x[b + order[m]] * _BLOCK_SCALE[m >> 4]
    else:
        for bi in range(nblocks):
            for m in range(128):
                xp[128 * bi + m] = x[_block_source_compiled(bi, m, cshift)] * _BLOCK_SCALE[m >> 4]
    for m in range(128 * nblocks, n):
        xp[m] = x[m]


@njit(cache=True)
def prepare_x(x, half):
    xp = np.empty_like(x)
    prepare_x_into(x, half, xp)
    return xp


@njit(cache=True)
def _finish(acc, offs, r, coef, xs):
    """A tail row: the sum of its lane accumulators in order, plus the offset term."""
    a = np.float32(0.0)
    for k in range(acc.shape[0]):
        a += acc[k]
    return with_offset(a, offs, r, coef, xs)


@njit(cache=True)
def _int4_row(q, scales, r, half, x, acc):
    """A tail row's lane sums (rows past the last whole block; in the fixed order)."""
    acc[:] = 0.0
    for g in range(scales.shape[1]):
        b0 = g * half
        x0 = 2 * b0
        s = scales[r, g]
        for k in range(half):
            c = q[r, b0 + k]
            acc[k] += (nibble_lo(c) * x[x0 + k] + nibble_hi(c) * x[x0 + half + k]) * s


@njit(cache=True)
def int4_rows8(q, scales, offs, coef, half, cshift, ilv, xp, xs, r, d):
    """d[0:8] = rows r..r+7 of the int4 matvec (xp: x prepared by prepare_x, xs: group sums
    of x; q's rows interleaved in blocks of ilv), the next block's rows prefetched. Shared by
    the matvec here and the fused MoE kernel in moe.py. On a 16-register target (AVX2) rows of
    any length go two at a time: the 8-row tile's sixteen 8-lane accumulators spill there, and
    576- and 768-input rows in pairs ran 17-27% faster from cache than through it, as fast from
    DRAM (`python -m bench.kernels.int4_tiles`, docs/benchmarks.md: Kernels)."""
    out = q.shape[0]
    rn = r + 8 if r + 16 <= out else r
    if q.shape[1] >= PAIR_ROW_BYTES or PARTS == 2:
        for p in range(0, 8, 2):
            int4_dot2(q, scales, offs, r + p, r + p + 2 if p < 6 else rn, xp, half, cshift, ilv, d, p)
    else:
        int4_dot8(q, scales, offs, r, rn, xp, half, cshift, ilv, d, 0)
    with_offsets8(d, offs, r, coef, xs)


@njit(cache=True)
def int4_tail_rows(q, scales, offs, coef, half, x, xs, y):
    """The last rows (out % 8) one at a time (row-major: an interleaved q has none)."""
    out = q.shape[0]
    acc1 = np.empty(half, np.float32)
    for r in range(out - out % 8, out):
        _int4_row(q, scales, r, half, x, acc1)
        y[r] = _finish(acc1, offs, r, coef, xs)


@njit(parallel=True, cache=True)
def matvec_int4(q, scales, offs, coef, half, cshift, ilv, x, y, nthreads):
    """int4_g64 / q4_0 / q4_1: y[r] = sum_g s[r,g] * dot(nib, x_g) + coef * dot(offs[r], xsum).

    Symmetric schemes pass offs = scales, coef = -8 (w = (nib - 8) * s); q4_1 passes
    offs = mins, coef = 1 (w = nib * d + m).
    """
    out = q.shape[0]
    xs = group_sums(x, 2 * half)
    xp = prepare_x(x, half)
    nblk = out // 8
    per = (nblk + nthreads - 1) // nthreads
    # A contiguous run of blocks per thread, so each thread allocates its buffer once.
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            int4_rows8(q, scales, offs, coef, half, cshift, ilv, xp, xs, r, d)
            for j in range(8):
                y[r + j] = d[j]
    int4_tail_rows(q, scales, offs, coef, half, x, xs, y)


@njit(cache=True)
def _int4_tile(q, scales, offs, r, rn, x, a0, na, half, cshift, ilv, d):
    if na == 4:
        int4_tile4(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)
    elif na == 3:
        int4_tile3(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)
    elif na == 2:
        int4_tile2(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)
    else:
        int4_tile1(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)


@njit(parallel=True, cache=True)
def matmul_rows_int4(q, scales, offs, coef, half, cshift, ilv, x, y, nthreads):
    """y [B, out] = x [B, n] @ W.T for a few tokens (batched decode, drafted tokens): row a of
    y equals matvec_int4(x[a]) bit for bit (tile_codegen), each weight chunk unpacked once
    per tile of TILE_W weight rows x up to TILE_A tokens."""
    out, B = q.shape[0], x.shape[0]
    xs = np.empty((B, scales.shape[1]), np.float32)
    xp = np.empty_like(x)
    for a in range(B):
        group_sums_into(x[a], 2 * half, xs[a])
        prepare_x_into(x[a], half, xp[a])
    nblk = out // 8 * (8 // TILE_W)  # the one-row kernels' whole blocks of eight
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty((TILE_A, TILE_W), np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = TILE_W * blk
            rn = r + TILE_W if r + 2 * TILE_W <= out else r
            for a0 in range(0, B, TILE_A):
                na = min(TILE_A, B - a0)
                _int4_tile(q, scales, offs, r, rn, xp, a0, na, half, cshift, ilv, d)
                for a in range(na):
                    with_offsets_tile(d[a], offs, r, coef, xs[a0 + a])
                    for j in range(TILE_W):
                        y[a0 + a, r + j] = d[a, j]
    if out % 8:  # the rows past matvec_int4's last block of eight: its tail code
        for a in range(B):
            int4_tail_rows(q, scales, offs, coef, half, x[a], xs[a], y[a])


@njit(cache=True)
def _q8_row(q, scales, r, group, x, acc):
    """A tail row's lane sums, in the fixed order."""
    acc[:] = 0.0
    for g in range(scales.shape[1]):
        x0 = g * group
        s = scales[r, g]
        for k in range(group):
            acc[k] += int8_f32(q[r, x0 + k]) * x[x0 + k] * s


@njit(cache=True)
def _q8_tail_rows(q, scales, group, x, y):
    out = q.shape[0]
    xs = np.zeros(0, np.float32)
    acc1 = np.empty(group, np.float32)
    for r in range(out - out % 8, out):
        _q8_row(q, scales, r, group, x, acc1)
        y[r] = _finish(acc1, scales, r, np.float32(0.0), xs)


@njit(parallel=True, cache=True)
def _matvec_q8(q, scales, group, cshift, ilv, x, y, nthreads):
    """q8_0, shaped like matvec_int4 (no offsets: w = q * d)."""
    out = q.shape[0]
    nblk = out // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            rn = r + 8 if r + 16 <= out else r
            if q.shape[1] >= PAIR_ROW_BYTES:
                for p in range(0, 8, 2):
                    q8_dot2(q, scales, r + p, r + p + 2 if p < 6 else rn, x, group, cshift, ilv, y, r + p)
            else:
                q8_dot8(q, scales, r, rn, x, group, cshift, ilv, y, r)
    _q8_tail_rows(q, scales, group, x, y)


@njit(cache=True)
def _q8_tile(q, scales, r, rn, x, a0, na, group, cshift, ilv, d):
    if na == 4:
        q8_tile4(q, scales, r, rn, x, a0, group, cshift, ilv, d)
    elif na == 3:
        q8_tile3(q, scales, r, rn, x, a0, group, cshift, ilv, d)
    elif na == 2:
        q8_tile2(q, scales, r, rn, x, a0, group, cshift, ilv, d)
    else:
        q8_tile1(q, scales, r, rn, x, a0, group, cshift, ilv, d)


@njit(parallel=True, cache=True)
def _matmul_rows_q8(q, scales, group, cshift, ilv, x, y, nthreads):
    """q8_0's matmul_rows_int4: row a of y equals _matvec_q8(x[a]) bit for bit."""
    out, B = q.shape[0], x.shape[0]
    nblk = out // 8 * (8 // TILE_W)  # the one-row kernels' whole blocks of eight
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty((TILE_A, TILE_W), np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = TILE_W * blk
            rn = r + TILE_W if r + 2 * TILE_W <= out else r
            for a0 in range(0, B, TILE_A):
                na = min(TILE_A, B - a0)
                _q8_tile(q, scales, r, rn, x, a0, na, group, cshift, ilv, d)
                for a in range(na):
                    for j in range(TILE_W):
                        y[a0 + a, r + j] = d[a, j]
    if out % 8:
        for a in range(B):
            _q8_tail_rows(q, scales, group, x[a], y[a])


@njit(cache=True, fastmath=FASTMATH)
def f32_rows_dot4(w, r, x, y, yl, y0):
    """y[yl, y0 : y0+4] = w[r : r+4] @ x; w is float32."""
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for k in range(x.shape[0]):
        xk = x[k]
        a0 += w[r, k] * xk
        a1 += w[r + 1, k] * xk
        a2 += w[r + 2, k] * xk
        a3 += w[r + 3, k] * xk
    y[yl, y0] = a0
    y[yl, y0 + 1] = a1
    y[yl, y0 + 2] = a2
    y[yl, y0 + 3] = a3


@njit(cache=True, fastmath=FASTMATH)
def f32_row_dot(w, r, x):
    a = np.float32(0.0)
    for k in range(x.shape[0]):
        a += w[r, k] * x[k]
    return a


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _matvec_f32(w, x, y):
    out = w.shape[0]
    y2 = y.reshape((1, out))
    for blk in prange((out + 3) // 4):
        r = 4 * blk
        if r + 4 > out:
            for rr in range(r, out):
                y[rr] = f32_row_dot(w, rr, x)
        else:
            f32_rows_dot4(w, r, x, y2, 0, r)


@njit(cache=True, fastmath=FASTMATH)
def _u16_row_dot(w, r, is_bf16, x):
    a = np.float32(0.0)
    if is_bf16:
        for k in range(x.shape[0]):
            a += bf16_f32(w[r, k]) * x[k]
    else:
        for k in range(x.shape[0]):
            a += f16_f32(w[r, k]) * x[k]
    return a


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _matvec_u16(w, is_bf16, x, y):
    """f16 and bf16 weights, both held as raw uint16 bits."""
    out = w.shape[0]
    for blk in prange((out + 3) // 4):
        r = 4 * blk
        if r + 4 > out:
            for rr in range(r, out):
                y[rr] = _u16_row_dot(w, rr, is_bf16, x)
            continue
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        # The branch sits outside the k loop so each loop body is a single conversion.
        if is_bf16:
            for k in range(x.shape[0]):
                xk = x[k]
                a0 += bf16_f32(w[r, k]) * xk
                a1 += bf16_f32(w[r + 1, k]) * xk
                a2 += bf16_f32(w[r + 2, k]) * xk
                a3 += bf16_f32(w[r + 3, k]) * xk
        else:
            for k in range(x.shape[0]):
                xk = x[k]
                a0 += f16_f32(w[r, k]) * xk
                a1 += f16_f32(w[r + 1, k]) * xk
                a2 += f16_f32(w[r + 2, k]) * xk
                a3 += f16_f32(w[r + 3, k]) * xk
        y[r] = a0
        y[r + 1] = a1
        y[r + 2] = a2
        y[r + 3] = a3


def int4_weight(t: QTensor) -> tuple | None:
    """The int4 matvec kernel's weight arguments for t, (q, scales, offs, coef, half, cshift,
    ilv), or None when t is not an int4 scheme (used by matvec and by the fused decode blocks)."""
    if t.scheme not in INT4_SCHEMES:
        return None
    check_tensor(t)
    half = GROUP_SIZE[t.scheme] // 2
    offs, coef = (t.mins, 1.0) if t.scheme == "q4_1" else (t.scales, -8.0)
    return t.q, t.scales, offs, np.float32(coef), half, chunk_shift(half), t.interleave


def matvec(t: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = dequantize(t) @ x: float32 [in] -> float32 [out_features] (decode)."""
    check_tensor(t)
    x = checked_x(x, 1, t.shape[1], "matvec")
    y = result_array(out, (t.shape[0],), "matvec")
    if t.shape[0] == 0:
        return y
    s = t.scheme
    if s in TYPE_CODE:  # GGUF block schemes (blocks.py)
        matvec_blocks(TYPE_CODE[s], t.q, x, y, get_num_threads())
    elif s in INT4_SCHEMES:
        matvec_int4(*int4_weight(t), x, y, get_num_threads())
    elif s == "q8_0":
        group = GROUP_SIZE[s]
        _matvec_q8(t.q, t.scales, group, chunk_shift(group), t.interleave, x, y, get_num_threads())
    elif s == "f32":
        _matvec_f32(t.q, x, y)
    else:
        _matvec_u16(t.q.view(np.uint16), s == "bf16", x, y)
    return y


def matvec_rows(t: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """matvec(t, x[a]) for each row a of x [B, in] -> [B, out_features], the same bits row by
    row, with the weights read once for all rows (batched decode, drafted tokens)."""
    check_tensor(t)
    x = checked_x(x, 2, t.shape[1], "matvec_rows")
    y = result_array(out, (x.shape[0], t.shape[0]), "matvec_rows")
    if t.shape[0] == 0 or x.shape[0] == 0:
        return y
    s = t.scheme
    if s in TYPE_CODE:
        matmul_rows_blocks(TYPE_CODE[s], t.q, x, y, get_num_threads())
    elif s in INT4_SCHEMES:
        matmul_rows_int4(*int4_weight(t), x, y, get_num_threads())
    elif s == "q8_0":
        group = GROUP_SIZE[s]
        _matmul_rows_q8(t.q, t.scales, group, chunk_shift(group), t.interleave, x, y, get_num_threads())
    else:  # float weights: no unpacking to share
        for a in range(x.shape[0]):
            matvec(t, x[a], out=y[a])
    return y
