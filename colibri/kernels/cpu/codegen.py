"""The CPU kernels' LLVM vector IR, emitted through numba intrinsics: the bit-level decoders
(nibbles, int8, bf16, f16 -> float32 in 32-bit lanes), the int4 / q8_0 row tiles of the decode
hot path, and the fixed-order offset sums around them.

Why IR: numba's own loops kept the tile's accumulators in memory (2-2.6x slower from cache)
and widen small integers to int64, whose conversion to float is slow in SIMD (absent on
AVX2). Only generic LLVM vector types are used, so the code compiles to AVX2 or AVX-512,
whichever the host has (docs/design.md section 6).
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .target import narrow_tiles

# reassoc lets LLVM split each reduction over vector lanes; contract fuses to FMA. Sums
# change only by float32 rounding.
FASTMATH = {"reassoc", "contract", "nsz"}

_I32 = ir.IntType(32)


def _i32(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


# --- bit-level decoding, written in LLVM IR so every lane stays 32 bits wide -------------


@intrinsic
def nibble_lo(typingctx, b):
    """uint8 -> float32 of its low nibble."""
    def codegen(context, builder, sig, args):
        v = builder.and_(builder.zext(args[0], _I32), _i32(15))
        return builder.uitofp(v, ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def nibble_hi(typingctx, b):
    """uint8 -> float32 of its high nibble."""
    def codegen(context, builder, sig, args):
        v = builder.lshr(builder.zext(args[0], _I32), _i32(4))
        return builder.uitofp(v, ir.FloatType())
    return types.float32(types.uint8), codegen


@intrinsic
def int8_f32(typingctx, b):
    """int8 -> float32 through int32 lanes."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(builder.sext(args[0], _I32), ir.FloatType())
    return types.float32(types.int8), codegen


@intrinsic
def bf16_f32(typingctx, h):
    """Raw bfloat16 bits (uint16) -> float32: the bits are the top half of a float32."""
    def codegen(context, builder, sig, args):
        v = builder.shl(builder.zext(args[0], _I32), _i32(16))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(types.uint16), codegen


def f16_bits_f32(builder, h):
    """IR: raw IEEE half bits zero-extended to i32 (a scalar or a vector of them) -> float32
    of the same shape, exact for every input (numba has no float16).

    Integer-only (no F16C dependence, no libcall): rebias the exponent; half subnormals are
    renormalised by subtracting 2^-14 in float32 (exact, and never touches float32
    subnormals); inf/NaN get the float32 all-ones exponent.
    """
    ity, fty = h.type, ir.FloatType()
    if isinstance(ity, ir.VectorType):
        fty = ir.VectorType(fty, ity.count)

    def c(v, t=ity):
        return ir.Constant(t, [v] * t.count) if isinstance(t, ir.VectorType) else ir.Constant(t, v)
    o = builder.shl(builder.and_(h, c(0x7FFF)), c(13))
    exp = builder.and_(o, c(0x0F800000))
    o = builder.add(o, c(112 << 23))
    o_special = builder.add(o, c(112 << 23))
    o_sub = builder.fsub(builder.bitcast(builder.add(o, c(1 << 23)), fty), c(2.0 ** -14, fty))
    o_sub = builder.bitcast(o_sub, ity)
    o = builder.select(builder.icmp_unsigned("==", exp, c(0x0F800000)), o_special, o)
    o = builder.select(builder.icmp_unsigned("==", exp, c(0)), o_sub, o)
    o = builder.or_(o, builder.shl(builder.and_(h, c(0x8000)), c(16)))
    return builder.bitcast(o, fty)


@intrinsic
def f16_f32(typingctx, h):
    """Raw IEEE half bits (uint16) -> float32, exact for every input (f16_bits_f32)."""
    def codegen(context, builder, sig, args):
        return f16_bits_f32(builder, builder.zext(args[0], _I32))
    return types.float32(types.uint16), codegen


# --- matvec: the decode hot path ---------------------------------------------------------


