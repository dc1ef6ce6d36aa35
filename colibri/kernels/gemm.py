"""Prefill's matmul over QTensor: y = x @ dequantize(W).T for L activation rows.

Prefill is compute bound, so weights are dequantized, exactly, into a float32 tile of rows
(the row dequantizers are the embedding's: equal to qtensor.dequantize bit for bit) and the
arithmetic is float32 multiply-adds. Two ways to do that arithmetic:

- From BLAS_MIN_ROWS activation rows: numpy's BLAS sgemm on each dequantized tile. Python
  threads take alternate tiles (tasks.run_tasks): the numba dequantizer is compiled nogil and
  BLAS releases the GIL, so they run in parallel. A tile is sized to stay in L2 while BLAS
  reads it back (TILE_BYTES), and a matrix makes an even number of tiles (_tile_rows). At a
  512-token chunk this ran 245-300 GFLOP/s on 2 threads against 200-220 for the numba kernel
  on an AMD EPYC (1.2-1.4x on SmolLM2's and OLMoE's shapes), 207-248 against 150-180 on a
  Xeon; the two are even at 128 (AMD) to 192 rows (Xeon), below that the per-tile
  dequantization dominates (bench/kernels/prefill_gemm.py).
- Fewer rows (an expert's handful of tokens in a chunk, a short prompt): the numba
  register-blocked kernel below (4 weight rows x 4 activation rows, 3 x 4 on 16-register
  targets), one parallel call, nothing dequantized twice.

Both sum in an order fixed by the tile shapes, never by the thread count (tiles are dealt to
threads, not cut by them), so the same prompt gives the same bits with any number of threads.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from pathlib import Path

import numpy as np
from numba import get_num_threads, njit, prange

from colibri.formats.qtensor import GROUP_SIZE, INT4_SCHEMES, QTensor

from .cpu.blocks import TYPE_CODE, deq_block_row, deq_block_tile
from .cpu.checks import check_tensor, checked_x, int4_args, result_array
from .cpu.codegen import FASTMATH
from .cpu.dequant import deq_int4_row_at, deq_q8_row_at, deq_u16_row
from .cpu.matvec import f32_row_dot, f32_rows_dot4
from .cpu.target import narrow_tiles
from .tasks import run_tasks

# Weight rows per register block of the numba kernel (_tile_matmul), times 4 activation rows. On
# AVX-512's 32 vector registers 4 x 4: 16 accumulators and their 8 operands fit. On a
# 16-register target (AVX2, cpu/target.narrow_tiles) they spilled: on one core of the AVX2 EPYC
# the matmul of a 1024x2048 int4 matrix with 16 rows ran 45-48 GFLOP/s in 3 x 4 against 32-36
# (`COLIBRI_TILES=narrow|wide python -m bench.kernels.prefill_gemm --threads 1`). The forms cut
# a tile's edges differently (the rows past the blocks take f32_rows_dot4 / f32_row_dot), so a
# few outputs differ between them in float32 rounding, as prefill's outputs already differ
# between vector widths (fast-math sums); decode's tiles are the ones kept bit-equal across
# CPU classes (tests/kernels/test_rows.py).
_WROWS = 3 if narrow_tiles() else 4
# Rows dequantized per numba matmul tile, a multiple of _WROWS: 16 (or 15) rows x 4096 inputs x
# 4 B = 256 KB, L2-resident.
_TILE = 16 - 16 % _WROWS
BLAS_MIN_ROWS = 192  # activation rows from which BLAS wins (bench/kernels/prefill_gemm.py: 128 on an AMD EPYC, ~192 on a Xeon)


def _l2_bytes() -> int:
    """This core's L2 cache in bytes (Linux sysfs), 0 where it cannot be read."""
    try:
        for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()  # "2048K"
                return int(size[:-1]) << {"K": 10, "M": 20}[size[-1]] if size[-1:] in ("K", "M") else int(size)
    except (OSError, ValueError, IndexError):
        pass
    return 0


