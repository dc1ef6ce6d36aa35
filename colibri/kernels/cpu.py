"""CPU kernels (numba) over QTensor: matvec for decode (one token, or a few at once with
matvec_rows, each token's result the same bits), embedding lookup (prefill's matmul is in
gemm.py).
Each is checked against `quant.dequantize` (tests/kernels/test_cpu.py); DESIGN.md section 6.

Why the loops look as they do (timings: this repo's 2-core AMD EPYC sandbox, one thread):
- Decode is bound by streaming weights, so matvec never materialises a dequantized row. An
  int4 byte k of a group expands into element k (low nibble) and element k + g/2 (high
  nibble): two contiguous half-group runs of x, which LLVM vectorizes. The offset (-8*s, or
  q4_1's min m) does not depend on the nibble, so it leaves the inner loop:
  dot(w_g, x_g) = s * dot(nib, x_g) + c * sum(x_g), with the group sums of x taken once
  per call and c = -8*s (symmetric) or m (q4_1).
- Quantized matvec works on blocks of eight rows that share each load of x, with per-lane
  accumulators kept across groups and reduced once per row. Its inner loop is written as LLVM
  vector IR (_block8_codegen): the same loop in numba kept the accumulators in memory and ran
  2-2.6x slower; with the next block's bytes prefetched it streams int4 weights at ~85-100% of
  the measured read bandwidth (README, Measured).
- Nibble, int8 and half-float decoding are LLVM IR intrinsics: numba widens small integers
  to int64, and int64->float conversion is slow in SIMD (absent on AVX2); ~35% measured.
- Every kernel is parallel over output rows (prange); the wrappers check shapes and dtypes
  so that numba only ever sees contiguous arrays of the expected types.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .quant import GROUP_SIZE, INT4_SCHEMES, INTERLEAVED_SCHEMES, PAIR_ROW_BYTES, SCHEMES, QTensor

# reassoc lets LLVM split each reduction over vector lanes; contract fuses to FMA. Sums
# change only by float32 rounding.
_FAST = {"reassoc", "contract", "nsz"}

_I32 = ir.IntType(32)


def _i32(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


# --- bit-level decoding, written in LLVM IR so every lane stays 32 bits wide -------------


@intrinsic
def _nib_lo(typingctx, b):
    """uint8 -> float32 of its low nibble."""
    def codegen(context, builder, sig, args):
        v = builder.and_(builder.zext(args[0], _I32), _i32(15))
        return builder.uitofp(v, ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def _nib_hi(typingctx, b):
    """uint8 -> float32 of its high nibble."""
    def codegen(context, builder, sig, args):
        v = builder.lshr(builder.zext(args[0], _I32), _i32(4))
        return builder.uitofp(v, ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def _i8(typingctx, b):
    """int8 -> float32 through int32 lanes."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(builder.sext(args[0], _I32), ir.FloatType())
    return types.float32(types.int8), codegen


@intrinsic
def _bf16(typingctx, h):
    """Raw bfloat16 bits (uint16) -> float32: the bits are the top half of a float32."""
    def codegen(context, builder, sig, args):
        v = builder.shl(builder.zext(args[0], _I32), _i32(16))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _f16(typingctx, h):
    """Raw IEEE half bits (uint16) -> float32, exact for every input (numba has no float16).

    Integer-only (no F16C dependence, no libcall): rebias the exponent; half subnormals are
    renormalised by subtracting 2^-14 in float32 (exact, and never touches float32
    subnormals); inf/NaN get the float32 all-ones exponent.
    """
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        h = builder.zext(args[0], _I32)
        o = builder.shl(builder.and_(h, _i32(0x7FFF)), _i32(13))
        exp = builder.and_(o, _i32(0x0F800000))
        o = builder.add(o, _i32(112 << 23))
        o_special = builder.add(o, _i32(112 << 23))
        o_sub = builder.fsub(builder.bitcast(builder.add(o, _i32(1 << 23)), f32),
                             ir.Constant(f32, 2.0 ** -14))
        o_sub = builder.bitcast(o_sub, _I32)
        o = builder.select(builder.icmp_unsigned("==", exp, _i32(0x0F800000)), o_special, o)
        o = builder.select(builder.icmp_unsigned("==", exp, _i32(0)), o_sub, o)
        o = builder.or_(o, builder.shl(builder.and_(h, _i32(0x8000)), _i32(16)))
        return builder.bitcast(o, f32)
    return types.float32(types.uint16), codegen


# --- exact row dequantizers (no fastmath: embedding equals quant.dequantize bit for bit) --


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
                dst[x0 + k] = _nib_lo(b) * s + m
                dst[x0 + half + k] = _nib_hi(b) * s + m
        else:
            for k in range(half):
                b = qr[b0 + k]
                dst[x0 + k] = (_nib_lo(b) - np.float32(8.0)) * s
                dst[x0 + half + k] = (_nib_hi(b) - np.float32(8.0)) * s


