"""int4 (and q8_0) weights times int8 activations in integer arithmetic: the opt-in
`--activations int8` path (EngineConfig.activations). The exact path (cpu/, gemm.py) stays the
default. q8_0 rows go through the same tiles (their `q8` form, _idot_codegen): one int8 weight
per byte, x rounded per 32 in order (quantize_q8_into); on AVX2 the exact q8_0 kernel is bound
by its arithmetic on rows of 576 bytes (SmolLM2's head: 7.6 GB/s from DRAM, 14.0 this way).

Why: on a machine whose cores are slower than its memory, the exact int4 matvec is compute
bound: every 32 weights cost a widening, two int->float conversions and three float
multiply-adds per row (docs/benchmarks.md: Kernels).
Quantizing the activations once per call to int8 (one scale per weight group, as llama.cpp's
Q8 activations do) turns each 64 weight bytes of a row into a few integer instructions, one
int->float conversion and one multiply-add. The integer form is chosen at compile time by what
the target CPU has (`ISA`): AVX-512 VNNI `vpdpbusd` (unsigned nibble x signed int8, four
products summed per 32-bit lane: two per 64 weight bytes), or on AVX2 `vpmaddubsw` + `vpmaddwd`
(byte pairs into int16, int16 pairs into int32, as llama.cpp's AVX2 path), else portable IR.

The arithmetic, per group g of a row: dot(w_g, x_g) ~ s_w[g] * s_x[g] * isum_g + offset term,
- symmetric int4 (int4_g64, q4_0; w = (nib - 8) * s): isum_g = sum(nib * xq) - 8 * sum(xq), both
  integer; the second sum does not depend on the row, so each lane's integer accumulator starts
  at -8 * (its share of sum(xq)) and there is no offset term at all;
- q4_1 (w = nib * d + m): isum_g = sum(nib * xq), plus m[g] * s_x[g] * sum(xq_g), added per lane.
So the result is the exact dot product of the weights with the int8-rounded activations, up to
float32 rounding: what this path costs in fidelity is the rounding of x to 8 bits only
(docs/benchmarks.md: Quality).

Same bits wherever a row is computed: integer sums are exact, so the VNNI instructions, the
AVX2 pairs and the generic LLVM IR give the same 32-bit lane sums on any CPU; the float part is
plain IR without fast-math flags (LLVM may not reorder it), identical in every caller, and the
lane sums are reduced in a fixed tree. A row's value therefore depends only on its data and the
activations, never on the thread split, the batch, the caller (matvec, matmul, the fused MoE
kernel) or the expert's placement; matmul's row l equals matvec of x[l] bit for bit
(tests/kernels/test_idot.py).

Layout: the weights' int4 byte k of a group holds element k (low nibble) and element k + half
(high nibble). The activations are quantized into two byte streams aligned with the weight
bytes, xlo[g*half + k] = xq[g*group + k] and xhi[g*half + k] = xq[g*group + half + k], so a
64-byte load of a weight row pairs with one 64-byte load of each. Rows are walked 64 bytes at a
time, then 16 at a time for the rest (a row is a whole number of 16-byte groups or half-groups).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from colibri.formats.qtensor import INT4_SCHEMES, QTensor

from .cpu.checks import check_tensor, checked_x
from .cpu.target import isa_of, target_isa  # noqa: F401 (isa_of: bench.common's report)
from .cpu.codegen import PARTS, q_row_ptrs
from .cpu.matvec import (
    group_sums,
    group_sums_into,
    int4_rows8,
    int4_tail_rows,
    int4_weight,
    matmul_rows_int4,
    matvec_int4,
    prepare_x,
    prepare_x_into,
)

ACTIVATIONS = ("f32", "int8")

_mode: ContextVar[str] = ContextVar("colibri_activations", default="f32")


def current() -> str:
    """The activation mode of the model running on this thread ("f32" unless set)."""
    return _mode.get()


@contextmanager
def activations(mode: str):
    """Run the block's int4 matrix products with `mode` activations (DecoderModel.forward sets
    this from EngineConfig.activations, so every caller of the model is covered)."""
    if mode not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {mode!r}")
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def _isa() -> str:
    """The integer dot instructions of the CPU numba compiles for (cpu/target.py)."""
    return target_isa()


ISA = _isa()

_F32 = ir.FloatType()
_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _i32(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


def _i64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _vec(t, n):
    return ir.VectorType(t, n)


def dot_u8s8(builder, acc, pairs, lanes: int):
    """acc[i] + the 4-byte lane sums of a * b over the (a, b) `pairs` (at most two): the a bytes
    are nibbles (0..15) and the b bytes int8, so every partial sum below is exact in its width
    and the three forms give the same integers.

    vnni: one `vpdpbusd` per product. avx2: `vpmaddubsw` sums byte pairs into int16 (at most
    2 * 15 * 128 per pair, and 4 * 15 * 128 = 7680 for the two products added, far from int16's
    limit), `vpmaddwd` by ones sums int16 pairs into the 32-bit lanes. generic: widening
    multiplies in 32-bit lanes."""
    if ISA == "vnni":
        v = _vec(_I32, lanes)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v, [v, v, v]),
                                            f"llvm.x86.avx512.vpdpbusd.{32 * lanes}")
        for a, b in pairs:
            acc = builder.call(fn, [acc, builder.bitcast(a, v), builder.bitcast(b, v)])
        return acc
    if ISA == "avx2":
        return builder.add(acc, _maddubs_lanes(builder, pairs, lanes))
    wide = _vec(_I32, 4 * lanes)
    for a, b in pairs:
        p = builder.mul(builder.zext(a, wide), builder.sext(b, wide))
        for j in range(4):
            part = builder.shuffle_vector(p, p, ir.Constant(_vec(_I32, lanes), [4 * i + j for i in range(lanes)]))
            acc = builder.add(acc, part)
    return acc


def dot_s8s8(builder, acc, pairs, lanes: int):
    """dot_u8s8 for a bytes that are signed (block_idot's IQ4 codes on AVX2, the table's values
    -127..113): each pair given to dot_u8s8 as (|b|, a negated where b < 0), the same products.
    vpmaddubsw then sums two products of at most 127 * 127 into int16, where the values made
    unsigned (+128, up to 241) would overflow it. b (int8 activations) is never -128."""
    out = []
    for a, b in pairs:
        neg = builder.icmp_signed("<", b, ir.Constant(b.type, None))
        out.append((builder.select(neg, builder.neg(b), b), builder.select(neg, builder.neg(a), a)))
    return dot_u8s8(builder, acc, out, lanes)


def _maddubs_lanes(builder, pairs, lanes: int):
    """The 4-byte lane sums of sum over pairs of a * b, in 32- or 16-byte pieces of
    `vpmaddubsw` / `vpmaddwd` (AVX2 or SSSE3 forms), the pieces joined in lane order."""
    piece = 32 if lanes % 8 == 0 else 16
    n = piece // 2
    i8v, i16v, i32v = _vec(_I8, piece), _vec(ir.IntType(16), n), _vec(_I32, n // 2)
    names = (("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd") if piece == 32
             else ("llvm.x86.ssse3.pmadd.ub.sw.128", "llvm.x86.sse2.pmadd.wd"))
    maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i16v, [i8v, i8v]), names[0])
    maddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32v, [i16v, i16v]), names[1])
    ones = ir.Constant(i16v, [1] * n)
    out = []
    for k in range(4 * lanes // piece):
        sel = ir.Constant(_vec(_I32, piece), list(range(k * piece, (k + 1) * piece)))
        s16 = None
        for a, b in pairs:
            pa = builder.shuffle_vector(a, a, sel) if piece != 4 * lanes else a
            pb = builder.shuffle_vector(b, b, sel) if piece != 4 * lanes else b
            p = builder.call(maddubs, [pa, pb])
            s16 = p if s16 is None else builder.add(s16, p)
        out.append(builder.call(maddwd, [s16, ones]))
    assert len(out) & (len(out) - 1) == 0, "lanes must give a power-of-two count of pieces"
    while len(out) > 1:  # join the pieces back into one <lanes x i32>, in order
        joined = []
        for x, y in zip(out[0::2], out[1::2]):
            m = x.type.count
            joined.append(builder.shuffle_vector(x, y, ir.Constant(_vec(_I32, 2 * m), list(range(2 * m)))))
        out = joined
    return out[0]


def hsum(builder, v):
    """Sum of a float vector's lanes by halving (fixed order)."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _i32(0))