# The hot path of decode, written as LLVM vector IR. A call computes a tile of weight rows x
# activation rows, y[a, r + j] = sum_g s[r+j, g] * dot(w_g, x_a,g) (before the offset term),
# walking the rows 16 bytes at a time: the tile's <16 x float> accumulators stay in registers
# for the whole row (a numba loop kept them in memory and paid its per-group loop set-up:
# 2-2.6x slower from cache), each 16-byte load of a weight row is widened once and shared by
# the tile's activation rows, each load of x by its weight rows, and the same bytes of the
# next block's rows are prefetched (eight row streams are too many for the hardware
# prefetcher).
# One-token decode uses 8 x 1 tiles; several tokens at once (a batch, drafted tokens) use
# 4 x 4 tiles, so each weight byte is unpacked once for four tokens.
# Rows take their whole 64-byte blocks first (int4: _int4_block, below), then the chunks left;
# the blocks are found through the matrix's row interleaving (formats/qtensor.py, Layout), which moves
# bytes only: the operations below are the same on either layout.
# Every (weight row, activation row) pair gets the same operations in the same order whatever
# the tile: per block t = sum_{k even} n_k x'_k + sum_{k odd} n_k x'_k, acc = fmuladd(t, s,
# acc), per remaining chunk
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

# Where the target has 16 vector registers (AVX2; cpu/target.py, narrow_tiles), the one-token
# tiles keep each 16-lane vector as two 8-lane halves (tile_parts, _int4_block_halves): the same
# operations lane for lane, so the same bits.
PARTS = 2 if narrow_tiles() else 1


def _part_types(parts: int):
    """(lanes, float vector, int32 vector) of one part of a 16-lane vector split in `parts`."""
    lanes = 16 // parts
    return lanes, ir.VectorType(_F32, lanes), ir.VectorType(_I32, lanes)