@njit(cache=True, nogil=True)
def interleave_in_place(q, width):
    """q [rows, row_bytes] (row-major int4 or q8_0 bytes) rewritten interleaved in blocks of `width`
    rows (quant.py, Layout; quant.interleaved is the numpy reference), one block at a time
    through a buffer of one block: a loader's repacking at about copy speed, no second copy
    of the matrix. Releases the GIL (expert readers repack in their own threads)."""
    rows, rb = q.shape
    flat = q.reshape(-1)
    nfull = rb // 64
    tail = rb - 64 * nfull
    buf = np.empty(width * rb, q.dtype)
    for g in range(rows // width):
        start = g * width * rb
        buf[:] = flat[start:start + width * rb]
        for jj in range(width):
            src = jj * rb
            for k in range(nfull):
                dst = start + k * 64 * width + jj * 64
                flat[dst:dst + 64] = buf[src + 64 * k:src + 64 * k + 64]
            dst = start + nfull * 64 * width + jj * tail
            flat[dst:dst + tail] = buf[src + 64 * nfull:src + rb]


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
def _deq_int4_row_at(q, scales, mins, half, has_min, ilv, r, dst):
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
def _deq_q8_row_at(q, scales, group, ilv, r, dst):
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
            dst[x0 + k] = _i8(qr[x0 + k]) * s


@njit(cache=True)
def _deq_u16_row(wr, is_bf16, dst):
    if is_bf16:
        for k in range(wr.shape[0]):
            dst[k] = _bf16(wr[k])
    else:
        for k in range(wr.shape[0]):
            dst[k] = _f16(wr[k])


# --- matvec: the decode hot path ---------------------------------------------------------


# The hot path of decode, written as LLVM vector IR. A call computes a tile of weight rows x
# activation rows, y[a, r + j] = sum_g s[r+j, g] * dot(w_g, x_a,g) (before the offset term),
# walking the rows 16 bytes at a time: the tile's <16 x float> accumulators stay in registers
# for the whole row (a numba loop kept them in memory and paid its per-group loop set-up:
# 2-2.6x slower from cache), each 16-byte load of a weight row is widened once and shared by
# the tile's activation rows, each load of x by its weight rows, and the same bytes of the
# next block's rows are prefetched (eight row streams are too many for the hardware
# prefetcher: int4 from DRAM went 30 -> 48 GB/s).
# One-token decode uses 8 x 1 tiles; several tokens at once (a batch, drafted tokens) use
# 4 x 4 tiles, so each weight byte is unpacked once for four tokens.
# Rows take their whole 64-byte blocks first (int4: _int4_block, below), then the chunks left;
# the blocks are found through the matrix's row interleaving (quant.py, Layout), which moves
# bytes only: the operations below are the same on either layout.
# Every (weight row, activation row) pair gets the same operations in the same order whatever
# the tile: per block t = sum_k n_k x'_k, acc = fmuladd(t, s, acc), per remaining chunk
# t = fmuladd(hi, xh, lo * xl), acc = fmuladd(t, s, acc) (int4), or acc = fmuladd(q * s, x,
# acc) (int8), then a fixed tree over the lanes. So a token's result does not depend on the
# tile, the threads, or what else shares its pass. Only generic LLVM vector operations are
# used, so this compiles for whatever vector width the host has (LLVM splits <16 x float>
# into two AVX2 registers where AVX-512 is missing).

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_I8 = ir.IntType(8)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V16B = ir.VectorType(_I8, 16)


def _i64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, _i32(0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _hsum(builder, v):
    """Sum of a vector's lanes by halving: ((l0+l8)+(l4+l12))+... (fixed order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _i32(0))


# An int4 row's whole 64-byte blocks (128 weights, 4 chunks) are read as sixteen 32-bit lanes
# of four bytes, eight nibbles each. Nibble k of every lane is masked in place
# (lane & 15 << 4k, a whole number n * 16^k, exact in float32) and converted; the activations
# were scaled by 16^-k and laid out to match beforehand (_prepare_x_into), so each product is
# n * x rounded once, as before. Per block and weight row: 8 masks (or shifts), 8
# conversions, 8 multiply(-add)s of nibbles by x, one multiply-add by the scales and one
# shuffle spreading them: 26 vector operations where the per-chunk loop below spends 32 (4
# chunks of widen, mask, shift, two conversions, a multiply and two multiply-adds). The loop
# is bound by them where the weights come from cache (one matvec over 54 MB of q4_1 whose
# rows repeat, 2 threads: 25.4 -> 29.5 GB/s). A lane's four bytes lie in one chunk, so its
# eight products belong to one group: t = sum_k n_k x'_k, then acc = fmuladd(t, s_lane, acc)
# with the block's 1, 2 or 4 group scales spread over the lanes.
_BLOCK_MASKS = [ir.Constant(_V16I, [15 << (4 * k)] * 16) for k in range(7)]  # nibble 7: a shift


def _int4_blocks(builder, nfull, cshift, qstep, qrows, srows, xrows, accs, fma, prefetch_next):
    """Blocks 0..nfull-1 of every weight row x every activation row, into the accumulators.
    One loop per group width (cshift 0, 1, 2+), chosen here once rather than per block and
    row: the per-block branch made LLVM spill the scales and accumulators to the stack."""
    def loop(shift, spread: int):
        with cgutils.for_range(builder, nfull) as it:
            _int4_block(builder, it.index, shift, spread, qstep, qrows, srows, xrows, accs, fma, prefetch_next)

    with builder.if_else(builder.icmp_unsigned("==", cshift, _i64(0))) as (four, fewer):
        with four:
            loop(_i64(0), 4)
        with fewer:
            with builder.if_else(builder.icmp_unsigned("==", cshift, _i64(1))) as (two, one):
                with two:
                    loop(_i64(1), 2)
                with one:
                    loop(cshift, 1)


def _int4_block(builder, bi, cshift, spread: int, qstep, qrows, srows, xrows, accs, fma, prefetch_next):
    """Block bi (prepared x floats 128 bi..) of every weight row x every activation row, into
    the accumulators; a row's block bi is at qrows[j] + bi * qstep (quant.py, Layout). The
    block holds `spread` groups (4, 2 or 1: cshift 0, 1 or more)."""
    b = builder.mul(bi, qstep)
    e = builder.shl(bi, _i64(7))
    g0 = builder.lshr(builder.shl(bi, _i64(2)), cshift)  # the block's first group
    xs = [[builder.load(builder.bitcast(builder.gep(row, [builder.add(e, _i64(16 * k))]), _V16F.as_pointer()), align=4)
           for k in range(8)] for row in xrows]
    prefetch_next(b, g0)
    for j in range(len(qrows)):
        raw = builder.load(builder.bitcast(builder.gep(qrows[j], [b]), _V16I.as_pointer()), align=1)
        s = _block_scales(builder, srows[j], g0, spread)
        ns = [builder.sitofp(builder.and_(raw, m), _V16F) for m in _BLOCK_MASKS]
        ns.append(builder.sitofp(builder.lshr(raw, ir.Constant(_V16I, [28] * 16)), _V16F))
        for a, x in enumerate(xs):
            t = builder.fmul(ns[0], x[0])
            for k in range(1, 8):
                t = builder.call(fma, [ns[k], x[k], t])
            builder.store(builder.call(fma, [t, s, builder.load(accs[j][a])]), accs[j][a])


def _block_scales(builder, srow, g0, spread: int):
    """<16 x float> of lane i's group scale in a block of `spread` groups from group g0: four
    groups of 32 (lanes 4c..4c+3 are chunk c), two of 64, or one."""
    if spread == 1:
        return _splat(builder, builder.load(builder.gep(srow, [g0])), _V16F)
    return _spread(builder, srow, g0, spread)


def _spread(builder, srow, g0, n):
    """Scales g0..g0+n-1 of a row, each over 16/n consecutive lanes."""
    vty = ir.VectorType(_F32, n)
    v = builder.load(builder.bitcast(builder.gep(srow, [g0]), vty.as_pointer()), align=4)
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, 16), [i * n // 16 for i in range(16)]))


def _q_row_ptrs(builder, qbase, qstride, nfull, ilv, row, j):
    """(block pointer, tail pointer) of q's row `row + j`, its rows interleaved in blocks of ilv
    (quant.py, Layout): row rr = G * ilv + jj has its 64-byte block k at G * ilv * qstride +
    k * 64 * ilv + jj * 64 and its tail (the L bytes past its last whole block) at
    G * ilv * qstride + nfull * 64 * ilv + jj * L. The pointers are such that a kernel adds
    k * 64 * ilv to the first for block k, and a chunk's byte offset in the row to the second,
    as it adds k * 64 and the offset to a row-major row's start (ilv 1: both are the start).
    ilv is a power of two: a row's place in its block is a mask, no division."""
    rr = builder.add(row, _i64(j))
    jj = builder.and_(rr, builder.sub(ilv, _i64(1)))
    start = builder.mul(builder.sub(rr, jj), qstride)  # (rr // ilv) * ilv rows in
    blocks = builder.add(start, builder.shl(jj, _i64(6)))
    tail = builder.sub(qstride, builder.shl(nfull, _i64(6)))
    tails = builder.add(builder.add(start, builder.mul(builder.shl(nfull, _i64(6)), builder.sub(ilv, _i64(1)))),
                        builder.mul(jj, tail))
    return builder.gep(qbase, [blocks]), builder.gep(qbase, [tails])


def _tile_codegen(nibbles: bool, wrows: int, arows: int):
    """Codegen of a (q, scales, offs, r, rn, x, a0, half_or_group, cshift, ilv, out) -> None
    intrinsic over weight rows r..r+wrows-1 and activation rows a0..a0+arows-1.

    nibbles: q is int4 (byte k of a group holds element k low, k + half high) with
    half = group / 2 bytes per group, its rows interleaved in blocks of `ilv` (1: row-major;
    quant.py, Layout); else q is int8, one element per byte, row-major (ilv 1).
    cshift = log2(16-byte chunks per group); every group is a whole number of chunks.
    x is one activation row [n] (arows 1) or rows [B, n]. For a one-row x, out[a0 + j]
    receives weight row r + j; else out [>= arows, >= wrows] receives out[a, j] for activation
    row a0 + a and weight row r + j. Rows rn.. of q, scales and offs (q4_1's mins, shaped like scales; the
    caller adds their term) are prefetched (pass rn = r on the last block); offs may be scales.
    """
    def codegen(context, builder, sig, args):
        qty, sty, oty_, _, _, xty, _, _, _, _, oty = sig.args
        qa = context.make_array(qty)(context, builder, args[0])
        sa = context.make_array(sty)(context, builder, args[1])
        ma = context.make_array(oty_)(context, builder, args[2])
        xa = context.make_array(xty)(context, builder, args[5])
        oa = context.make_array(oty)(context, builder, args[10])
        r, rn, a0, gbytes, cshift, ilv = args[3], args[4], args[6], args[7], args[8], args[9]
        qstride = cgutils.unpack_tuple(builder, qa.strides, 2)[0]
        ngroups = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
        nchunks = builder.lshr(builder.mul(ngroups, gbytes), _i64(4))
        nfull = builder.lshr(nchunks, _i64(2))  # whole 64-byte blocks a row
        qbase = builder.bitcast(qa.data, _I8.as_pointer())
        sbase = builder.bitcast(sa.data, _F32.as_pointer())
        xbase = builder.bitcast(xa.data, _F32.as_pointer())
        obase = builder.bitcast(oa.data, _F32.as_pointer())
        if xty.ndim == 2:  # activation row a starts (a0 + a) * n floats in
            n = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            xrows = [builder.gep(xbase, [builder.mul(builder.add(a0, _i64(a)), n)]) for a in range(arows)]
            ocols = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
        else:
            xrows, ocols = [xbase], None

        def row_ptr(base, row, j, stride):
            return builder.gep(base, [builder.mul(builder.add(row, _i64(j)), stride)])

        qstep = builder.shl(ilv, _i64(6))  # from a row's block k to its block k + 1
        qrows, qtails = zip(*(_q_row_ptrs(builder, qbase, qstride, nfull, ilv, r, j) for j in range(wrows)))
        nrows, ntails = zip(*(_q_row_ptrs(builder, qbase, qstride, nfull, ilv, rn, j) for j in range(wrows)))
        srows = [row_ptr(sbase, r, j, ngroups) for j in range(wrows)]
        nsrows = [row_ptr(sbase, rn, j, ngroups) for j in range(wrows)]
        mbase = builder.bitcast(ma.data, _F32.as_pointer())
        nmrows = [row_ptr(mbase, rn, j, ngroups) for j in range(wrows)]
        has_offs = builder.icmp_unsigned("!=", mbase, sbase)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(arows)]
                for _ in range(wrows)]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                             "llvm.fmuladd.v16f32")
        pf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0")

        def prefetch(base, index):  # read, keep in all cache levels, data
            builder.call(pf, [builder.bitcast(builder.gep(base, [index]), _I8.as_pointer()), _i32(0), _i32(3), _i32(1)])

        cmask = builder.sub(builder.shl(_i64(1), cshift), _i64(1))

        def load_x(row, offset):
            return builder.load(builder.bitcast(builder.gep(row, [offset]), _V16F.as_pointer()), align=4)

        def prefetch_next(b, g, q_next=nrows):  # the next rows: weights at q_next[j] + b, scales (and mins) at group g
            for j in range(wrows):
                prefetch(q_next[j], b)
            for j in range(wrows):
                prefetch(nsrows[j], g)
            with builder.if_then(has_offs):
                for j in range(wrows):
                    prefetch(nmrows[j], g)

        def chunk(i, q_at, q_next, qoff, prefetch_here):
            """16-byte chunk i of every weight row (at q_at[j] + qoff) x every activation row;
            prefetch_here: a builder condition, or True / False known now."""
            g = builder.lshr(i, cshift)
            b = builder.shl(i, _i64(4))  # byte offset in the row
            if nibbles:  # low nibbles pair with x[2*g*half + c*16 ...], high ones half later
                xo = builder.add(builder.mul(g, builder.shl(gbytes, _i64(1))),
                                 builder.shl(builder.and_(i, cmask), _i64(4)))
                xs = [(load_x(row, xo), load_x(row, builder.add(xo, gbytes))) for row in xrows]
            else:
                xs = [(load_x(row, b), None) for row in xrows]
            # One prefetch per row per 64-byte line (every 4th chunk), not per chunk: a
            # prefetch is an instruction like any other, and 24 per chunk were a third of the
            # one-token tile's.
            if prefetch_here is True:
                prefetch_next(qoff, g, q_next)
            elif prefetch_here is not False:
                with builder.if_then(prefetch_here):
                    prefetch_next(qoff, g, q_next)
            for j in range(wrows):
                raw = builder.load(builder.bitcast(builder.gep(q_at[j], [qoff]), _V16B.as_pointer()), align=1)
                if nibbles:
                    w = builder.zext(raw, _V16I)
                    lo = builder.uitofp(builder.and_(w, ir.Constant(_V16I, [15] * 16)), _V16F)
                    hi = builder.uitofp(builder.lshr(w, ir.Constant(_V16I, [4] * 16)), _V16F)
                else:
                    lo = builder.sitofp(raw, _V16F)
                s = _splat(builder, builder.load(builder.gep(srows[j], [g])), _V16F)
                if nibbles:
                    for a, (xl, xh) in enumerate(xs):
                        t = builder.call(fma, [hi, xh, builder.fmul(lo, xl)])
                        builder.store(builder.call(fma, [t, s, builder.load(accs[j][a])]), accs[j][a])
                else:  # int8: scaled once per weight row, then one fused multiply-add per pair
                    w = builder.fmul(lo, s)
                    for a, (xl, _) in enumerate(xs):
                        builder.store(builder.call(fma, [w, xl, builder.load(accs[j][a])]), accs[j][a])

        # Whole 64-byte blocks first, at qrows[j] + k * qstep: int4 through _int4_block (x
        # prepared by _prepare_x_into), int8 as four chunks; then the tail's chunks.
        c0 = builder.shl(nfull, _i64(2))
        if nibbles:
            _int4_blocks(builder, nfull, cshift, qstep, qrows, srows, xrows, accs, fma, prefetch_next)
        else:
            with cgutils.for_range(builder, nfull) as loop:
                qoff = builder.mul(loop.index, qstep)
                for c in range(4):
                    chunk(builder.add(builder.shl(loop.index, _i64(2)), _i64(c)), qrows, nrows,
                          builder.add(qoff, _i64(16 * c)), c == 0)
        with cgutils.for_range(builder, builder.sub(nchunks, c0)) as loop:
            i = builder.add(c0, loop.index)
            chunk(i, qtails, ntails, builder.shl(i, _i64(4)),
                  builder.icmp_unsigned("==", builder.and_(i, _i64(3)), _i64(0)))
        for j in range(wrows):
            for a in range(arows):
                at = builder.add(a0, _i64(j)) if ocols is None else builder.add(builder.mul(_i64(a), ocols), _i64(j))
                builder.store(_hsum(builder, builder.load(accs[j][a])), builder.gep(obase, [at]))
        return context.get_dummy_value()
    return codegen