def _idot_codegen(nrows: int, half: int, mins: bool, ncols: int | None = None, parts: int = 1,
                  q8: bool = False):
    """Codegen of (q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, out, ilv) -> None:
    out[0:nrows] = rows r..r+nrows-1 of the int4 x int8 product (q's rows interleaved in blocks
    of ilv: formats/qtensor.py, Layout, found as cpu.codegen.tile_codegen finds them). The same bytes of rows rn..
    are prefetched, with their scales (and mins): the scales' prefetch took about a tenth off
    SmolLM2's int8 decode (`python -m bench.engine.decode_phases --activations int8`).
    half: bytes per weight group (16 or 32), a constant so the lane -> group shuffles are.
    mins: q4_1 (offs holds the mins); else symmetric, offs unused.
    Per-x arrays (quantize_into): xlo/xhi int8 [n/2]; per 4-byte lane: negc int32 (-8 * the
    lane's sum of xq), xsl float32 (s_x * that sum), sxl float32 (s_x of the lane's group).

    ncols (prefill's tile): the x arrays are [L, ...] (quantize_rows), an argument l0 follows
    sxl, and out (before ilv) is y [L, out_features]: y[l0 + i, r + j] for i < ncols, j < nrows.
    Each weight chunk is loaded and unpacked once for the ncols activation rows; every (row,
    activation row) pair runs the same operations in the same order as the one-row form, so the
    same bits.

    parts 2 (the 16-register form, _idot4 / _idot2 on AVX2): each 64-byte chunk as two 32-byte
    halves, the activations of one half live at a time and each row's 16-lane accumulator as
    two 8-lane halves, added (hsum's first step) at the end: the lanes and their order are
    those of parts 1, so the bits are.

    q8 (q8_0 weights: one int8 weight per byte, groups of 32, half = 32 bytes per group): x is
    quantize_q8's, xlo its int8 values in order (xhi, negc and xsl unused), each 4-byte lane
    4 weights; a lane's sum is sum(w * xq) over its bytes, through dot_s8s8 (|w| with xq
    negated where w < 0: |w| <= 128 fits the unsigned side, and xq is never -128)."""
    tile = ncols is not None
    nc = ncols or 1

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(t)(context, builder, a) if isinstance(t, types.Array) else None
                  for t, a in zip(sig.args, args)]
        qa, sa, ma = arrays[0], arrays[1], arrays[2]
        r, rn = args[3], args[4]
        xlo, xhi, negc, xsl, sxl = (arrays[i] for i in (5, 6, 7, 8, 9))
        l0, oa = (args[10], arrays[11]) if tile else (None, arrays[10])
        ilv = args[-1]
        qstride = cgutils.unpack_tuple(builder, qa.strides, 2)[0]
        ngroups = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
        nbytes = builder.mul(ngroups, _i64(half))
        nfull = builder.udiv(nbytes, _i64(64))

        def ptr(a, ty):
            return builder.bitcast(a.data, ty.as_pointer())

        def xrow(a, ty, i):
            """Activation row i's data: the array itself, or row l0 + i of a 2-D one."""
            if not tile:
                return ptr(a, ty)
            stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
            base = builder.gep(ptr(a, _I8), [builder.mul(builder.add(l0, _i64(i)), stride)])
            return builder.bitcast(base, ty.as_pointer())

        qbase, sbase, mbase = ptr(qa, _I8), ptr(sa, _F32), ptr(ma, _F32)
        xlob = [xrow(xlo, _I8, i) for i in range(nc)]
        xhib = [xrow(xhi, _I8, i) for i in range(nc)]
        ncb = [xrow(negc, _I32, i) for i in range(nc)]
        xslb = [xrow(xsl, _F32, i) for i in range(nc)]
        sxlb = [xrow(sxl, _F32, i) for i in range(nc)]

        def row(base, rr, j, stride):
            return builder.gep(base, [builder.mul(builder.add(rr, _i64(j)), stride)])

        # q's rows in blocks of ilv (formats/qtensor.py, Layout): cpu.q_row_ptrs
        qstep = builder.shl(ilv, _i64(6))
        qrows, qtails = zip(*(q_row_ptrs(builder, qbase, qstride, nfull, ilv, r, j) for j in range(nrows)))
        nrows_q, ntails = zip(*(q_row_ptrs(builder, qbase, qstride, nfull, ilv, rn, j) for j in range(nrows)))
        srows = [row(sbase, r, j, ngroups) for j in range(nrows)]
        mrows = [row(mbase, r, j, ngroups) for j in range(nrows)]
        nsrows = [row(sbase, rn, j, ngroups) for j in range(nrows)]
        nmrows = [row(mbase, rn, j, ngroups) for j in range(nrows)]
        pf = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")

        def prefetch(base, index):  # read, keep in all cache levels, data
            builder.call(pf, [builder.gep(base, [index]), _i32(0), _i32(3), _i32(1)])

        fma_fns = {}

        def fma(a, b, c):
            t = a.type
            if t not in fma_fns:
                fma_fns[t] = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]),
                                                            f"llvm.fmuladd.v{t.count}f32")
            return builder.call(fma_fns[t], [a, b, c])

        def load(base, index, ty):
            return builder.load(builder.bitcast(builder.gep(base, [index]), ty.as_pointer()), align=1)

        def group_lanes(base, b, lanes):
            """The weight-group values of `base` (a row of scales or mins) for each 4-byte lane
            of the chunk at byte b: a lane of byte 4i is in group (b + 4i) / half."""
            g0 = builder.udiv(b, _i64(half))
            per = half // 4  # lanes per group
            if lanes <= per:  # the chunk lies inside one group
                return _splat(builder, builder.load(builder.gep(base, [g0])), lanes)
            ng = lanes // per
            vals = load(base, g0, _vec(_F32, ng))
            return builder.shuffle_vector(vals, vals, ir.Constant(_vec(_I32, lanes), [i // per for i in range(lanes)]))

        def chunk_loop(start, stop, width, accs, pieces=1):
            """The chunks start..stop-1 of `width` bytes, each in `pieces` pieces (halves of a
            64-byte chunk on a 16-register target: see the docstring's parts) into accs[j][c][h]."""
            step = width
            width //= pieces
            lanes = width // 4
            vb, vi, vf = _vec(_I8, width), _vec(_I32, lanes), _vec(_F32, lanes)
            q_at, q_next = (qrows, nrows_q) if step == 64 else (qtails, ntails)
            with cgutils.for_range_slice(builder, start, stop, _i64(1)) as (i, _):
                b0 = builder.mul(i, _i64(step))
                qb0 = builder.mul(i, qstep) if step == 64 else b0  # where the chunk sits in q
                for j in range(nrows):
                    prefetch(q_next[j], qb0)
                    if step == 64:  # and their scales (and mins), which come from memory as well
                        g = builder.udiv(b0, _i64(half))
                        prefetch(builder.bitcast(builder.gep(nsrows[j], [g]), _I8.as_pointer()), _i64(0))
                        if mins:
                            prefetch(builder.bitcast(builder.gep(nmrows[j], [g]), _I8.as_pointer()), _i64(0))
                for h in range(pieces):
                    b = builder.add(b0, _i64(width * h))
                    qb = builder.add(qb0, _i64(width * h))
                    lane0 = builder.udiv(b, _i64(4))
                    xl = [load(xlob[c], b, vb) for c in range(nc)]
                    xh = None if q8 else [load(xhib[c], b, vb) for c in range(nc)]
                    sx = [load(sxlb[c], lane0, vf) for c in range(nc)]
                    init = [ir.Constant(vi, [0] * lanes) if mins or q8 else load(ncb[c], lane0, vi)
                            for c in range(nc)]
                    xs = [load(xslb[c], lane0, vf) for c in range(nc)] if mins else None
                    for j in range(nrows):
                        w = load(q_at[j], qb, vb)
                        if not q8:
                            lo = builder.and_(w, ir.Constant(vb, [15] * width))
                            hi = builder.lshr(w, ir.Constant(vb, [4] * width))
                        sw = group_lanes(srows[j], b, lanes)
                        m = group_lanes(mrows[j], b, lanes) if mins else None
                        for c in range(nc):
                            if q8:
                                iacc = dot_s8s8(builder, init[c], ((xl[c], w),), lanes)
                            else:
                                iacc = dot_u8s8(builder, init[c], ((lo, xl[c]), (hi, xh[c])), lanes)
                            scale = builder.fmul(sw, sx[c])
                            acc = fma(builder.sitofp(iacc, vf), scale, builder.load(accs[j][c][h]))
                            if mins:
                                acc = fma(m, xs[c], acc)
                            builder.store(acc, accs[j][c][h])

        def zeros(lanes, pieces=1):
            return [[[cgutils.alloca_once_value(builder, ir.Constant(_vec(_F32, lanes), [0.0] * lanes))
                      for _ in range(pieces)] for _ in range(nc)] for _ in range(nrows)]

        acc64, acc16 = zeros(16 // parts, parts), zeros(4)
        chunk_loop(_i64(0), nfull, 64, acc64, parts)
        chunk_loop(builder.mul(nfull, _i64(4)), builder.udiv(nbytes, _i64(16)), 16, acc16)
        for j in range(nrows):
            for c in range(nc):
                whole = builder.load(acc64[j][c][0])
                if parts == 2:  # hsum's first step on the 16 lanes: low half + high half
                    whole = builder.fadd(whole, builder.load(acc64[j][c][1]))
                total = builder.fadd(hsum(builder, whole), hsum(builder, builder.load(acc16[j][c][0])))
                if tile:
                    base = xrow(oa, _F32, c)
                    dst = builder.gep(base, [builder.add(r, _i64(j))])
                else:
                    dst = builder.gep(ptr(oa, _F32), [_i64(j)])
                builder.store(total, dst)
        return context.get_dummy_value()
    return codegen


def _splat(builder, value, lanes):
    vty = _vec(value.type, lanes)
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, _i32(0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), ir.Constant(_vec(_I32, lanes), [0] * lanes))


Q8_COEF = 0.0  # the `coef` that marks q8_0 weights (int4: -8 symmetric, 1 for q4_1's mins)


def _variants_codegen(nrows: int, ncols: int | None = None, parts: int = 1):
    """Codegen of one intrinsic taking the weights' (coef, half, ilv) last: it branches, once per
    call, to the body for q8_0 weights (coef Q8_COEF), or symmetric or q4_1 int4 weights and
    16- or 32-byte groups (the bodies need them as constants)."""
    bodies = {(h, m): _idot_codegen(nrows, h, m, ncols, parts) for h in (16, 32) for m in (False, True)}
    q8_body = _idot_codegen(nrows, 32, False, ncols, parts, q8=True)

    def codegen(context, builder, sig, args):
        inner_sig, inner = types.void(*sig.args[:-3], sig.args[-1]), [*args[:-3], args[-1]]
        coef, half = args[-3], args[-2]
        q8 = builder.fcmp_ordered("==", coef, ir.Constant(coef.type, Q8_COEF))
        q4_1 = builder.fcmp_ordered("==", coef, ir.Constant(coef.type, 1.0))  # symmetric: -8
        h16 = builder.icmp_signed("==", half, ir.Constant(half.type, 16))
        with builder.if_else(q8) as (bytes8, nibbles):
            with bytes8:
                q8_body(context, builder, inner_sig, inner)
            with nibbles:
                with builder.if_else(h16) as (then16, then32):
                    for h, block in ((16, then16), (32, then32)):
                        with block:
                            with builder.if_else(q4_1) as (with_mins, symmetric):
                                for m, inner_block in ((True, with_mins), (False, symmetric)):
                                    with inner_block:
                                        bodies[h, m](context, builder, inner_sig, inner)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _idot8(typingctx, q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, out, coef, half, ilv):
    """out[0:8] = rows r..r+7 (see _idot_codegen)."""
    sig = types.void(q, scales, offs, types.intp, types.intp, xlo, xhi, negc, xsl, sxl, out, coef, types.intp,
                     types.intp)
    return sig, _variants_codegen(8)


@intrinsic
def _idot2(typingctx, q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, out, coef, half, ilv):
    """out[0:2] = rows r, r + 1 (see rows8: rows interleaved in pairs); on a 16-register target
    each 64-byte chunk as two halves as _idot4 does (1.1-1.3x the whole chunks' GB/s from L2 on
    a znver3 core, 2048- and 4096-input rows; the same bits)."""
    sig = types.void(q, scales, offs, types.intp, types.intp, xlo, xhi, negc, xsl, sxl, out, coef, types.intp,
                     types.intp)
    return sig, _variants_codegen(2, parts=PARTS)


@intrinsic
def _idot4(typingctx, q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, out, coef, half, ilv):
    """out[0:4] = rows r..r+3, each 64-byte chunk as two 32-byte halves: rows8's form on a
    16-register target (AVX2). The 8-row tile holds a 64-byte chunk's activations (xlo, xhi, the
    lanes' scales and sums: eight ymm registers) and sixteen accumulators at once, and LLVM
    spilled and reloaded them every chunk (~400 stack moves in the tile); four rows by halves
    hold four and eight, and ran 1.1-1.45x the 8-row tile's GB/s from L2 on a znver3 core
    (2048- and 768-input rows). The lanes and their order are the 8-row tile's: the same bits."""
    sig = types.void(q, scales, offs, types.intp, types.intp, xlo, xhi, negc, xsl, sxl, out, coef, types.intp,
                     types.intp)
    return sig, _variants_codegen(4, parts=2)


@intrinsic
def _idot1(typingctx, q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, out, coef, half, ilv):
    """out[0] = row r."""
    sig = types.void(q, scales, offs, types.intp, types.intp, xlo, xhi, negc, xsl, sxl, out, coef, types.intp,
                     types.intp)
    return sig, _variants_codegen(1)


TILE_ROWS, TILE_COLS = 4, 4  # prefill: weight rows x activation rows per tile


@intrinsic
def _idot_tile(typingctx, q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, l0, y, coef, half, ilv):
    """y[l0 + i, r + j] for i < TILE_COLS, j < TILE_ROWS (see _idot_codegen's ncols)."""
    sig = types.void(q, scales, offs, types.intp, types.intp, xlo, xhi, negc, xsl, sxl, types.intp, y, coef,
                     types.intp, types.intp)
    return sig, _variants_codegen(TILE_ROWS, TILE_COLS)


# --- activations: quantized once per call, shared by every row --------------------------


@intrinsic
def _abs_bits(typingctx, v):
    """|v|'s bits as an int32: for finite floats these order as the floats do; inf and NaN are
    the values from 0x7f800000 up."""
    def codegen(context, builder, sig, args):
        return builder.and_(builder.bitcast(args[0], _I32), _i32(0x7FFFFFFF))
    return types.int32(types.float32), codegen


@intrinsic
def _abs_bits16(typingctx, x, x0):
    """The largest _abs_bits of x[x0 : x0 + 16] (x C-contiguous): one vector load and an
    integer max reduction (a float max may not be reordered, so it would stay scalar)."""
    def codegen(context, builder, sig, args):
        xa = context.make_array(sig.args[0])(context, builder, args[0])
        at = builder.gep(builder.bitcast(xa.data, _F32.as_pointer()), [args[1]])
        v16 = _vec(_I32, 16)
        v = builder.load(builder.bitcast(at, _vec(_F32, 16).as_pointer()), align=4)
        v = builder.and_(builder.bitcast(v, v16), ir.Constant(v16, [0x7FFFFFFF] * 16))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [v16]),
                                            "llvm.vector.reduce.umax.v16i32")
        return builder.call(fn, [v])
    return types.int32(x, types.intp), codegen


@intrinsic
def _bits_f32(typingctx, v):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)
    return types.float32(types.int32), codegen


