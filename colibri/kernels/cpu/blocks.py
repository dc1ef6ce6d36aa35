"""The CPU kernels of GGUF's block schemes (formats/ggml_blocks.py): Q2_K..Q6_K, IQ4_NL,
IQ4_XS, Q5_0, Q5_1 and MXFP4, read in ggml's byte layout as the file holds them.

Every block type is one integer code per weight and a float scale (and, for some, an offset)
per 16 weights: w = scale * code + offset, the code a small integer (Q4_K's nibble, Q6_K's
6 bits less 32, IQ4's and MXFP4's table values), the scale d * sub-block scale, the offset
-dmin * min (Q2_K, Q4_K, Q5_K) or Q5_1's m. So a row is read in two steps:

1. decode_blocks: a row's blocks -> int8 codes [n] and float32 scales and offsets [n / 16]
   (a 32-weight sub-block's scale written twice): bit fields moved with 16-byte vector IR
   (bits_into & co.; integer work, one result whatever the order), the sub-block scales all
   lanes at once (_scale_fields), IQ4 / MXFP4 table lookups by byte shuffle. One function for
   every type, the type a runtime code (TYPE_CODE), so each entry point compiles once.
2. The dot products of q8_0 (codegen.py's int8 row tiles, group 16) over those codes, eight
   rows (or TILE_W rows x TILE_A tokens) at a time, plus the offset term
   sum_g offset_g * sum(x_g) with x's 16-wide sums taken once per call (with_offsets8).

The decoded codes of eight rows are a thread's scratch (one byte a weight, in L1 or L2: never
a dequantized float row); the weights are streamed once, one row after the other. Every row of
every entry point (matvec, matvec_rows, the fused MoE kernel) goes through the same decode and
the same IR tile code in a written order, no fastmath, so a (weight row, x) pair gives the
same bits whoever calls it and with any number of threads; a tail of fewer than eight rows
runs in the same eight-row tile (the unused rows discarded).

The exact dequantizer (deq_block_row: embedding, prefill's tiles) is decode_blocks followed by
w = scale * float(code) + offset per weight, which is gguf-py's arithmetic: its products are
the same float32 products (d * sc first, then by the code) and an offset-free type's offset is
-0.0, which adds nothing to any float (x + -0.0 == x, -0.0 included).
"""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri.formats.ggml_blocks import BLOCK_SCHEMES, BLOCK_TYPES

from .codegen import (
    TILE_A,
    TILE_W,
    f16_f32,
    q8_dot8,
    q8_tile1,
    q8_tile2,
    q8_tile3,
    q8_tile4,
    with_offsets8,
    with_offsets_tile,
)
from .block_tiles import (
    FUSED,
    PSHUFB_KINDS,
    iq4nl_dot8,
    iq4xs_dot8,
    mxfp4_dot8,
    prepare_x_fused,
    prepared_len,
    q2k_dot8,
    q3k_dot8,
    q4k_dot8,
    q5_0_dot8,
    q5_1_dot8,
    q5k_dot8,
    q6k_dot8,
    sums16,
)
from .target import PSHUFB

# scheme -> the kernels' type code; the tables below are indexed by it.
TYPE_CODE = {s: i for i, s in enumerate(BLOCK_SCHEMES)}
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, Q5_0, Q5_1, MXFP4 = (
    TYPE_CODE[s] for s in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs", "q5_0", "q5_1", "mxfp4"))
ELEMENTS = np.array([BLOCK_TYPES[s].elements for s in BLOCK_SCHEMES], np.int64)
NBYTES = np.array([BLOCK_TYPES[s].nbytes for s in BLOCK_SCHEMES], np.int64)
# Types with a per-sub-block offset (a min): their matvec adds the offset term.
HAS_OFFSET = np.array([s in ("q2_k", "q4_k", "q5_k", "q5_1") for s in BLOCK_SCHEMES], np.bool_)
# scheme code -> its fused tile's index in block_tiles.FUSED (-1: decoded, then dotted)
# (the lookup types' tiles shuffle bytes with x86's pshufb: elsewhere they are decoded)
FUSED_KIND = np.array([FUSED.index(s) if s in FUSED and (PSHUFB or s not in PSHUFB_KINDS) else -1
                       for s in BLOCK_SCHEMES], np.int64)
GROUP = 16  # weights per decoded scale: the smallest sub-block (Q2_K, Q3_K, Q6_K)

_KV_IQ4 = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_KV_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)  # e2m1, doubled
_NEG0 = np.float32(-0.0)