def _one_row_tile(wrows: int, nibbles: bool):
    """An intrinsic over `wrows` weight rows r.. times one activation row, into out[o:o + wrows]
    (see _tile_codegen)."""
    if nibbles:
        def tile(typingctx, q, scales, offs, r, rn, x, half, cshift, ilv, out, o):
            sig = types.void(q, scales, offs, types.intp, types.intp, x, types.intp, types.intp, types.intp, out,
                             types.intp)

            def codegen(context, builder, sig_, args):
                full = types.void(q, scales, offs, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                                  types.intp, out)
                return _tile_codegen(True, wrows, 1)(context, builder, full, [*args[:6], args[10], *args[6:10]])
            return sig, codegen
    else:
        def tile(typingctx, q, scales, r, rn, x, group, cshift, ilv, out, o):
            sig = types.void(q, scales, types.intp, types.intp, x, types.intp, types.intp, types.intp, out,
                             types.intp)

            def codegen(context, builder, sig_, args):  # no offsets: scales stand in for them
                full = types.void(q, scales, scales, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                                  types.intp, out)
                return _tile_codegen(False, wrows, 1)(context, builder, full,
                                                      [args[0], args[1], args[1], *args[2:5], args[9], *args[5:9]])
            return sig, codegen
    tile.__name__ = tile.__qualname__ = f"_{'int4' if nibbles else 'q8'}_dot{wrows}"
    return intrinsic(tile)