def _top_bits(x, x0, group):
    """The largest _abs_bits of x[x0 : x0 + group], group a multiple of 16 (compiled only)."""
    raise NotImplementedError("called from compiled code only")


@overload(_top_bits)
def _top_bits_impl(x, x0, group):
    if x.layout == "C":
        def contiguous(x, x0, group):
            top = np.int32(0)
            for k in range(0, group, 16):
                top = max(top, _abs_bits16(x, x0 + k))
            return top
        return contiguous

    def strided(x, x0, group):
        top = np.int32(0)
        for k in range(group):
            top = max(top, _abs_bits(x[x0 + k]))
        return top
    return strided


@njit(cache=True)
def group_scale(x, x0, group):
    """(s, inv, finite) of x[x0 : x0 + group] (group a multiple of 16): s = max|x| / 127,
    inv = 127 / max|x| (0 for an all-zero group). A non-finite x makes s NaN, so every product
    with the group is NaN and the engine's non-finite guard sees it (shared with
    kernels/block_idot.py). max|x| is taken on the bits, as an integer max."""
    top = _top_bits(x, x0, group)
    finite = top < np.int32(0x7F800000)
    amax = _bits_f32(top)
    s = amax / np.float32(127.0) if finite else np.float32(np.nan)
    inv = np.float32(127.0) / amax if finite and amax > 0 else np.float32(0.0)
    return s, inv, finite