# --- the integer decoding, as LLVM vector IR ----------------------------------------------
# numba's own byte loops stayed scalar (fully unrolled, then not vectorized; or vectorized in
# 64-bit lanes): ~2 ns a weight, 10x the dot product. These work on 16 bytes at a time.

_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V16B = ir.VectorType(_I8, 16)
_V32B = ir.VectorType(_I8, 32)
_V32I = ir.VectorType(_I32, 32)


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _byte_ptr(context, builder, aty, a, index):
    data = context.make_array(aty)(context, builder, a).data
    return builder.gep(builder.bitcast(data, _I8.as_pointer()), [index])


@intrinsic
def bits_into(typingctx, src, so, shift, mask, lsh, codes, co, n, acc):
    """codes[co + i] = (codes[co + i] if acc else 0) + (((src[so + i] >> shift) & mask) << lsh)
    for i < n (a multiple of 16), in bytes (wrapping): a bit field of every byte of src, moved
    to its place in the codes."""
    def codegen(context, builder, sig, args):
        s, o, sh, mk, ls, c, cofs, cnt, ac = args
        sp = _byte_ptr(context, builder, sig.args[0], s, o)
        cp = _byte_ptr(context, builder, sig.args[5], c, cofs)
        vsh = _splat(builder, builder.trunc(sh, _I8), _V16B)
        vmk = _splat(builder, builder.trunc(mk, _I8), _V16B)
        vls = _splat(builder, builder.trunc(ls, _I8), _V16B)
        keep = _splat(builder, builder.select(ac, ir.Constant(_I8, 255), ir.Constant(_I8, 0)), _V16B)
        with cgutils.for_range(builder, builder.lshr(cnt, ir.Constant(_I64, 4))) as loop:
            off = builder.shl(loop.index, ir.Constant(_I64, 4))
            vp = builder.bitcast(builder.gep(sp, [off]), _V16B.as_pointer())
            dp = builder.bitcast(builder.gep(cp, [off]), _V16B.as_pointer())
            v = builder.shl(builder.and_(builder.lshr(builder.load(vp, align=1), vsh), vmk), vls)
            builder.store(builder.add(v, builder.and_(builder.load(dp, align=1), keep)), dp, align=1)
        return context.get_dummy_value()
    return types.void(src, types.intp, types.intp, types.intp, types.intp, codes, types.intp, types.intp,
                      types.boolean), codegen