_int4_dot8, _int4_dot2 = _one_row_tile(8, True), _one_row_tile(2, True)

# Rows of at least this many bytes (int4 in _int4_rows8, q8_0 in _matvec_q8) go through an
# 8-row block two rows at a time. From DRAM (`python -m bench.kernels.row_stream`: 0.8 GiB of random
# bytes, calls of 6144 rows after a cache flush, 2 threads), eight interleaved 1 KB int4 rows
# (2048 inputs: Qwen3's q/k/v, gate and up) read at 16 GB/s on this VM where two read at 19;
# int4 rows of 288-384 bytes read 15-25% faster eight at a time, 2 KB rows the same either
# way; q8_0 rows of 1, 2 and 7 KB read 20 -> 28, 22 -> 25 and 26 -> 27 GB/s two at a time,
# 576-byte ones the same. Eight rows share each load of x, two rows share it less, which only
# pays where the reads are the limit. A row's operations do not depend on how many rows share
# its pass, so the bits are the same either way.
# (PAIR_ROW_BYTES lives in quant.py: it is also the block of rows a matrix is
# interleaved in, quant.interleave_width.)


_q8_dot8, _q8_dot2 = _one_row_tile(8, False), _one_row_tile(2, False)


# Tiles for several activation rows: TILE_W weight rows x 1..TILE_A activation rows (one
# intrinsic per activation count; the accumulators, TILE_W * TILE_A vectors, must stay in
# registers: 16 of AVX-512's 32).
TILE_W, TILE_A = 4, 4


