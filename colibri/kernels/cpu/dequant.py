"""Exact row dequantizers and the embedding lookup: no fastmath, so a row equals
qtensor.dequantize bit for bit (tests/kernels/test_cpu.py). Prefill's tiles (gemm.py) use the
same row code.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from colibri.formats.qtensor import GROUP_SIZE, QTensor

from .blocks import TYPE_CODE, deq_block_row, embed_blocks
from .checks import check_tensor, int4_args
from .codegen import bf16_f32, f16_f32, int8_f32, nibble_hi, nibble_lo

# --- exact row dequantizers (no fastmath: embedding equals qtensor.dequantize bit for bit) --


@njit(cache=True)
def _deq_int4_row(qr, sr, mr, half, has_min, dst):
    for g in range(sr.shape[0]):
        s = sr[g]
        b0 = g * half
        x0 = 2 * b0
        if has_min:
            m = mr[g]
            for k in range(half):
                b = qr[b0 + k]
                dst[x0 + k] = nibble_lo(b) * s + m
                dst[x0 + half + k] = nibble_hi(b) * s + m
        else:
            for k in range(half):
                b = qr[b0 + k]
                dst[x0 + k] = (nibble_lo(b) - np.float32(8.0)) * s
                dst[x0 + half + k] = (nibble_hi(b) - np.float32(8.0)) * s


@njit(cache=True)
def _byte_at(rb, ilv, r, b):
    """Where byte b of row r lies in an interleaved q of rows of rb bytes (flat index); a group
    never straddles a 64-byte block, so a group's bytes follow from its first one."""
    jj = r & (ilv - 1)
    start = (r - jj) * rb
    nfull = rb // 64
    if b < 64 * nfull:
        return start + (b >> 6) * 64 * ilv + jj * 64 + (b & 63)
    return start + nfull * 64 * ilv + jj * (rb - 64 * nfull) + b - 64 * nfull


@njit(cache=True)
def deq_int4_row_at(q, scales, mins, half, has_min, ilv, r, dst):
    """Row r of an int4 matrix dequantized into dst, whatever q's layout: group by group, each
    group's bytes found where they lie (views, no copy)."""
    if ilv == 1:
        _deq_int4_row(q[r], scales[r], mins[r], half, has_min, dst)
        return
    flat = q.reshape(-1)
    for g in range(scales.shape[1]):
        p = _byte_at(q.shape[1], ilv, r, g * half)
        _deq_int4_row(flat[p:p + half], scales[r, g:g + 1], mins[r, g:g + 1], half, has_min,
                      dst[2 * g * half:2 * (g + 1) * half])


@njit(cache=True)
def deq_q8_row_at(q, scales, group, ilv, r, dst):
    """Row r of a q8_0 matrix dequantized into dst, whatever q's layout."""
    if ilv == 1:
        _deq_q8_row(q[r], scales[r], group, dst)
        return
    flat = q.reshape(-1)
    for g in range(scales.shape[1]):
        p = _byte_at(q.shape[1], ilv, r, g * group)
        _deq_q8_row(flat[p:p + group], scales[r, g:g + 1], group, dst[g * group:(g + 1) * group])


@njit(cache=True)
def _deq_q8_row(qr, sr, group, dst):
    for g in range(sr.shape[0]):
        s = sr[g]
        x0 = g * group
        for k in range(group):
            dst[x0 + k] = int8_f32(qr[x0 + k]) * s


@njit(cache=True)
def deq_u16_row(wr, is_bf16, dst):
    if is_bf16:
        for k in range(wr.shape[0]):
            dst[k] = bf16_f32(wr[k])
    else:
        for k in range(wr.shape[0]):
            dst[k] = f16_f32(wr[k])


# --- embedding ----------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _embed_int4(q, scales, mins, half, has_min, ilv, ids, y):
    for i in prange(ids.shape[0]):
        deq_int4_row_at(q, scales, mins, half, has_min, ilv, ids[i], y[i])


@njit(parallel=True, cache=True)
def _embed_q8(q, scales, group, ilv, ids, y):
    for i in prange(ids.shape[0]):
        deq_q8_row_at(q, scales, group, ilv, ids[i], y[i])


@njit(parallel=True, cache=True)
def _embed_u16(w, is_bf16, ids, y):
    for i in prange(ids.shape[0]):
        deq_u16_row(w[ids[i]], is_bf16, y[i])


def embedding(t: QTensor, ids: np.ndarray) -> np.ndarray:
    """Dequantized rows t[ids]: int [L] -> float32 [L, in], equal to dequantize(t)[ids]."""
    check_tensor(t)
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.dtype.kind in "iu" or ids.size == 0):  # (kind: np.issubdtype took ~10 us)
        raise ValueError(f"embedding: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    vocab = t.shape[0]
    # A decode token's one row is checked as a Python int: right after a token has streamed
    # the weights through the caches, numpy's min and max took ~40 us.
    if ids.size == 1 and not 0 <= int(ids[0]) < vocab or ids.size > 1 and (ids.min() < 0 or ids.max() >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)][0]
        raise ValueError(f"embedding: token id {bad} is out of range for a table of {vocab} rows")
    y = np.empty((ids.shape[0], t.shape[1]), np.float32)
    if ids.size == 0:
        return y
    s = t.scheme
    if ids.size == 1 and s != "f32":
        # The one row on this thread: a parallel region for it woke the other threads first,
        # which took longer than the row (~0.1 ms a token against ~7 us).
        r = int(ids[0])
        if s in TYPE_CODE:
            deq_block_row(TYPE_CODE[s], t.q[r], y[0])
        elif s in ("int4_g64", "q4_0", "q4_1"):
            deq_int4_row_at(*int4_args(t), r, y[0])
        elif s == "q8_0":
            deq_q8_row_at(t.q, t.scales, GROUP_SIZE[s], t.interleave, r, y[0])
        else:
            deq_u16_row(t.q.view(np.uint16)[r], s == "bf16", y[0])
        return y
    if s in TYPE_CODE:
        embed_blocks(TYPE_CODE[s], t.q, ids, y)
    elif s in ("int4_g64", "q4_0", "q4_1"):
        _embed_int4(*int4_args(t), ids, y)
    elif s == "q8_0":
        _embed_q8(t.q, t.scales, GROUP_SIZE[s], t.interleave, ids, y)
    elif s == "f32":
        np.take(t.q, ids, axis=0, out=y)
    else:
        _embed_u16(t.q.view(np.uint16), s == "bf16", ids, y)
    return y