def _i64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, _i32(0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def hsum(builder, v):
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
# were scaled by 16^-k and laid out to match beforehand (prepare_x_into), so each product is
# n * x rounded once, as before. Per block and weight row: 8 masks (or shifts), 8
# conversions, 8 multiply(-add)s of nibbles by x, one multiply-add by the scales and one
# shuffle spreading them: 26 vector operations where the per-chunk loop below spends 32 (4
# chunks of widen, mask, shift, two conversions, a multiply and two multiply-adds). The loop
# is bound by them where the weights come from cache. A lane's four bytes lie in one chunk, so its
# eight products belong to one group: t = t_even + t_odd (the products of the even and of the
# odd nibbles, two chains of four: one chain of eight is ~30 cycles of dependent multiply-adds,
# and on the AVX2 EPYC two chains ran 5-10% faster from cache), then acc = fmuladd(t, s_lane,
# acc) with the block's 1, 2 or 4 group scales spread over the lanes.
_BLOCK_MASKS = [ir.Constant(_V16I, [15 << (4 * k)] * 16) for k in range(7)]  # nibble 7: a shift


def laundered(builder, ptr, tag: int):
    """`ptr`, through an empty inline asm that LLVM cannot see into, tagged so that each tag is a
    distinct value: loads through two tags of one pointer are not merged. A tile reads its
    activations through one tag per weight row, so each multiply-add takes its activation
    straight from memory (a folded load) instead of LLVM keeping every activation of a block in
    a register, which on a 16-register target meant spilling them and reading them back."""
    fnty = ir.FunctionType(ptr.type, [ptr.type, _I32])
    return builder.asm(fnty, "", "=r,0,i", [ptr, _i32(tag)], side_effect=False)


def _int4_blocks(builder, nfull, cshift, qstep, qrows, srows, xrows, accs, fma, prefetch_next, parts: int):
    """Blocks 0..nfull-1 of every weight row x every activation row, into the accumulators.
    One loop per group width (cshift 0, 1, 2+), chosen here once rather than per block and
    row: the per-block branch made LLVM spill the scales and accumulators to the stack."""
    def loop(shift, spread: int):
        with cgutils.for_range(builder, nfull) as it:
            if parts == 1:
                _int4_block(builder, it.index, shift, spread, qstep, qrows, srows, xrows, accs, fma, prefetch_next)
            else:
                _int4_block_halves(builder, it.index, shift, spread, qstep, qrows, srows, xrows, accs, fma,
                                   prefetch_next, parts)

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
    the accumulators; a row's block bi is at qrows[j] + bi * qstep (formats/qtensor.py, Layout). The
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
            t = [builder.fmul(ns[0], x[0]), builder.fmul(ns[1], x[1])]
            for k in range(2, 8):
                t[k & 1] = builder.call(fma, [ns[k], x[k], t[k & 1]])
            t = builder.fadd(t[0], t[1])
            acc = accs[j][a][0]
            builder.store(builder.call(fma, [t, s, builder.load(acc)]), acc)


def _int4_block_halves(builder, bi, cshift, spread: int, qstep, qrows, srows, xrows, accs, fma, prefetch_next,
                       parts: int):
    """_int4_block's operations lane for lane, for targets with 16 vector registers (PARTS 2):
    each weight row's block as two halves of 8 lanes (its bytes 0-31 and 32-63), the product
    chains of about four (row, half, activation row) triples advanced side by side, k by k,
    the activations read where they are used (laundered).

    _int4_block keeps a block's 8 activation vectors live across the rows: with the rows'
    accumulators that is more than 16 ymm registers, and LLVM spilled and reloaded them every
    block. And the product chains are long (t_even = n0 x0, then three dependent multiply-adds,
    t_odd likewise): one unit's after another, the out-of-order window held two or three, so
    the core waited on them; four units side by side keep its multiply-add pipes busy."""
    lanes, vf, vi = _part_types(parts)
    masks = [ir.Constant(vi, [15 << (4 * k)] * lanes) for k in range(7)]
    b = builder.mul(bi, qstep)
    e = builder.shl(bi, _i64(7))
    g0 = builder.lshr(builder.shl(bi, _i64(2)), cshift)
    prefetch_next(b, g0)
    units = [(j, h) for j in range(len(qrows)) for h in range(parts)]
    per = max(1, 4 // len(xrows))
    for u0 in range(0, len(units), per):
        group = units[u0:u0 + per]
        raws, scales, xbs = [], [], []
        for j, h in group:
            at = builder.gep(qrows[j], [builder.add(b, _i64(4 * lanes * h))])
            raws.append(builder.load(builder.bitcast(at, vi.as_pointer()), align=1))
            scales.append(_block_scales(builder, srows[j], g0, spread, h, parts))
            xbs.append([laundered(builder, builder.gep(row, [e]), parts * j + h) for row in xrows])
        ts = [[[None, None] for _ in xrows] for _ in group]
        for k in range(8):
            for u, (j, h) in enumerate(group):
                if k < 7:
                    n = builder.sitofp(builder.and_(raws[u], masks[k]), vf)
                else:
                    n = builder.sitofp(builder.lshr(raws[u], ir.Constant(vi, [28] * lanes)), vf)
                for a in range(len(xrows)):
                    at = builder.gep(xbs[u][a], [_i64(16 * k + lanes * h)])
                    x = builder.load(builder.bitcast(at, vf.as_pointer()), align=4)
                    ts[u][a][k & 1] = builder.fmul(n, x) if k < 2 else builder.call(fma, [n, x, ts[u][a][k & 1]])
        for u, (j, h) in enumerate(group):
            for a in range(len(xrows)):
                acc = accs[j][a][h]
                t = builder.fadd(ts[u][a][0], ts[u][a][1])
                builder.store(builder.call(fma, [t, scales[u], builder.load(acc)]), acc)


def _block_scales(builder, srow, g0, spread: int, part: int = 0, parts: int = 1):
    """Lane i's group scale in a block of `spread` groups from group g0 (four groups of 32:
    lanes 4c..4c+3 are chunk c; two of 64; or one), for the block's lanes 16 / parts * part..
    (all 16 where parts is 1)."""
    lanes, vf, _ = _part_types(parts)
    if spread == 1:
        return _splat(builder, builder.load(builder.gep(srow, [g0])), vf)
    return _spread(builder, srow, g0, spread, range(lanes * part, lanes * (part + 1)))


def _spread(builder, srow, g0, n, lanes=range(16)):
    """Scales g0..g0+n-1 of a row, each over 16/n consecutive lanes of 16 (those in `lanes`)."""
    vty = ir.VectorType(_F32, n)
    v = builder.load(builder.bitcast(builder.gep(srow, [g0]), vty.as_pointer()), align=4)
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, len(lanes)), [i * n // 16 for i in lanes]))


def q_row_ptrs(builder, qbase, qstride, nfull, ilv, row, j):
    """(block pointer, tail pointer) of q's row `row + j`, its rows interleaved in blocks of ilv
    (formats/qtensor.py, Layout): row rr = G * ilv + jj has its 64-byte block k at G * ilv * qstride +
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


def tile_parts(arows: int) -> int:
    """How a tile holds its 16-lane vectors: whole (1), or on a 16-register target (PARTS 2) as
    two 8-lane halves, for the one-token tiles. The 4 x 4 tiles of several tokens keep whole
    vectors on every target: their 16 accumulators per half spill either way."""
    return PARTS if arows == 1 else 1


def tile_codegen(nibbles: bool, wrows: int, arows: int):
    """Codegen of a (q, scales, offs, r, rn, x, a0, half_or_group, cshift, ilv, out) -> None
    intrinsic over weight rows r..r+wrows-1 and activation rows a0..a0+arows-1.

    nibbles: q is int4 (byte k of a group holds element k low, k + half high) with
    half = group / 2 bytes per group, its rows interleaved in blocks of `ilv` (1: row-major;
    formats/qtensor.py, Layout); else q is int8, one element per byte, row-major (ilv 1).
    cshift = log2(16-byte chunks per group); every group is a whole number of chunks.
    x is one activation row [n] (arows 1) or rows [B, n]. For a one-row x, out[a0 + j]
    receives weight row r + j; else out [>= arows, >= wrows] receives out[a, j] for activation
    row a0 + a and weight row r + j. Rows rn.. of q, scales and offs (q4_1's mins, shaped like scales; the
    caller adds their term) are prefetched (pass rn = r on the last block); offs may be scales.
    """
    parts = tile_parts(arows)
    lanes, vf, vi = _part_types(parts)

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
        qrows, qtails = zip(*(q_row_ptrs(builder, qbase, qstride, nfull, ilv, r, j) for j in range(wrows)))
        nrows, ntails = zip(*(q_row_ptrs(builder, qbase, qstride, nfull, ilv, rn, j) for j in range(wrows)))
        srows = [row_ptr(sbase, r, j, ngroups) for j in range(wrows)]
        nsrows = [row_ptr(sbase, rn, j, ngroups) for j in range(wrows)]
        mbase = builder.bitcast(ma.data, _F32.as_pointer())
        nmrows = [row_ptr(mbase, rn, j, ngroups) for j in range(wrows)]
        has_offs = builder.icmp_unsigned("!=", mbase, sbase)
        accs = [[[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(parts)]
                 for _ in range(arows)] for _ in range(wrows)]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3),
                                             f"llvm.fmuladd.v{lanes}f32")
        pf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0")

        def prefetch(base, index):  # read, keep in all cache levels, data
            builder.call(pf, [builder.bitcast(builder.gep(base, [index]), _I8.as_pointer()), _i32(0), _i32(3), _i32(1)])

        cmask = builder.sub(builder.shl(_i64(1), cshift), _i64(1))

        def load_x(row, offset, h):
            at = builder.gep(row, [builder.add(offset, _i64(lanes * h))])
            return builder.load(builder.bitcast(at, vf.as_pointer()), align=4)

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
                xs = [[(load_x(row, xo, h), load_x(row, builder.add(xo, gbytes), h)) for h in range(parts)]
                      for row in xrows]
            else:
                xs = [[(load_x(row, b, h), None) for h in range(parts)] for row in xrows]
            # One prefetch per row per 64-byte line (every 4th chunk), not per chunk: a
            # prefetch is an instruction like any other, and 24 per chunk were a third of the
            # one-token tile's.
            if prefetch_here is True:
                prefetch_next(qoff, g, q_next)
            elif prefetch_here is not False:
                with builder.if_then(prefetch_here):
                    prefetch_next(qoff, g, q_next)
            vb = ir.VectorType(_I8, lanes)
            for j in range(wrows):
                s = _splat(builder, builder.load(builder.gep(srows[j], [g])), vf)
                for h in range(parts):
                    at = builder.gep(q_at[j], [builder.add(qoff, _i64(lanes * h))])
                    raw = builder.load(builder.bitcast(at, vb.as_pointer()), align=1)
                    if nibbles:
                        w = builder.zext(raw, vi)
                        lo = builder.uitofp(builder.and_(w, ir.Constant(vi, [15] * lanes)), vf)
                        hi = builder.uitofp(builder.lshr(w, ir.Constant(vi, [4] * lanes)), vf)
                    else:
                        lo = builder.sitofp(raw, vf)
                    if nibbles:
                        for a, xa_ in enumerate(xs):
                            xl, xh = xa_[h]
                            t = builder.call(fma, [hi, xh, builder.fmul(lo, xl)])
                            acc = accs[j][a][h]
                            builder.store(builder.call(fma, [t, s, builder.load(acc)]), acc)
                    else:  # int8: scaled once per weight row, then one fused multiply-add per pair
                        w = builder.fmul(lo, s)
                        for a, xa_ in enumerate(xs):
                            acc = accs[j][a][h]
                            builder.store(builder.call(fma, [w, xa_[h][0], builder.load(acc)]), acc)

        # Whole 64-byte blocks first, at qrows[j] + k * qstep: int4 through _int4_block (x
        # prepared by prepare_x_into), int8 as four chunks; then the tail's chunks.
        c0 = builder.shl(nfull, _i64(2))
        if nibbles:
            _int4_blocks(builder, nfull, cshift, qstep, qrows, srows, xrows, accs, fma, prefetch_next, parts)
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
                builder.store(hsum(builder, _joined(builder, accs[j][a])), builder.gep(obase, [at]))
        return context.get_dummy_value()
    return codegen


def _joined(builder, parts):
    """A 16-lane accumulator's lanes for hsum: its one vector, or its two halves added (hsum's
    first step, lanes 0-7 plus lanes 8-15: the same bits)."""
    v = builder.load(parts[0])
    return v if len(parts) == 1 else builder.fadd(v, builder.load(parts[1]))


def _one_row_tile(wrows: int, nibbles: bool):
    """An intrinsic over `wrows` weight rows r.. times one activation row, into out[o:o + wrows]
    (see tile_codegen)."""
    if nibbles:
        def tile(typingctx, q, scales, offs, r, rn, x, half, cshift, ilv, out, o):
            sig = types.void(q, scales, offs, types.intp, types.intp, x, types.intp, types.intp, types.intp, out,
                             types.intp)

            def codegen(context, builder, sig_, args):
                full = types.void(q, scales, offs, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                                  types.intp, out)
                return tile_codegen(True, wrows, 1)(context, builder, full, [*args[:6], args[10], *args[6:10]])
            return sig, codegen
    else:
        def tile(typingctx, q, scales, r, rn, x, group, cshift, ilv, out, o):
            sig = types.void(q, scales, types.intp, types.intp, x, types.intp, types.intp, types.intp, out,
                             types.intp)

            def codegen(context, builder, sig_, args):  # no offsets: scales stand in for them
                full = types.void(q, scales, scales, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                                  types.intp, out)
                return tile_codegen(False, wrows, 1)(context, builder, full,
                                                      [args[0], args[1], args[1], *args[2:5], args[9], *args[5:9]])
            return sig, codegen
    tile.__name__ = tile.__qualname__ = f"_{'int4' if nibbles else 'q8'}_dot{wrows}"
    return intrinsic(tile)


int4_dot8, int4_dot2 = _one_row_tile(8, True), _one_row_tile(2, True)

# Rows of at least this many bytes (int4 in int4_rows8, q8_0 in _matvec_q8) go through an
# 8-row block two rows at a time: from DRAM, rows of 1 KB and more stream faster two at a
# time and shorter ones eight at a time (docs/benchmarks.md, Kernels: rows read in pairs).
# Eight rows share each load of x, two rows share it less, which only pays where the reads
# are the limit. A row's operations do not depend on how many rows share
# its pass, so the bits are the same either way.
# (PAIR_ROW_BYTES lives in formats/qtensor.py: it is also the block of rows a matrix is
# interleaved in, qtensor.interleave_width.)


q8_dot8, q8_dot2 = _one_row_tile(8, False), _one_row_tile(2, False)


# Tiles for several activation rows: TILE_W weight rows x 1..TILE_A activation rows (one
# intrinsic per activation count; the accumulators, TILE_W * TILE_A vectors, must stay in
# registers: 16 of AVX-512's 32).
TILE_W, TILE_A = 4, 4


def _tile_intrinsic(nibbles: bool, arows: int):
    if nibbles:
        def tile(typingctx, q, scales, offs, r, rn, x, a0, half, cshift, ilv, out):
            sig = types.void(q, scales, offs, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                             types.intp, out)
            return sig, tile_codegen(True, TILE_W, arows)
    else:
        def tile(typingctx, q, scales, r, rn, x, a0, group, cshift, ilv, out):
            sig = types.void(q, scales, types.intp, types.intp, x, types.intp, types.intp, types.intp, types.intp,
                             out)

            def codegen(context, builder, sig_, args):
                full = types.void(q, scales, scales, types.intp, types.intp, x, types.intp, types.intp,
                                  types.intp, types.intp, out)
                return tile_codegen(False, TILE_W, arows)(context, builder, full, [args[0], args[1], *args[1:]])
            return sig, codegen
    tile.__name__ = tile.__qualname__ = f"_{'int4' if nibbles else 'q8'}_tile{arows}"
    return intrinsic(tile)


int4_tile1, int4_tile2, int4_tile3, int4_tile4 = (_tile_intrinsic(True, n) for n in range(1, TILE_A + 1))
q8_tile1, q8_tile2, q8_tile3, q8_tile4 = (_tile_intrinsic(False, n) for n in range(1, TILE_A + 1))


def _offset_sums(context, builder, offsty, offs, r, xsty, xs, rows: int) -> list:
    """sum_g offs[r + j, g] * xs[g] for j < rows, each in a fixed order: 16 lanes over the
    groups (a fused multiply-add per 16 groups), the lanes summed by hsum's tree, then the
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
    totals = [cgutils.alloca_once_value(builder, hsum(builder, builder.load(a))) for a in accs]
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
    for j < rows: the same bits as `rows` with_offset calls, with the rows' sums side by side
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
        if coef != types.float32:  # float32 arithmetic, as with_offset's is for a float32 coef
            return None
        return types.void(d, offs, types.intp, coef, xs), codegen
    with_offsets.__name__ = with_offsets.__qualname__ = f"_with_offsets{rows}"
    return intrinsic(with_offsets)


@njit(cache=True)
def with_offset(dot, offs, r, coef, xs):
    """dot + coef * sum_g offs[r, g] * xs[g] (the offset term of q4_1's mins, or of the
    symmetric schemes' -8)."""
    return dot + coef * _offset_dot(offs, r, xs)


with_offsets8 = _with_offsets_intrinsic(8)
with_offsets_tile = _with_offsets_intrinsic(TILE_W)  # matmul_rows_int4