def _tile_intrinsic(nibbles: bool, arows: int):
    if nibbles:
        def tile(typingctx, q, scales, offs, r, rn, x, a0, half, cshift, ilv, out):
            sig = types.void(q, scales, offs, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                             types.intp, out)
            return sig, _tile_codegen(True, TILE_W, arows)
    else:
        def tile(typingctx, q, scales, r, rn, x, a0, group, cshift, ilv, out):
            sig = types.void(q, scales, types.intp, types.intp, x, types.intp, types.intp, types.intp, types.intp,
                             out)

            def codegen(context, builder, sig_, args):
                full = types.void(q, scales, scales, types.intp, types.intp, x, types.intp, types.intp,
                                  types.intp, types.intp, out)
                return _tile_codegen(False, TILE_W, arows)(context, builder, full, [args[0], args[1], *args[1:]])
            return sig, codegen
    tile.__name__ = tile.__qualname__ = f"_{'int4' if nibbles else 'q8'}_tile{arows}"
    return intrinsic(tile)


_int4_tile1, _int4_tile2, _int4_tile3, _int4_tile4 = (_tile_intrinsic(True, n) for n in range(1, TILE_A + 1))
_q8_tile1, _q8_tile2, _q8_tile3, _q8_tile4 = (_tile_intrinsic(False, n) for n in range(1, TILE_A + 1))


# The small reductions around the int4 dot products (group sums of x, the offset term, a tail
# row's lane sum) are written out in one fixed order, without fastmath: a fastmath loop is
# vectorized as LLVM sees fit in each function it is inlined into, so the same row could round
# differently in the one-row kernel, the multi-row kernel and the fused MoE kernel. With a
# written order every kernel computes a (weight row, activation row) pair with the same
# operations, and batching never changes a bit (tests/kernels/test_rows.py).


@njit(cache=True)
def _group_sums_into(x, group, xs):
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
def _group_sums(x, group):
    xs = np.empty(x.shape[0] // group, np.float32)
    _group_sums_into(x, group, xs)
    return xs


def _block_source(bi: int, m: int, cshift: int) -> int:
    """The element of x that prepared position 128 bi + m stands for (see _prepare_x_into)."""
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
def _prepare_x_into(x, half, xp):
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
def _prepare_x(x, half):
    xp = np.empty_like(x)
    _prepare_x_into(x, half, xp)
    return xp


def _offset_sums(context, builder, offsty, offs, r, xsty, xs, rows: int) -> list:
    """sum_g offs[r + j, g] * xs[g] for j < rows, each in a fixed order: 16 lanes over the
    groups (a fused multiply-add per 16 groups), the lanes summed by _hsum's tree, then the
    groups past the last 16 in order, the rows' chains side by side. A loop in numba without
    fastmath is one dependency chain (a row has up to hundreds of groups); with fastmath its
    order would depend on where it is inlined."""
    oa = context.make_array(offsty)(context, builder, offs)
    xa = context.make_array(xsty)(context, builder, xs)
    stride = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
    n = cgutils.unpack_tuple(builder, xa.shape, 1)[0]  # 0 for q8_0, which has no offsets
    obase = builder.bitcast(oa.data, _F32.as_pointer())
    orows = [builder.gep(obase, [builder.mul(builder.add(r, _i64(j)), stride)]) for j in range(rows)]
    xbase = builder.bitcast(xa.data, _F32.as_pointer())
    fma16 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fmuladd.v16f32")
    fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fmuladd.f32")
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(rows)]

    def load16(base, i):
        return builder.load(builder.bitcast(builder.gep(base, [i]), _V16F.as_pointer()), align=4)

    nvec = builder.lshr(n, _i64(4))
    with cgutils.for_range(builder, nvec) as loop:
        i = builder.shl(loop.index, _i64(4))
        xv = load16(xbase, i)
        for j in range(rows):
            builder.store(builder.call(fma16, [load16(orows[j], i), xv, builder.load(accs[j])]), accs[j])
    totals = [cgutils.alloca_once_value(builder, _hsum(builder, builder.load(a))) for a in accs]
    with cgutils.for_range(builder, builder.sub(n, builder.shl(nvec, _i64(4)))) as loop:
        g = builder.add(builder.shl(nvec, _i64(4)), loop.index)
        xg = builder.load(builder.gep(xbase, [g]))
        for j in range(rows):
            o = builder.load(builder.gep(orows[j], [g]))
            builder.store(builder.call(fma1, [o, xg, builder.load(totals[j])]), totals[j])
    return [builder.load(t) for t in totals]