# One BLAS tile of dequantized rows (per thread), kept in L2 while BLAS reads it back: 3/4 of
# L2, at least 512 KB (the best size on a 512 KB-L2 AMD EPYC; on a 2 MB-L2 Xeon 1.5 MB ran
# 10-20% faster than 512 KB at a 512-token chunk, bench/kernels/prefill_gemm.py).
TILE_BYTES = max(1 << 19, _l2_bytes() * 3 // 4)


# --- few rows: a dequantized tile of weight rows against all L activation rows, in numba ---


# Register blocks of _WROWS weight rows x four activation rows per pass over k. Measured on
# a 16-row tile, L=64, AVX-512: 4x4 ~160 GFLOP/s per core, 4x2 ~85, 4x1 ~50.
@njit(cache=True, fastmath=FASTMATH)
def _dot_block(w, j, x, l, y, y0):
    """y[l:l+4, y0+j : y0+j+_WROWS] = x[l:l+4] @ w[j:j+_WROWS].T. The fourth weight row's
    lines run only where _WROWS is 4, a constant when this compiles: the 3-row form has no
    trace of them."""
    four = _WROWS == 4
    a00 = a01 = a02 = a03 = np.float32(0.0)
    a10 = a11 = a12 = a13 = np.float32(0.0)
    a20 = a21 = a22 = a23 = np.float32(0.0)
    a30 = a31 = a32 = a33 = np.float32(0.0)
    for k in range(x.shape[1]):
        w0 = w[j, k]
        w1 = w[j + 1, k]
        w2 = w[j + 2, k]
        x0 = x[l, k]
        x1 = x[l + 1, k]
        x2 = x[l + 2, k]
        x3 = x[l + 3, k]
        a00 += w0 * x0
        a01 += w1 * x0
        a02 += w2 * x0
        a10 += w0 * x1
        a11 += w1 * x1
        a12 += w2 * x1
        a20 += w0 * x2
        a21 += w1 * x2
        a22 += w2 * x2
        a30 += w0 * x3
        a31 += w1 * x3
        a32 += w2 * x3
        if four:
            w3 = w[j + 3, k]
            a03 += w3 * x0
            a13 += w3 * x1
            a23 += w3 * x2
            a33 += w3 * x3
    c = y0 + j
    y[l, c], y[l, c + 1], y[l, c + 2] = a00, a01, a02
    y[l + 1, c], y[l + 1, c + 1], y[l + 1, c + 2] = a10, a11, a12
    y[l + 2, c], y[l + 2, c + 1], y[l + 2, c + 2] = a20, a21, a22
    y[l + 3, c], y[l + 3, c + 1], y[l + 3, c + 2] = a30, a31, a32
    if four:
        y[l, c + 3], y[l + 1, c + 3], y[l + 2, c + 3], y[l + 3, c + 3] = a03, a13, a23, a33


@njit(cache=True, fastmath=FASTMATH)
def _tile_matmul(w, nr, x, y, y0):
    """y[:, y0 : y0+nr] = x @ w[:nr].T for a dequantized tile w: register blocks of _WROWS
    weight rows x 4 activation rows, then the rows past them."""
    L = x.shape[0]
    l4 = L - L % 4
    jw = nr - nr % _WROWS
    j4 = nr - nr % 4
    for l in range(0, l4, 4):
        for j in range(0, jw, _WROWS):
            _dot_block(w, j, x, l, y, y0)
    for l in range(L):
        xl = x[l]
        if l < l4:  # the weight rows past the register blocks
            for j in range(jw, nr):
                y[l, y0 + j] = f32_row_dot(w, j, xl)
            continue
        for j in range(0, j4, 4):  # the activation rows past them
            f32_rows_dot4(w, j, xl, y, l, y0 + j)
        for j in range(j4, nr):
            y[l, y0 + j] = f32_row_dot(w, j, xl)


@njit(parallel=True, cache=True)
def matmul_int4(q, scales, mins, half, has_min, ilv, x, y, nthreads):
    out, n = q.shape[0], x.shape[1]
    nblk = (out + _TILE - 1) // _TILE
    nth = min(nthreads, nblk)
    # One buffer per thread, allocated once; tiles are dealt round-robin to threads.
    # (nthreads comes from the caller: get_num_threads() inside would block caching.)
    for t in prange(nth):
        buf = np.empty((_TILE, n), np.float32)
        for blk in range(t, nblk, nth):
            r0 = blk * _TILE
            nr = min(_TILE, out - r0)
            for j in range(nr):
                deq_int4_row_at(q, scales, mins, half, has_min, ilv, r0 + j, buf[j])
            _tile_matmul(buf, nr, x, y, r0)


@njit(parallel=True, cache=True)
def _matmul_q8(q, scales, group, ilv, x, y, nthreads):
    out, n = q.shape[0], x.shape[1]
    nblk = (out + _TILE - 1) // _TILE
    nth = min(nthreads, nblk)
    for t in prange(nth):
        buf = np.empty((_TILE, n), np.float32)
        for blk in range(t, nblk, nth):
            r0 = blk * _TILE
            nr = min(_TILE, out - r0)
            for j in range(nr):
                deq_q8_row_at(q, scales, group, ilv, r0 + j, buf[j])
            _tile_matmul(buf, nr, x, y, r0)


@njit(parallel=True, cache=True)
def _matmul_blocks(tc, q, x, y, nthreads):
    """GGUF block schemes (cpu/blocks.py): rows dequantized exactly, as the embedding's."""
    out, n = q.shape[0], x.shape[1]
    nblk = (out + _TILE - 1) // _TILE
    nth = min(nthreads, nblk)
    for t in prange(nth):
        buf = np.empty((_TILE, n), np.float32)
        for blk in range(t, nblk, nth):
            r0 = blk * _TILE
            nr = min(_TILE, out - r0)
            for j in range(nr):
                deq_block_row(tc, q[r0 + j], buf[j])
            _tile_matmul(buf, nr, x, y, r0)


@njit(parallel=True, cache=True)
def _matmul_u16(w, is_bf16, x, y, nthreads):
    out, n = w.shape[0], x.shape[1]
    nblk = (out + _TILE - 1) // _TILE
    nth = min(nthreads, nblk)
    for t in prange(nth):
        buf = np.empty((_TILE, n), np.float32)
        for blk in range(t, nblk, nth):
            r0 = blk * _TILE
            nr = min(_TILE, out - r0)
            for j in range(nr):
                deq_u16_row(w[r0 + j], is_bf16, buf[j])
            _tile_matmul(buf, nr, x, y, r0)


@njit(parallel=True, cache=True)
def _matmul_f32(w, x, y, nthreads):
    out, n = w.shape[0], x.shape[1]
    nblk = (out + _TILE - 1) // _TILE
    nth = min(nthreads, nblk)
    # float32 weights need no dequantization; the copy only gives _tile_matmul the same
    # cache-friendly tile (and one compiled specialisation) as the other schemes.
    for t in prange(nth):
        buf = np.empty((_TILE, n), np.float32)
        for blk in range(t, nblk, nth):
            r0 = blk * _TILE
            nr = min(_TILE, out - r0)
            buf[:nr] = w[r0:r0 + nr]
            _tile_matmul(buf, nr, x, y, r0)


# --- many rows: dequantize a tile (numba, no GIL), multiply it with BLAS -----------------


@njit(cache=True, nogil=True)
def _deq_int4_tile(q, scales, mins, half, has_min, ilv, r0, nr, buf):
    for j in range(nr):
        deq_int4_row_at(q, scales, mins, half, has_min, ilv, r0 + j, buf[j])


@njit(cache=True, nogil=True)
def _deq_q8_tile(q, scales, group, ilv, r0, nr, buf):
    for j in range(nr):
        deq_q8_row_at(q, scales, group, ilv, r0 + j, buf[j])


@njit(cache=True, nogil=True)
def _deq_u16_tile(w, is_bf16, r0, nr, buf):
    for j in range(nr):
        deq_u16_row(w[r0 + j], is_bf16, buf[j])


@functools.lru_cache(maxsize=256)
def _tile_rows(out: int, n_in: int) -> int:
    """Weight rows per BLAS tile: at most TILE_BYTES of float32, a multiple of 16, and enough
    tiles, an even number, for every core of the machine to get a share where the matrix
    has rows for it (at least 64 rows a tile): a 576-row matrix made three tiles for two
    threads, one of them idle a third of the time. From the shape and the machine's core
    count, never from the kernels' thread count, which follows the load (threads.py): the
    tiles decide the bits, so a prompt gives the same bits whatever the load."""
    most = max(16, TILE_BYTES // (4 * n_in) // 16 * 16)
    tiles = max(1, math.ceil(out / most), min(os.cpu_count() or 1, out // 64))
    while True:
        rows = max(16, math.ceil(out / tiles / 16) * 16)
        made = math.ceil(out / rows)  # rounding rows up to 16 can make one tile fewer
        if made == 1 or made % 2 == 0 or rows == 16:
            return rows
        tiles += 1


_local = threading.local()


def _tile_buffer(rows: int, n_in: int) -> np.ndarray:
    """This thread's dequantization buffer (kept: a fresh 1 MB buffer page-faults each call)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < rows * n_in:
        buf = _local.buf = np.empty(rows * n_in, np.float32)
    return buf[:rows * n_in].reshape(rows, n_in)


def _tile_kernel(t: QTensor):
    """(kernel, its arguments before r0, nr, buf) dequantizing rows of t for a BLAS tile; None
    for f32 weights, which need none."""
    s = t.scheme
    if s in TYPE_CODE:
        return deq_block_tile, (TYPE_CODE[s], t.q)
    if s in INT4_SCHEMES:
        return _deq_int4_tile, tuple(int4_args(t))
    if s == "q8_0":
        return _deq_q8_tile, (t.q, t.scales, GROUP_SIZE[s], t.interleave)
    if s == "f32":
        return None
    return _deq_u16_tile, (t.q.view(np.uint16), s == "bf16")


def _dequantizer(t: QTensor):
    """fn(r0, nr, buf) filling buf[:nr] with rows r0 .. r0+nr of dequantize(t); None for f32."""
    found = _tile_kernel(t)
    if found is None:
        return None
    kernel, head = found
    return lambda r0, nr, buf: kernel(*head, r0, nr, buf)


def blas_tile_call(t: QTensor):
    """(kernel, arguments) of one tile's dequantization, as matmul_blas calls it for t (prompts
    of BLAS_MIN_ROWS tokens or more), or None: what colibri.warmup compiles for long prompts."""
    found = _tile_kernel(t)
    if found is None:
        return None
    kernel, head = found
    rows = min(t.shape[0], 16)
    return kernel, (*head, 0, rows, np.empty((rows, t.shape[1]), np.float32))


def matmul_blas(t: QTensor, x: np.ndarray, y: np.ndarray, nthreads: int) -> None:
    out, n_in = t.shape
    rows = _tile_rows(out, n_in)
    tiles = list(range(0, out, rows))
    deq = _dequantizer(t)
    nth = max(1, min(nthreads, len(tiles)))

    def work(first: int) -> None:
        buf = _tile_buffer(rows, n_in) if deq is not None else None
        for r0 in tiles[first::nth]:
            nr = min(rows, out - r0)
            if deq is None:
                w = t.q[r0:r0 + nr]
            else:
                deq(r0, nr, buf)
                w = buf[:nr]
            y[:, r0:r0 + nr] = x @ w.T

    run_tasks(work, list(range(nth)), nth)


def matmul(t: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ dequantize(t).T: float32 [L, in] -> float32 [L, out_features] (prefill)."""
    check_tensor(t)
    x = checked_x(x, 2, t.shape[1], "matmul")
    y = result_array(out, (x.shape[0], t.shape[0]), "matmul")
    if y.size == 0:
        return y
    nthreads = get_num_threads()
    if x.shape[0] >= BLAS_MIN_ROWS:
        matmul_blas(t, x, y, nthreads)
        return y
    s = t.scheme
    if s in TYPE_CODE:
        _matmul_blocks(TYPE_CODE[s], t.q, x, y, nthreads)
    elif s in INT4_SCHEMES:
        matmul_int4(*int4_args(t), x, y, nthreads)
    elif s == "q8_0":
        _matmul_q8(t.q, t.scales, GROUP_SIZE[s], t.interleave, x, y, nthreads)
    elif s == "f32":
        _matmul_f32(t.q, x, y, nthreads)
    else:
        _matmul_u16(t.q.view(np.uint16), s == "bf16", x, y, nthreads)
    return y