@intrinsic
def qh_bits_into(typingctx, src, so, codes, co, val):
    """codes[co + e] += val where bit e of the little-endian 32-bit word at src[so] is set, for
    e < 32 (Q5_0 / Q5_1's qh): each byte of the word spread over eight lanes, one bit each."""
    def codegen(context, builder, sig, args):
        s_, o, c, cofs, v = args
        sp = builder.bitcast(_byte_ptr(context, builder, sig.args[0], s_, o), ir.VectorType(_I8, 4).as_pointer())
        cp = builder.bitcast(_byte_ptr(context, builder, sig.args[2], c, cofs), _V32B.as_pointer())
        w = builder.load(sp, align=1)
        spread = builder.shuffle_vector(w, w, ir.Constant(_V32I, [i // 8 for i in range(32)]))
        bits = builder.and_(spread, ir.Constant(_V32B, [1 << (i & 7) for i in range(32)]))
        add = builder.select(builder.icmp_unsigned("!=", bits, ir.Constant(_V32B, [0] * 32)),
                             _splat(builder, builder.trunc(v, _I8), _V32B), ir.Constant(_V32B, [0] * 32))
        builder.store(builder.add(add, builder.load(cp, align=1)), cp, align=1)
        return context.get_dummy_value()
    return types.void(src, types.intp, codes, types.intp, types.int64), codegen


@intrinsic
def add_into(typingctx, codes, co, n, c):
    """codes[co + i] += c for i < n (a multiple of 16)."""
    def codegen(context, builder, sig, args):
        a, cofs, cnt, cv = args
        cp = _byte_ptr(context, builder, sig.args[0], a, cofs)
        vc = _splat(builder, builder.trunc(cv, _I8), _V16B)
        with cgutils.for_range(builder, builder.lshr(cnt, ir.Constant(_I64, 4))) as loop:
            dp = builder.bitcast(builder.gep(cp, [builder.shl(loop.index, ir.Constant(_I64, 4))]), _V16B.as_pointer())
            builder.store(builder.add(builder.load(dp, align=1), vc), dp, align=1)
        return context.get_dummy_value()
    return types.void(codes, types.intp, types.intp, types.int64), codegen


@intrinsic
def lut_into(typingctx, codes, co, n, table):
    """codes[co + i] = table[codes[co + i]] for i < n (a multiple of 16; codes 0..15, table
    int8 [16])."""
    def codegen(context, builder, sig, args):
        a, cofs, cnt, tab = args
        cp = _byte_ptr(context, builder, sig.args[0], a, cofs)
        tp = _byte_ptr(context, builder, sig.args[3], tab, ir.Constant(_I64, 0))
        tv = builder.load(builder.bitcast(tp, _V16B.as_pointer()), align=1)
        if PSHUFB:
            shuf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16B, [_V16B, _V16B]),
                                                  "llvm.x86.ssse3.pshuf.b.128")
        else:
            vals = [_splat(builder, builder.extract_element(tv, ir.Constant(_I32, k)), _V16B) for k in range(16)]
        with cgutils.for_range(builder, builder.lshr(cnt, ir.Constant(_I64, 4))) as loop:
            dp = builder.bitcast(builder.gep(cp, [builder.shl(loop.index, ir.Constant(_I64, 4))]), _V16B.as_pointer())
            v = builder.load(dp, align=1)
            if PSHUFB:
                r = builder.call(shuf, [tv, v])
            else:
                r = vals[0]
                for k in range(1, 16):
                    r = builder.select(builder.icmp_unsigned("==", v, ir.Constant(_V16B, [k] * 16)), vals[k], r)
            builder.store(r, dp, align=1)
        return context.get_dummy_value()
    return types.void(codes, types.intp, types.intp, table), codegen


# A K-quant block's sub-block scales (and mins) are bit fields of a few bytes; lane j's value is
# sum_f ((src[p + at_f[j]] >> shift_f[j]) & mask_f[j]) << lsh_f[j], then (v ^ xor) + bias (xor
# 128, bias -128: a signed byte). Decoded all lanes at once: one load of the bytes, a shuffle
# per field, then d * float(v) (and -(dmin * float(m))), each the scalar code's one rounding.
_V16F = ir.VectorType(ir.FloatType(), 16)


def _scale_fields(nbytes: int, lanes: int, scale: tuple, mins: tuple | None):
    """An intrinsic (src, p, d, dmin, scales, offs, g0) writing scales[g0 : g0 + 16] and
    offs[g0 : g0 + 16] for a block at byte p of src: `lanes` values (16, or 8 each written
    twice), their fields `scale` / `mins` = (fields, xor, bias), a field = per-lane lists
    (at, shift, mask, lsh); offs -0.0 where mins is None."""
    every = [f for spec in (scale, mins) if spec for f in spec[0]]
    lo = min(min(f[0]) for f in every)
    width = 32 if max(max(f[0]) for f in every) - lo >= 16 else 16
    base = max(0, min(lo, nbytes - width))
    vb = ir.VectorType(_I8, width)
    vi = ir.VectorType(_I32, lanes)

    def values(builder, raw, spec):
        fields, xor, bias = spec
        total = None
        for at, shift, mask, lsh in fields:
            v = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, lanes), [a - base for a in at]))
            v = builder.zext(v, vi)
            v = builder.shl(builder.and_(builder.lshr(v, ir.Constant(vi, list(shift))), ir.Constant(vi, list(mask))),
                            ir.Constant(vi, list(lsh)))
            total = v if total is None else builder.add(total, v)
        total = builder.add(builder.xor(total, ir.Constant(vi, [xor] * lanes)), ir.Constant(vi, [bias] * lanes))
        return builder.sitofp(total, ir.VectorType(ir.FloatType(), lanes))

    def spread(builder, v):  # 8 lanes -> 16, each twice (a 32-weight sub-block's two groups of 16)
        if lanes == 16:
            return v
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [i // 2 for i in range(16)]))

    def fields(typingctx, src, p, d, dmin, scales, offs, g0):
        def codegen(context, builder, sig, args):
            s_, p_, d_, dmin_, sc_, of_, g0_ = args
            sp = _byte_ptr(context, builder, sig.args[0], s_, builder.add(p_, ir.Constant(_I64, base)))
            raw = builder.load(builder.bitcast(sp, vb.as_pointer()), align=1)
            f32p = ir.FloatType().as_pointer()
            scp = builder.gep(builder.bitcast(context.make_array(sig.args[4])(context, builder, sc_).data, f32p), [g0_])
            ofp = builder.gep(builder.bitcast(context.make_array(sig.args[5])(context, builder, of_).data, f32p), [g0_])
            vty = ir.VectorType(ir.FloatType(), lanes)
            dv = builder.fmul(_splat(builder, d_, vty), values(builder, raw, scale))
            builder.store(spread(builder, dv), builder.bitcast(scp, _V16F.as_pointer()), align=4)
            if mins is None:
                mv = ir.Constant(_V16F, [-0.0] * 16)
            else:
                mv = spread(builder, builder.fneg(builder.fmul(_splat(builder, dmin_, vty), values(builder, raw, mins))))
            builder.store(mv, builder.bitcast(ofp, _V16F.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.void(src, types.intp, types.float32, types.float32, scales, offs, types.intp), codegen
    return intrinsic(fields)


def _lanes(fn, n):
    return [fn(j) for j in range(n)]


_q2k_scales = _scale_fields(84, 16, ([(_lanes(lambda j: j, 16), [0] * 16, [15] * 16, [0] * 16)], 0, 0),
                            ([(_lanes(lambda j: j, 16), [4] * 16, [15] * 16, [0] * 16)], 0, 0))
_q3k_scales = _scale_fields(110, 16, ([(_lanes(lambda j: 96 + (j & 7), 16), _lanes(lambda j: 4 * (j >> 3), 16),
                                        [15] * 16, [0] * 16),
                                       (_lanes(lambda j: 104 + (j & 3), 16), _lanes(lambda j: 2 * (j >> 2), 16),
                                        [3] * 16, [4] * 16)], 0, -32), None)
# Q4_K / Q5_K (get_scale_min_k4, the 12 bytes at 4): sc j<4 = s[j] & 63, j>=4 = (s[j+4] & 15)
# | (s[j-4] >> 6) << 4; m j<4 = s[j+4] & 63, j>=4 = (s[j+4] >> 4) | (s[j] >> 6) << 4.
_k4_scales = _scale_fields(144, 8, (
    [(_lanes(lambda j: 4 + j if j < 4 else 8 + j, 8), [0] * 8, _lanes(lambda j: 63 if j < 4 else 15, 8), [0] * 8),
     (_lanes(lambda j: 4 if j < 4 else j, 8), [2] * 8, _lanes(lambda j: 0 if j < 4 else 0x30, 8), [0] * 8)], 0, 0), (
    [(_lanes(lambda j: 8 + j, 8), _lanes(lambda j: 0 if j < 4 else 4, 8), _lanes(lambda j: 63 if j < 4 else 15, 8),
      [0] * 8),
     (_lanes(lambda j: 4 if j < 4 else 4 + j, 8), [2] * 8, _lanes(lambda j: 0 if j < 4 else 0x30, 8), [0] * 8)], 0, 0))
_q6k_scales = _scale_fields(210, 16, ([(_lanes(lambda j: 192 + j, 16), [0] * 16, [255] * 16, [0] * 16)], 128, -128),
                            None)
_iq4xs_scales = _scale_fields(136, 8, ([(_lanes(lambda j: 4 + (j >> 1), 8), _lanes(lambda j: 4 * (j & 1), 8),
                                         [15] * 8, [0] * 8),
                                        (_lanes(lambda j: 2 + (j >> 2), 8), _lanes(lambda j: 2 * (j & 3), 8),
                                         [3] * 8, [4] * 8)], 0, -32), None)


@intrinsic
def _bits_f32(typingctx, v):
    """The low 32 bits of an int64 as a float32's bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)), ir.FloatType())
    return types.float32(types.int64), codegen


@njit(cache=True)
def _f16_at(src, o):
    """The little-endian IEEE half at bytes o, o + 1 of src, as float32 (exact)."""
    return f16_f32(np.uint16(np.int64(src[o]) | (np.int64(src[o + 1]) << 8)))


@njit(cache=True)
def _nibbles32(src, q0, d, m, codes, scales, offs, b):
    """A 32-weight block b: codes from the 16 bytes at q0 (low nibbles, then high ones), scale d
    and offset m for both its groups of 16."""
    bits_into(src, q0, 0, 15, 0, codes, 32 * b, 16, False)
    bits_into(src, q0, 4, 15, 0, codes, 32 * b + 16, 16, False)
    scales[2 * b] = d
    scales[2 * b + 1] = d
    offs[2 * b] = m
    offs[2 * b + 1] = m


@njit(cache=True)
def decode_blocks(tc, src, b0, nb, codes, scales, offs):
    """Blocks b0 .. b0+nb-1 of a row's bytes src (type tc) -> codes[0 : nb*E] (int8),
    scales[0 : nb*E/16], offs[0 : nb*E/16] (float32): weight e is scales[e//16] * codes[e] +
    offs[e//16]. Offset-free types get offs -0.0."""
    nbytes = NBYTES[tc]
    if tc == Q2_K:  # scales[16] qs[64] d dmin
        for b in range(nb):
            p, e0, g0 = (b0 + b) * nbytes, 256 * b, 16 * b
            _q2k_scales(src, p, _f16_at(src, p + 80), _f16_at(src, p + 82), scales, offs, g0)
            for h in range(2):
                for s in range(4):
                    bits_into(src, p + 16 + 32 * h, 2 * s, 3, 0, codes, e0 + 128 * h + 32 * s, 32, False)
    elif tc == Q3_K:  # hmask[32] qs[64] scales[12] d
        for b in range(nb):
            p, e0, g0 = (b0 + b) * nbytes, 256 * b, 16 * b
            _q3k_scales(src, p, _f16_at(src, p + 108), _NEG0, scales, offs, g0)
            for h in range(2):
                for s in range(4):  # ql + 4 * hmask bit - 4
                    o = e0 + 128 * h + 32 * s
                    bits_into(src, p + 32 + 32 * h, 2 * s, 3, 0, codes, o, 32, False)
                    bits_into(src, p, 4 * h + s, 1, 2, codes, o, 32, True)
        add_into(codes, 0, 256 * nb, -4)
    elif tc == Q4_K or tc == Q5_K:  # d dmin scales[12] (qh[32]) qs[128]
        five = tc == Q5_K
        qs = 48 if five else 16
        for b in range(nb):
            p, e0, g0 = (b0 + b) * nbytes, 256 * b, 16 * b
            _k4_scales(src, p, _f16_at(src, p), _f16_at(src, p + 2), scales, offs, g0)
            for c in range(4):
                o = e0 + 64 * c
                bits_into(src, p + qs + 32 * c, 0, 15, 0, codes, o, 32, False)
                bits_into(src, p + qs + 32 * c, 4, 15, 0, codes, o + 32, 32, False)
                if five:
                    bits_into(src, p + 16, 2 * c, 1, 4, codes, o, 32, True)
                    bits_into(src, p + 16, 2 * c + 1, 1, 4, codes, o + 32, 32, True)
    elif tc == Q6_K:  # ql[128] qh[64] scales[16] (int8) d
        for b in range(nb):
            p, e0, g0 = (b0 + b) * nbytes, 256 * b, 16 * b
            _q6k_scales(src, p, _f16_at(src, p + 208), _NEG0, scales, offs, g0)
            for h in range(2):
                for s in range(4):  # (ql | qh << 4) - 32
                    o = e0 + 128 * h + 32 * s
                    bits_into(src, p + 64 * h + 32 * (s & 1), 4 * (s >> 1), 15, 0, codes, o, 32, False)
                    bits_into(src, p + 128 + 32 * h, 2 * s, 3, 4, codes, o, 32, True)
        add_into(codes, 0, 256 * nb, -32)
    elif tc == IQ4_XS:  # d scales_h (u16) scales_l[4] qs[128]
        for b in range(nb):
            p, e0, g0 = (b0 + b) * nbytes, 256 * b, 16 * b
            _iq4xs_scales(src, p, _f16_at(src, p), _NEG0, scales, offs, g0)
            for j in range(8):
                bits_into(src, p + 8 + 16 * j, 0, 15, 0, codes, e0 + 32 * j, 16, False)
                bits_into(src, p + 8 + 16 * j, 4, 15, 0, codes, e0 + 32 * j + 16, 16, False)
        lut_into(codes, 0, 256 * nb, _KV_IQ4)
    elif tc == MXFP4:  # e (E8M0) qs[16]
        for b in range(nb):
            p = (b0 + b) * nbytes
            e = np.int64(src[p])  # ggml_e8m0_to_fp32_half
            d = _bits_f32(np.int64(0x00200000) << e if e < 2 else (e - 1) << 23)
            _nibbles32(src, p + 1, d, _NEG0, codes, scales, offs, b)
        lut_into(codes, 0, 32 * nb, _KV_MXFP4)
    elif tc == IQ4_NL:  # d qs[16]
        for b in range(nb):
            p = (b0 + b) * nbytes
            _nibbles32(src, p + 2, _f16_at(src, p), _NEG0, codes, scales, offs, b)
        lut_into(codes, 0, 32 * nb, _KV_IQ4)
    elif tc == Q5_0:  # d qh[4] qs[16]
        for b in range(nb):
            p = (b0 + b) * nbytes
            _nibbles32(src, p + 6, _f16_at(src, p), _NEG0, codes, scales, offs, b)
            qh_bits_into(src, p + 2, codes, 32 * b, 16)
        add_into(codes, 0, 32 * nb, -16)
    else:  # Q5_1: d m qh[4] qs[16]
        for b in range(nb):
            p = (b0 + b) * nbytes
            _nibbles32(src, p + 8, _f16_at(src, p), _f16_at(src, p + 2), codes, scales, offs, b)
            qh_bits_into(src, p + 4, codes, 32 * b, 16)


# --- the exact dequantizer (embedding, prefill) ---------------------------------------------


@njit(cache=True)
def deq_block_row(tc, src, dst):
    """A row's bytes src -> dst float32 [n], equal to gguf-py's dequantize bit for bit; 256
    weights at a time through decode_blocks."""
    n = dst.shape[0]
    el = ELEMENTS[tc]
    codes = np.empty(256, np.int8)
    sc = np.empty(16, np.float32)
    of = np.empty(16, np.float32)
    for e0 in range(0, n, 256):
        m = min(256, n - e0)
        decode_blocks(tc, src, e0 // el, m // el, codes, sc, of)
        for i in range(m):
            dst[e0 + i] = sc[i >> 4] * np.float32(codes[i]) + of[i >> 4]


@njit(cache=True, nogil=True)
def deq_block_tile(tc, q, r0, nr, buf):
    """buf[:nr] = rows r0 .. r0+nr of the matrix q (prefill's BLAS tiles)."""
    for j in range(nr):
        deq_block_row(tc, q[r0 + j], buf[j])


@njit(parallel=True, cache=True)
def embed_blocks(tc, q, ids, y):
    for i in prange(ids.shape[0]):
        deq_block_row(tc, q[ids[i]], y[i])


# --- decode: the row dots ----------------------------------------------------------------


@njit(cache=True)
def x_prep_len(tc, n):
    """The length of what type tc's row dots need of an x of n elements besides x itself
    (x_prep_into)."""
    if FUSED_KIND[tc] >= 0:
        p = prepared_len(FUSED_KIND[tc], n)
        return p + p // GROUP + GROUP
    return n // GROUP if HAS_OFFSET[tc] else 0


@njit(cache=True)
def x_prep_into(tc, x, xs):
    """xs [x_prep_len]: the fused tiles (FUSED_KIND) take x laid out for them and x's
    16-wide sums (block_tiles.prepare_x_fused); the other offset types x's 16-wide sums; the
    rest nothing."""
    if FUSED_KIND[tc] >= 0:
        p = prepared_len(FUSED_KIND[tc], x.shape[0])
        prepare_x_fused(FUSED_KIND[tc], x, xs[:p], xs[p:])
    else:
        sums16(x, xs)


@njit(cache=True)
def x_sums(tc, x):
    """x_prep_into's array for x."""
    xs = np.empty(x_prep_len(tc, x.shape[0]), np.float32)
    x_prep_into(tc, x, xs)
    return xs


@njit(cache=True)
def block_scratch(n):
    """A thread's decoded codes, scales and offsets of eight rows of n weights."""
    return (np.zeros((8, n), np.int8), np.zeros((8, n // GROUP), np.float32),
            np.zeros((8, n // GROUP), np.float32))


@njit(cache=True)
def decode_rows8(tc, q, r, codes, sc, of):
    """Rows r .. r+7 of q (as many as there are) decoded into the scratch's rows 0..7."""
    nb = codes.shape[1] // ELEMENTS[tc]
    for j in range(min(8, q.shape[0] - r)):
        decode_blocks(tc, q[r + j], 0, nb, codes[j], sc[j], of[j])


@njit(cache=True)
def dot_rows8(codes, sc, of, x, xs, d):
    """d[0:8] = the decoded scratch rows . x, offsets included (xs: x_sums)."""
    q8_dot8(codes, sc, 0, 0, x, GROUP, 0, 1, d, 0)
    with_offsets8(d, of, 0, np.float32(1.0), xs)


@njit(cache=True)
def block_rows8(tc, q, r, x, xs, codes, sc, of, d):
    """d[0:8] = rows r .. r+7 of dequantize(q) @ x (rows past the end: garbage; xs: x_sums).
    Shared by matvec_blocks, matmul_rows_blocks and the fused MoE kernel (moe.py). Every type
    reads its bytes in one fused tile (block_tiles.py) where FUSED_KIND has one (the lookup
    types only on x86); elsewhere it is decoded, then dotted."""
    if FUSED_KIND[tc] >= 0:
        p = prepared_len(FUSED_KIND[tc], x.shape[0])
        xp, xsum = xs[:p], xs[p:]
        if tc == Q4_K:
            q4k_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == Q6_K:
            q6k_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == Q5_K:
            q5k_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == Q2_K:
            q2k_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == MXFP4:
            mxfp4_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == IQ4_NL:
            iq4nl_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == Q5_0:
            q5_0_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == Q5_1:
            q5_1_dot8(q, r, r + 8, xp, xsum, d)
        elif tc == Q3_K:
            q3k_dot8(q, r, r + 8, xp, xsum, d)
        else:
            iq4xs_dot8(q, r, r + 8, xp, xsum, d)
        return
    decode_rows8(tc, q, r, codes, sc, of)
    dot_rows8(codes, sc, of, x, xs, d)


@njit(parallel=True, cache=True)
def matvec_blocks(tc, q, x, y, nthreads):
    """y = dequantize(q) @ x for a block-scheme matrix q (uint8 [out, row bytes])."""
    out, n = q.shape[0], x.shape[0]
    xs = x_sums(tc, x)
    nblk = (out + 7) // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        codes, sc, of = block_scratch(n)
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            block_rows8(tc, q, r, x, xs, codes, sc, of, d)
            for j in range(min(8, out - r)):
                y[r + j] = d[j]


@njit(cache=True)
def _q8_tile(q, scales, r, x, a0, na, d):
    """Weight rows r .. r+TILE_W-1 of the scratch x tokens a0 .. a0+na-1 (TILE_A = 4)."""
    if na == 4:
        q8_tile4(q, scales, r, r, x, a0, GROUP, 0, 1, d)
    elif na == 3:
        q8_tile3(q, scales, r, r, x, a0, GROUP, 0, 1, d)
    elif na == 2:
        q8_tile2(q, scales, r, r, x, a0, GROUP, 0, 1, d)
    else:
        q8_tile1(q, scales, r, r, x, a0, GROUP, 0, 1, d)


@njit(parallel=True, cache=True)
def matmul_rows_blocks(tc, q, x, y, nthreads):
    """y [B, out] = x [B, n] @ dequantize(q).T for a few tokens: row a equals
    matvec_blocks(x[a]) bit for bit (the same decode, the same per-pair tile operations),
    each 8-row block decoded once for all B tokens."""
    out, B, n = q.shape[0], x.shape[0], x.shape[1]
    xs = np.empty((B, x_prep_len(tc, n)), np.float32)
    for a in range(B):
        x_prep_into(tc, x[a], xs[a])
    nblk = (out + 7) // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        codes, sc, of = block_scratch(n)
        d = np.empty((TILE_A, TILE_W), np.float32)
        d8 = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            if FUSED_KIND[tc] >= 0:  # the fused tile per token, the rows in cache for the next
                for a in range(B):
                    block_rows8(tc, q, r, x[a], xs[a], codes, sc, of, d8)
                    for j in range(min(8, out - r)):
                        y[a, r + j] = d8[j]
                continue
            decode_rows8(tc, q, r, codes, sc, of)
            for w0 in range(0, 8, TILE_W):
                if r + w0 >= out:
                    break
                for a0 in range(0, B, TILE_A):
                    na = min(TILE_A, B - a0)
                    _q8_tile(codes, sc, w0, x, a0, na, d)
                    for a in range(na):
                        with_offsets_tile(d[a], of, w0, np.float32(1.0), xs[a0 + a])
                        for j in range(min(TILE_W, out - r - w0)):
                            y[a0 + a, r + w0 + j] = d[a, j]