@intrinsic
def _offset_dot(typingctx, offs, r, xs):
    """sum_g offs[r, g] * xs[g] in _offset_sums' order."""
    def codegen(context, builder, sig, args):
        return _offset_sums(context, builder, sig.args[0], args[0], args[1], sig.args[2], args[2], 1)[0]
    return types.float32(offs, types.intp, xs), codegen


def _with_offsets_intrinsic(rows: int):
    """An intrinsic (d, offs, r, coef, xs): d[j] = d[j] + coef * _offset_dot(offs, r + j, xs)
    for j < rows: the same bits as `rows` _with_offset calls, with the rows' sums side by side
    (_offset_sums). One row at a time, each row's last groups (past its last 16) are a chain of
    dependent multiply-adds, and eight such chains one after another cost as much as a fifth of
    a 960-input row's time; side by side they overlap."""
    def with_offsets(typingctx, d, offs, r, coef, xs):
        def codegen(context, builder, sig, args):
            totals = _offset_sums(context, builder, sig.args[1], args[1], args[2], sig.args[4], args[4], rows)
            dbase = builder.bitcast(context.make_array(sig.args[0])(context, builder, args[0]).data, _F32.as_pointer())
            coef_ = args[3]
            for j, total in enumerate(totals):  # dot + coef * total: a multiply, then an add, as numba does
                at = builder.gep(dbase, [_i64(j)])
                builder.store(builder.fadd(builder.load(at), builder.fmul(coef_, total)), at)
            return context.get_dummy_value()
        if coef != types.float32:  # float32 arithmetic, as _with_offset's is for a float32 coef
            return None
        return types.void(d, offs, types.intp, coef, xs), codegen
    with_offsets.__name__ = with_offsets.__qualname__ = f"_with_offsets{rows}"
    return intrinsic(with_offsets)


@njit(cache=True)
def _with_offset(dot, offs, r, coef, xs):
    """dot + coef * sum_g offs[r, g] * xs[g] (the offset term of q4_1's mins, or of the
    symmetric schemes' -8)."""
    return dot + coef * _offset_dot(offs, r, xs)


_with_offsets8 = _with_offsets_intrinsic(8)
_with_offsets_tile = _with_offsets_intrinsic(TILE_W)  # _matmul_rows_int4


@njit(cache=True)
def _finish(acc, offs, r, coef, xs):
    """A tail row: the sum of its lane accumulators in order, plus the offset term."""
    a = np.float32(0.0)
    for k in range(acc.shape[0]):
        a += acc[k]
    return _with_offset(a, offs, r, coef, xs)


def _chunk_shift(group_bytes: int) -> int:
    """log2 of the 16-byte chunks in a group's bytes (16 -> 0, 32 -> 1)."""
    chunks = group_bytes // 16
    if chunks * 16 != group_bytes or chunks & (chunks - 1):
        raise ValueError(f"group of {group_bytes} bytes is not a power-of-two number of 16-byte chunks")
    return chunks.bit_length() - 1


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
            acc[k] += (_nib_lo(c) * x[x0 + k] + _nib_hi(c) * x[x0 + half + k]) * s


@njit(cache=True)
def _int4_rows8(q, scales, offs, coef, half, cshift, ilv, xp, xs, r, d):
    """d[0:8] = rows r..r+7 of the int4 matvec (xp: x prepared by _prepare_x, xs: group sums
    of x; q's rows interleaved in blocks of ilv), the next block's rows prefetched. Shared by
    the matvec here and the fused MoE kernel in moe.py."""
    out = q.shape[0]
    rn = r + 8 if r + 16 <= out else r
    if q.shape[1] >= PAIR_ROW_BYTES:
        for p in range(0, 8, 2):
            _int4_dot2(q, scales, offs, r + p, r + p + 2 if p < 6 else rn, xp, half, cshift, ilv, d, p)
    else:
        _int4_dot8(q, scales, offs, r, rn, xp, half, cshift, ilv, d, 0)
    _with_offsets8(d, offs, r, coef, xs)


@njit(cache=True)
def _int4_tail_rows(q, scales, offs, coef, half, x, xs, y):
    """The last rows (out % 8) one at a time (row-major: an interleaved q has none)."""
    out = q.shape[0]
    acc1 = np.empty(half, np.float32)
    for r in range(out - out % 8, out):
        _int4_row(q, scales, r, half, x, acc1)
        y[r] = _finish(acc1, offs, r, coef, xs)


@njit(parallel=True, cache=True)
def _matvec_int4(q, scales, offs, coef, half, cshift, ilv, x, y, nthreads):
    """int4_g64 / q4_0 / q4_1: y[r] = sum_g s[r,g] * dot(nib, x_g) + coef * dot(offs[r], xsum).

    Symmetric schemes pass offs = scales, coef = -8 (w = (nib - 8) * s); q4_1 passes
    offs = mins, coef = 1 (w = nib * d + m).
    """
    out = q.shape[0]
    xs = _group_sums(x, 2 * half)
    xp = _prepare_x(x, half)
    nblk = out // 8
    per = (nblk + nthreads - 1) // nthreads
    # A contiguous run of blocks per thread, so each thread allocates its buffer once.
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            _int4_rows8(q, scales, offs, coef, half, cshift, ilv, xp, xs, r, d)
            for j in range(8):
                y[r + j] = d[j]
    _int4_tail_rows(q, scales, offs, coef, half, x, xs, y)


@njit(cache=True)
def _int4_tile(q, scales, offs, r, rn, x, a0, na, half, cshift, ilv, d):
    if na == 4:
        _int4_tile4(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)
    elif na == 3:
        _int4_tile3(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)
    elif na == 2:
        _int4_tile2(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)
    else:
        _int4_tile1(q, scales, offs, r, rn, x, a0, half, cshift, ilv, d)