@njit(cache=True)
def to_int8(v, inv, finite):
    """v rounded to its group's int8 code (group_scale's inv): round(v / s), 0 where the group
    is not finite."""
    return np.int8(np.rint(v * inv)) if finite else np.int8(0)


@njit(cache=True)
def quantize_into(x, half, xlo, xhi, negc, xsl, sxl):
    """x float32 [n] -> the int8 streams and per-lane sums described in the module docstring.
    Per group of 2*half: s = max|x| / 127, xq = round(x / s) (group_scale)."""
    group = 2 * half
    for g in range(x.shape[0] // group):
        x0 = g * group
        s, inv, finite = group_scale(x, x0, group)
        for k in range(half):
            xlo[g * half + k] = to_int8(x[x0 + k], inv, finite)
            xhi[g * half + k] = to_int8(x[x0 + half + k], inv, finite)
        for lane in range(g * half // 4, (g + 1) * half // 4):
            t = np.int32(0)
            for j in range(4):
                t += np.int32(xlo[4 * lane + j]) + np.int32(xhi[4 * lane + j])
            negc[lane] = np.int32(-8) * t
            xsl[lane] = s * np.float32(t)
            sxl[lane] = s


@njit(cache=True)
def quantize(x, half):
    """One activation vector [n] -> (xlo, xhi, negc, xsl, sxl)."""
    n = x.shape[0]
    xlo, xhi = np.empty(n // 2, np.int8), np.empty(n // 2, np.int8)
    negc, xsl, sxl = np.empty(n // 8, np.int32), np.empty(n // 8, np.float32), np.empty(n // 8, np.float32)
    quantize_into(x, half, xlo, xhi, negc, xsl, sxl)
    return xlo, xhi, negc, xsl, sxl


@njit(cache=True)
def quantize_rows(x, half):
    """Activation rows [L, n] -> the same five arrays with a leading L axis."""
    L, n = x.shape
    xlo, xhi = np.empty((L, n // 2), np.int8), np.empty((L, n // 2), np.int8)
    negc = np.empty((L, n // 8), np.int32)
    xsl, sxl = np.empty((L, n // 8), np.float32), np.empty((L, n // 8), np.float32)
    for r in range(L):
        quantize_into(x[r], half, xlo[r], xhi[r], negc[r], xsl[r], sxl[r])
    return xlo, xhi, negc, xsl, sxl


@njit(cache=True)
def quantize_q8_into(x, xq, sxl):
    """x float32 [n] -> the int8 activations q8_0 rows take (the q8 form of _idot_codegen): xq
    in order, rounded per group of 32 by quantize_into's rule, and sxl the scale of each 4-byte
    lane's group."""
    for g in range(x.shape[0] // 32):
        s, inv, finite = group_scale(x, 32 * g, 32)
        for k in range(32 * g, 32 * g + 32):
            xq[k] = to_int8(x[k], inv, finite)
        for lane in range(8 * g, 8 * g + 8):
            sxl[lane] = s


@njit(cache=True)
def quantize_for(x, coef, half):
    """The int8 activations rows of weights (coef, half) take: quantize(x, half) for int4
    weights; for q8_0 (coef Q8_COEF) quantize_q8_into's, in the same five slots (xlo: xq;
    xhi: xq again; negc and xsl empty: the q8 rows read neither)."""
    if coef == Q8_COEF:
        n = x.shape[0]
        xq, sxl = np.empty(n, np.int8), np.empty(n // 4, np.float32)
        quantize_q8_into(x, xq, sxl)
        return xq, xq, np.empty(0, np.int32), np.empty(0, np.float32), sxl
    return quantize(x, half)


@njit(cache=True)
def quantize_rows_for(x, coef, half):
    """quantize_for of each activation row [L, n], with a leading L axis."""
    if coef == Q8_COEF:
        L, n = x.shape
        xq, sxl = np.empty((L, n), np.int8), np.empty((L, n // 4), np.float32)
        for r in range(L):
            quantize_q8_into(x[r], xq[r], sxl[r])
        return xq, xq, np.empty((L, 0), np.int32), np.empty((L, 0), np.float32), sxl
    return quantize_rows(x, half)


# --- rows -------------------------------------------------------------------------------


# Rows interleaved in pairs (rows of qtensor.PAIR_ROW_BYTES or more) are read a pair at a time,
# each pair prefetching the next, so a thread walks its rows' bytes front to back in one
# stream; an 8-row tile over pairs walks four streams 2 KB apart, and 1 KB rows stream faster
# from DRAM in pairs (docs/benchmarks.md, Kernels: rows read in pairs). Pairs load each piece of x for two rows
# where eights load it for eight, which only pays where the reads are the limit, as they are
# from DRAM. Rows of 768 B and less (interleaved in eights) read as fast either way and keep
# 8-row tiles. A row's operations do not depend on the tile, so the bits are the same.


@njit(cache=True)
def rows8(q, scales, offs, coef, half, ilv, xa, r, d):
    """d[0:8] = rows r..r+7 of int4 weights (cpu.int4_weight's q, scales, offs, coef, half,
    ilv) times quantized activations xa; the next rows are prefetched."""
    xlo, xhi, negc, xsl, sxl = xa
    if ilv == 2:
        for j in range(0, 8, 2):
            rr = r + j
            _idot2(q, scales, offs, rr, rr + 2 if rr + 4 <= q.shape[0] else rr, xlo, xhi, negc, xsl, sxl,
                   d[j:], coef, half, ilv)
        return
    rn = r + 8 if r + 16 <= q.shape[0] else r
    if PARTS == 2:  # 16 registers: two runs of four rows (see _idot4)
        _idot4(q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, d, coef, half, ilv)
        _idot4(q, scales, offs, r + 4, rn + 4, xlo, xhi, negc, xsl, sxl, d[4:], coef, half, ilv)
        return
    _idot8(q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, d, coef, half, ilv)


@njit(cache=True)
def row1(q, scales, offs, coef, half, ilv, xa, r, d):
    """d[0] = row r alone (the rows past the last whole block of eight)."""
    xlo, xhi, negc, xsl, sxl = xa
    _idot1(q, scales, offs, r, r, xlo, xhi, negc, xsl, sxl, d, coef, half, ilv)


@njit(cache=True)
def _rows_into(q, scales, offs, coef, half, ilv, xa, y, t, nthreads):
    """Thread t's contiguous run of 8-row blocks of y = W @ x; thread 0 also takes the rows
    past the last block."""
    out = q.shape[0]
    nblk = out // 8
    per = (nblk + nthreads - 1) // nthreads
    d = np.empty(8, np.float32)
    for blk in range(t * per, min(nblk, (t + 1) * per)):
        r = 8 * blk
        rows8(q, scales, offs, coef, half, ilv, xa, r, d)
        for j in range(8):
            y[r + j] = d[j]
    if t == 0:
        for r in range(8 * nblk, out):
            row1(q, scales, offs, coef, half, ilv, xa, r, d)
            y[r] = d[0]


@njit(parallel=True, cache=True)
def matvec_prepared(q, scales, offs, coef, half, ilv, xa, y, nthreads):
    """y = W @ x for activations already quantized (xa = quantize(x, half))."""
    for t in prange(nthreads):
        _rows_into(q, scales, offs, coef, half, ilv, xa, y, t, nthreads)


@njit(cache=True)
def matvec(q, scales, offs, coef, half, ilv, x, y, nthreads):
    """y = W @ x, x float32 [n] quantized here (the weight tuple of weight_of: cpu.int4_weight's,
    or q8_0's)."""
    matvec_prepared(q, scales, offs, coef, half, ilv, quantize_for(x, coef, half), y, nthreads)


@njit(parallel=True, cache=True)
def matmul(q, scales, offs, coef, half, ilv, x, y, nthreads):
    """y [L, out] = x [L, n] @ W.T: tiles of 4 weight rows x 4 activation rows, each weight
    chunk unpacked once per tile; the rows and activation rows past the last whole tile one at
    a time. Row l of y equals matvec(x[l]) bit for bit (the same operations per pair)."""
    xlo, xhi, negc, xsl, sxl = quantize_rows_for(x, coef, half)
    out, L = q.shape[0], x.shape[0]
    nblk = (out + TILE_ROWS - 1) // TILE_ROWS
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = TILE_ROWS * blk
            whole = r + TILE_ROWS <= out
            l0 = 0
            if whole:
                while l0 + TILE_COLS <= L:
                    _idot_tile(q, scales, offs, r, r, xlo, xhi, negc, xsl, sxl, l0, y, coef, half, ilv)
                    l0 += TILE_COLS
            for lrow in range(l0, L):
                xa = (xlo[lrow], xhi[lrow], negc[lrow], xsl[lrow], sxl[lrow])
                for rr in range(r, min(r + TILE_ROWS, out)):
                    row1(q, scales, offs, coef, half, ilv, xa, rr, d)
                    y[lrow, rr] = d[0]


# --- the activation mode inside compiled blocks ------------------------------------------
# The fused decode blocks (decode.py) and the fused MoE kernel (moe.py) take the mode as an
# argument whose numba TYPE selects the code (marker()): each mode compiles only its own path,
# so the default exact path's first-start compile is what it was.


def marker(mode: str):
    """The compiled blocks' `act` argument for `mode`: float32 for the exact path, int8 for
    int8 activations (only the type matters)."""
    return np.int8(0) if mode == "int8" else np.float32(0.0)


def matvec_into(w, x, y, nthreads, act):
    """y = W @ x for the weight tuple w (cpu.int4_weight) in act's mode (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def matmul_rows_into(w, x, y, nthreads, act):
    """y[a] = W @ x[a] for each row of x [B, n], the bits of matvec_into row by row, the weights
    read once for all rows (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def prepare(x, half, act):
    """What the row code needs of x: x laid out for the int4 blocks and its group sums
    (exact), or its int8 form (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def prepare_rows(x, half, act):
    """prepare() of each row of x [K, n], as arrays with a leading K axis (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def row_of(xp, k, act):
    """Row k of prepare_rows' result, as prepare() would give it (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def rows8_into(q, scales, offs, coef, half, cshift, ilv, x, xp, r, d, act):
    """d[0:8] = rows r..r+7 of W @ x, xp = prepare(x, half, act) (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def tail_rows_into(q, scales, offs, coef, half, x, xp, y, act):
    """y[r] for the rows past the last whole block of eight, as the matvec computes them
    (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def _int8(act) -> bool:
    return isinstance(act, types.Integer)


@overload(matvec_into)
def _matvec_into(w, x, y, nthreads, act):
    if _int8(act):
        def int8(w, x, y, nthreads, act):
            q, scales, offs, coef, half, _, ilv = w
            matvec(q, scales, offs, coef, half, ilv, x, y, nthreads)
        return int8

    def exact(w, x, y, nthreads, act):
        q, scales, offs, coef, half, cshift, ilv = w
        matvec_int4(q, scales, offs, coef, half, cshift, ilv, x, y, nthreads)
    return exact


@overload(matmul_rows_into)
def _matmul_rows_into(w, x, y, nthreads, act):
    if _int8(act):
        def int8(w, x, y, nthreads, act):
            q, scales, offs, coef, half, _, ilv = w
            matmul(q, scales, offs, coef, half, ilv, x, y, nthreads)
        return int8

    def exact(w, x, y, nthreads, act):
        q, scales, offs, coef, half, cshift, ilv = w
        matmul_rows_int4(q, scales, offs, coef, half, cshift, ilv, x, y, nthreads)
    return exact


@overload(prepare)
def _prepare(x, half, act):
    if _int8(act):
        return lambda x, half, act: quantize(x, half)
    return lambda x, half, act: (prepare_x(x, half), group_sums(x, 2 * half))


@overload(prepare_rows)
def _prepare_rows(x, half, act):
    if _int8(act):
        return lambda x, half, act: quantize_rows(x, half)

    def exact(x, half, act):
        xp = np.empty_like(x)
        xs = np.empty((x.shape[0], x.shape[1] // (2 * half)), np.float32)
        for k in range(x.shape[0]):
            prepare_x_into(x[k], half, xp[k])
            group_sums_into(x[k], 2 * half, xs[k])
        return xp, xs
    return exact


@overload(row_of)
def _row_of(xp, k, act):
    if _int8(act):
        return lambda xp, k, act: (xp[0][k], xp[1][k], xp[2][k], xp[3][k], xp[4][k])
    return lambda xp, k, act: (xp[0][k], xp[1][k])


@overload(rows8_into)
def _rows8_into(q, scales, offs, coef, half, cshift, ilv, x, xp, r, d, act):
    if _int8(act):
        return lambda q, scales, offs, coef, half, cshift, ilv, x, xp, r, d, act: rows8(
            q, scales, offs, coef, half, ilv, xp, r, d)
    return lambda q, scales, offs, coef, half, cshift, ilv, x, xp, r, d, act: int4_rows8(
        q, scales, offs, coef, half, cshift, ilv, xp[0], xp[1], r, d)


@overload(tail_rows_into)
def _tail_rows_into(q, scales, offs, coef, half, x, xp, y, act):
    if _int8(act):
        def int8(q, scales, offs, coef, half, x, xp, y, act):
            d = np.empty(8, np.float32)
            for r in range(q.shape[0] - q.shape[0] % 8, q.shape[0]):  # row-major: interleaved q has none
                row1(q, scales, offs, coef, half, 1, xp, r, d)
                y[r] = d[0]
        return int8
    return lambda q, scales, offs, coef, half, x, xp, y, act: int4_tail_rows(q, scales, offs, coef, half, x, xp[1], y)


# --- QTensor entry points (the model's linear() calls these in int8 mode) ----------------


SCHEMES = INT4_SCHEMES + ("q8_0",)  # what the QTensor entry points take


def weight_of(t: QTensor) -> tuple:
    """The row code's weight tuple (q, scales, offs, coef, half, _, ilv) for t: cpu.int4_weight's,
    or for q8_0 its int8 rows and group scales, coef Q8_COEF, 32 bytes a group."""
    if t.scheme == "q8_0":
        check_tensor(t)
        return t.q, t.scales, t.scales, np.float32(Q8_COEF), 32, 0, t.interleave
    w = int4_weight(t)
    if w is None:
        raise ValueError(f"int8 activations take int4 or q8_0 weights ({', '.join(SCHEMES)}), not {t.scheme}; "
                         "other schemes run with --activations f32")
    return w


def matvec_q(t: QTensor, x: np.ndarray) -> np.ndarray:
    """dequantize(t) @ x with x rounded to int8 per group; t an int4 scheme or q8_0."""
    q, scales, offs, coef, half, _, ilv = weight_of(t)
    x = checked_x(x, 1, t.shape[1], "matvec")
    y = np.empty(t.shape[0], np.float32)
    if y.size:
        matvec(q, scales, offs, coef, half, ilv, x, y, get_num_threads())
    return y


def matmul_q(t: QTensor, x: np.ndarray) -> np.ndarray:
    """x @ dequantize(t).T with each row of x rounded to int8 per group; row l equals
    matvec_q(t, x[l]) bit for bit."""
    q, scales, offs, coef, half, _, ilv = weight_of(t)
    x = checked_x(x, 2, t.shape[1], "matmul")
    y = np.empty((x.shape[0], t.shape[0]), np.float32)
    if y.size:
        matmul(q, scales, offs, coef, half, ilv, x, y, get_num_threads())
    return y