@njit(parallel=True, cache=True)
def _matmul_rows_int4(q, scales, offs, coef, half, cshift, ilv, x, y, nthreads):
    """y [B, out] = x [B, n] @ W.T for a few tokens (batched decode, drafted tokens): row a of
    y equals _matvec_int4(x[a]) bit for bit (_tile_codegen), each weight chunk unpacked once
    per tile of TILE_W weight rows x up to TILE_A tokens."""
    out, B = q.shape[0], x.shape[0]
    xs = np.empty((B, scales.shape[1]), np.float32)
    xp = np.empty_like(x)
    for a in range(B):
        _group_sums_into(x[a], 2 * half, xs[a])
        _prepare_x_into(x[a], half, xp[a])
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
                    _with_offsets_tile(d[a], offs, r, coef, xs[a0 + a])
                    for j in range(TILE_W):
                        y[a0 + a, r + j] = d[a, j]
    if out % 8:  # the rows past _matvec_int4's last block of eight: its tail code
        for a in range(B):
            _int4_tail_rows(q, scales, offs, coef, half, x[a], xs[a], y[a])


@njit(cache=True)
def _q8_row(q, scales, r, group, x, acc):
    """A tail row's lane sums, in the fixed order."""
    acc[:] = 0.0
    for g in range(scales.shape[1]):
        x0 = g * group
        s = scales[r, g]
        for k in range(group):
            acc[k] += _i8(q[r, x0 + k]) * x[x0 + k] * s


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
    """q8_0, shaped like _matvec_int4 (no offsets: w = q * d)."""
    out = q.shape[0]
    nblk = out // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            rn = r + 8 if r + 16 <= out else r
            if q.shape[1] >= PAIR_ROW_BYTES:
                for p in range(0, 8, 2):
                    _q8_dot2(q, scales, r + p, r + p + 2 if p < 6 else rn, x, group, cshift, ilv, y, r + p)
            else:
                _q8_dot8(q, scales, r, rn, x, group, cshift, ilv, y, r)
    _q8_tail_rows(q, scales, group, x, y)


@njit(cache=True)
def _q8_tile(q, scales, r, rn, x, a0, na, group, cshift, ilv, d):
    if na == 4:
        _q8_tile4(q, scales, r, rn, x, a0, group, cshift, ilv, d)
    elif na == 3:
        _q8_tile3(q, scales, r, rn, x, a0, group, cshift, ilv, d)
    elif na == 2:
        _q8_tile2(q, scales, r, rn, x, a0, group, cshift, ilv, d)
    else:
        _q8_tile1(q, scales, r, rn, x, a0, group, cshift, ilv, d)


@njit(parallel=True, cache=True)
def _matmul_rows_q8(q, scales, group, cshift, ilv, x, y, nthreads):
    """q8_0's _matmul_rows_int4: row a of y equals _matvec_q8(x[a]) bit for bit."""
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


@njit(cache=True, fastmath=_FAST)
def _f32_rows_dot4(w, r, x, y, yl, y0):
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


@njit(cache=True, fastmath=_FAST)
def _f32_row_dot(w, r, x):
    a = np.float32(0.0)
    for k in range(x.shape[0]):
        a += w[r, k] * x[k]
    return a


@njit(parallel=True, cache=True, fastmath=_FAST)
def _matvec_f32(w, x, y):
    out = w.shape[0]
    y2 = y.reshape((1, out))
    for blk in prange((out + 3) // 4):
        r = 4 * blk
        if r + 4 > out:
            for rr in range(r, out):
                y[rr] = _f32_row_dot(w, rr, x)
        else:
            _f32_rows_dot4(w, r, x, y2, 0, r)


@njit(cache=True, fastmath=_FAST)
def _u16_row_dot(w, r, is_bf16, x):
    a = np.float32(0.0)
    if is_bf16:
        for k in range(x.shape[0]):
            a += _bf16(w[r, k]) * x[k]
    else:
        for k in range(x.shape[0]):
            a += _f16(w[r, k]) * x[k]
    return a


@njit(parallel=True, cache=True, fastmath=_FAST)
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
                a0 += _bf16(w[r, k]) * xk
                a1 += _bf16(w[r + 1, k]) * xk
                a2 += _bf16(w[r + 2, k]) * xk
                a3 += _bf16(w[r + 3, k]) * xk
        else:
            for k in range(x.shape[0]):
                xk = x[k]
                a0 += _f16(w[r, k]) * xk
                a1 += _f16(w[r + 1, k]) * xk
                a2 += _f16(w[r + 2, k]) * xk
                a3 += _f16(w[r + 3, k]) * xk
        y[r] = a0
        y[r + 1] = a1
        y[r + 2] = a2
        y[r + 3] = a3


# --- embedding ----------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _embed_int4(q, scales, mins, half, has_min, ilv, ids, y):
    for i in prange(ids.shape[0]):
        _deq_int4_row_at(q, scales, mins, half, has_min, ilv, ids[i], y[i])


@njit(parallel=True, cache=True)
def _embed_q8(q, scales, group, ilv, ids, y):
    for i in prange(ids.shape[0]):
        _deq_q8_row_at(q, scales, group, ilv, ids[i], y[i])


@njit(parallel=True, cache=True)
def _embed_u16(w, is_bf16, ids, y):
    for i in prange(ids.shape[0]):
        _deq_u16_row(w[ids[i]], is_bf16, y[i])


# --- Python-level dispatch and checks -----------------------------------------------------


def _check_tensor(t: QTensor) -> None:
    # A tensor is checked once: the engine calls the kernels ~100 times per token on the same
    # weights, and QTensor arrays are not swapped after construction.
    if t.__dict__.get("_checked"):
        return
    _check_tensor_once(t)
    t.__dict__["_checked"] = True


def _check_tensor_once(t: QTensor) -> None:
    if t.scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {t.scheme!r}; known: {', '.join(SCHEMES)}")
    out, n = t.shape
    want = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "q8_0": np.int8}.get(t.scheme, np.uint8)
    qcols = n // 2 if t.scheme in GROUP_SIZE and t.scheme != "q8_0" else n
    if t.q.dtype != want or t.q.shape != (out, qcols) or not t.q.flags.c_contiguous:
        raise ValueError(
            f"{t.scheme} tensor of shape {t.shape} needs q as C-contiguous {np.dtype(want).name} "
            f"[{out}, {qcols}], got {t.q.dtype.name} {t.q.shape}"
            + ("" if t.q.flags.c_contiguous else " (not contiguous)")
        )
    ilv = t.interleave
    if ilv != 1 and (t.scheme not in INTERLEAVED_SCHEMES or ilv < 1 or ilv & (ilv - 1) or out % 8 or out % ilv):
        raise ValueError(f"{t.scheme} tensor of shape {t.shape} cannot have its rows interleaved in blocks of "
                         f"{ilv} (int4 and q8_0 only, a power of two dividing the rows, rows a multiple of 8)")
    if t.scheme in GROUP_SIZE:
        g = GROUP_SIZE[t.scheme]
        for name in ("scales", "mins") if t.scheme == "q4_1" else ("scales",):
            a = getattr(t, name)
            if a is None or a.dtype != np.float32 or a.shape != (out, n // g) or not a.flags.c_contiguous:
                raise ValueError(f"{t.scheme} tensor needs {name} as C-contiguous float32 [{out}, {n // g}]")


def _activations(x: np.ndarray, ndim: int, n: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise ValueError(f"{what}: x must be float32, got {x.dtype}; cast it with x.astype(np.float32)")
    if x.ndim != ndim or x.shape[-1] != n:
        want = f"[{n}]" if ndim == 1 else f"[L, {n}]"
        raise ValueError(f"{what}: x must have shape {want} for a weight with {n} inputs, got {x.shape}")
    return np.ascontiguousarray(x)


def _result(out: np.ndarray | None, shape: tuple[int, ...], what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if out.dtype != np.float32 or out.shape != shape or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(
            f"{what}: out must be a writeable C-contiguous float32 array of shape {shape}, "
            f"got {out.dtype} {out.shape}"
        )
    return out


def _int4_args(t: QTensor) -> tuple:
    """The dequantizers' arguments (q, scales, mins, half, has_min, ilv)."""
    has_min = t.scheme == "q4_1"
    # Symmetric schemes have no mins; scales stands in so numba sees one signature.
    return t.q, t.scales, t.mins if has_min else t.scales, GROUP_SIZE[t.scheme] // 2, has_min, t.interleave


def int4_weight(t: QTensor) -> tuple | None:
    """The int4 matvec kernel's weight arguments for t, (q, scales, offs, coef, half, cshift,
    ilv), or None when t is not an int4 scheme (used by matvec and by the fused decode blocks)."""
    if t.scheme not in INT4_SCHEMES:
        return None
    _check_tensor(t)
    half = GROUP_SIZE[t.scheme] // 2
    offs, coef = (t.mins, 1.0) if t.scheme == "q4_1" else (t.scales, -8.0)
    return t.q, t.scales, offs, np.float32(coef), half, _chunk_shift(half), t.interleave


def matvec(t: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = dequantize(t) @ x: float32 [in] -> float32 [out_features] (decode)."""
    _check_tensor(t)
    x = _activations(x, 1, t.shape[1], "matvec")
    y = _result(out, (t.shape[0],), "matvec")
    if t.shape[0] == 0:
        return y
    s = t.scheme
    if s in INT4_SCHEMES:
        _matvec_int4(*int4_weight(t), x, y, get_num_threads())
    elif s == "q8_0":
        group = GROUP_SIZE[s]
        _matvec_q8(t.q, t.scales, group, _chunk_shift(group), t.interleave, x, y, get_num_threads())
    elif s == "f32":
        _matvec_f32(t.q, x, y)
    else:
        _matvec_u16(t.q.view(np.uint16), s == "bf16", x, y)
    return y


def matvec_rows(t: QTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """matvec(t, x[a]) for each row a of x [B, in] -> [B, out_features], the same bits row by
    row, with the weights read once for all rows (batched decode, drafted tokens)."""
    _check_tensor(t)
    x = _activations(x, 2, t.shape[1], "matvec_rows")
    y = _result(out, (x.shape[0], t.shape[0]), "matvec_rows")
    if t.shape[0] == 0 or x.shape[0] == 0:
        return y
    s = t.scheme
    if s in INT4_SCHEMES:
        _matmul_rows_int4(*int4_weight(t), x, y, get_num_threads())
    elif s == "q8_0":
        group = GROUP_SIZE[s]
        _matmul_rows_q8(t.q, t.scales, group, _chunk_shift(group), t.interleave, x, y, get_num_threads())
    else:  # float weights: no unpacking to share
        for a in range(x.shape[0]):
            matvec(t, x[a], out=y[a])
    return y


def embedding(t: QTensor, ids: np.ndarray) -> np.ndarray:
    """Dequantized rows t[ids]: int [L] -> float32 [L, in], equal to dequantize(t)[ids]."""
    _check_tensor(t)
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
        if s in ("int4_g64", "q4_0", "q4_1"):
            _deq_int4_row_at(*_int4_args(t), r, y[0])
        elif s == "q8_0":
            _deq_q8_row_at(t.q, t.scales, GROUP_SIZE[s], t.interleave, r, y[0])
        else:
            _deq_u16_row(t.q.view(np.uint16)[r], s == "bf16", y[0])
        return y
    if s in ("int4_g64", "q4_0", "q4_1"):
        _embed_int4(*_int4_args(t), ids, y)
    elif s == "q8_0":
        _embed_q8(t.q, t.scales, GROUP_SIZE[s], t.interleave, ids, y)
    elif s == "f32":
        np.take(t.q, ids, axis=0, out=y)
    else:
        _embed_u16(t.q.view(np.uint16), s == "bf16", ids, y)
    return y


__all__ = ["matvec", "matvec_rows", "embedding"]
