"""GGUF block rows times int8 activations: the `--activations int8` form of block_tiles.py's
fused tiles, for Q2_K to Q6_K, MXFP4, Q5_0, IQ4_NL and IQ4_XS (llama.cpp's Q8_K / Q8_0 idea
with idot.py's integer dots). Q5_1, the one block type without an int8 tile, stays on the exact
path in int8 mode. The IQ4 types' table values made unsigned (+128, up to 241) would
overflow AVX2's vpmaddubsw pair sums (2 * 241 * 127 > 32767), so on AVX2 their codes stay
signed and each is paired with |xq| (idot.dot_s8s8: SIGNED_CODES); the VNNI and portable forms
sum in 32 bits and take them unsigned, the same integers either way.

Why: the exact tiles spend a conversion and a multiply-add per weight (~6-8 GB/s a core);
here a row's 64 quant bytes cost two integer dot instructions (idot.dot_u8s8: AVX-512 VNNI
`vpdpbusd`, AVX2 `vpmaddubsw` + `vpmaddwd`, or portable IR, chosen at compile time), then one
conversion and one multiply-add per 16 lanes.

x is quantized once per call (quantize_blocks_into), with idot's rounding (idot.group_scale):
one scale s_x per 32 weights (a Q4_K sub-block, two Q6_K groups, an MXFP4 block), xq =
round(x / s_x) in int8, laid out so that each 64-byte load of a row's codes pairs with one
64-byte load of xq. Then per
super-block and row, with the sub-block scales decoded as the exact tiles decode them
(block_tiles' q4k_superblock / q6k_superblock: d * sc in float32):

    Q4_K, 8 sub-blocks j of 32:   isum_j = sum(nibble * xq)   (Q5_K: its 5-bit codes) (int32 lanes)
        acc = fmuladd(float(isum lanes), (d * sc_j) * s_x[j], acc)   per 16 lanes, 2 sub-blocks
        acc = fmuladd(-(dmin * m_g), s_x * sum16(xq)_g, acc)     the mins, per group g of 16
    Q6_K, 16 groups g of 16:     isum_g = sum(code * xq) - 32 * sum(xq)   (code 0..63: the -32
        enters as each lane accumulator's start, an integer per 4 xq given with x, as idot's
        symmetric int4 does) ;  acc = fmuladd(float(isum lanes), (d * sc_g) * s_x[g], acc)
    MXFP4, 4 blocks c of 32:     isum_c = sum(code * xq) - 12 * sum(xq)   (code: the doubled E2M1
        value + 12, 0..24, by block_tiles' byte lookup; the -12 as Q6_K's -32) ;
        acc = fmuladd(float(isum lanes), d_c * s_x[c], acc), d_c = 2^(e - 128) (the E8M0 scale halved)
    Q5_0, IQ4_NL, as MXFP4:      code 0..31 less 16; IQ4_NL's table value (+ 128, less 128; on
        AVX2 signed, with no bias), d_c its block's half scale
    IQ4_XS, 8 blocks c of 32:    as IQ4_NL, d_c = d * (its 6-bit scale - 32)
    Q2_K, 16 groups g of 16:     as Q6_K with 2-bit codes and no bias, and a min per group as
        Q4_K's: acc = fmuladd(-(dmin * m_g), s_x * sum16(xq)_g, acc)
    Q3_K, 16 groups g of 16:     as Q6_K, codes (2 low bits | the hmask bit << 2) less 4

A lane's integer sum is exact in every form (at most 4 * 241 * 127 + 128 * 4 * 127 in magnitude;
AVX2's vpmaddubsw sums two products of at most 63 * 127 into int16, or 127 * 127 for the signed
IQ4 codes, below its limit), so the
result is the dot product of the dequantized weights with the int8-rounded x up to float32
rounding, in an operation order fixed by the code: the same bits from matvec, matvec_rows and
the fused MoE kernel, with any thread count and any integer form (tests/kernels/test_block_idot.py).
A row is the lane sum of acc (codegen.hsum's tree).

The layouts, per 128 weights (half a super-block) and 64-byte load h:
- Q4_K: chunk c (32 bytes) holds weights 64c + k in its low nibbles and 64c + 32 + k in its high
  ones, so a 64-byte load's low nibbles are weights 0..31 and 64..95 of the half (sub-blocks
  4h and 4h + 2: lanes 0-7, 8-15), its high ones 32..63 and 96..127 (4h + 1, 4h + 3). xq is laid
  out in that order: 64 bytes for the low nibbles, then 64 for the high ones (_q4k_order).
  Q5_K is Q4_K's layout plus the codes' fifth bits in qh: one xq layout for both.
- Q6_K: ql's 64 bytes and qh's 32 give codes of weights 0..63 (low nibbles, qh bits 0-1 and 2-3)
  and 64..127 (high nibbles, bits 4-5 and 6-7): xq in the natural order, lane l in group l // 4
  of its 64.
- Q2_K, Q3_K: as Q6_K's, the natural order (their 2-bit fields of 32 bytes spread to 128 bytes).
- MXFP4, Q5_0, IQ4_NL, per super-block of four blocks (IQ4_XS: each half of its 256): their
  16-byte qs joined, so the low nibbles are the blocks' weights 0..15 and the high ones their
  16..31 (lane l in block l // 4), xq likewise (_lut32_order). A row may end inside a
  super-block (gpt-oss's 2880 = 90 blocks): x is padded to whole super-blocks with zeros
  (padded_len), the missing blocks read the row's last real one and get scale 0, as in the
  exact tile.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from colibri.formats.ggml_blocks import BLOCK_SCHEMES
from colibri.formats.qtensor import QTensor

from .cpu.block_tiles import (
    IQ4XS_BYTES,
    LUTS,
    Q2K_BYTES,
    Q3K_BYTES,
    Q4K_BYTES,
    Q5K_BYTES,
    Q6K_BYTES,
    ROWS_SIDE_BY_SIDE,
    iq4xs_superblock,
    lut32_codes,
    lut32_superblock,
    q2k_superblock,
    q3k_superblock,
    q4k_superblock,
    q6k_superblock,
    row_runs,
    tile_prologue,
    valid_blocks,
)
from .cpu.blocks import (
    TYPE_CODE,
    block_rows8,
    matmul_rows_blocks,
    matvec_blocks,
    x_prep_into,
    x_prep_len,
    x_sums,
)
from .cpu.checks import check_tensor, checked_x
from .cpu.codegen import hsum
from .idot import ISA, dot_s8s8, dot_u8s8, group_scale, to_int8

# the block types with an int8 tile, in IDOT_KIND's order
INT8_SCHEMES = ("q4_k", "q6_k", "q5_k", "mxfp4", "q5_0", "iq4_nl", "q2_k", "q3_k", "iq4_xs")
# scheme code (blocks.TYPE_CODE) -> its int8 tile's index in INT8_SCHEMES, -1: exact in int8 mode
IDOT_KIND = np.array([INT8_SCHEMES.index(s) if s in INT8_SCHEMES else -1 for s in BLOCK_SCHEMES], np.int64)
# The IQ4 types' codes where the integer form is AVX2's: their table values as signed bytes,
# dotted by idot.dot_s8s8 (no bias); elsewhere value + 128, unsigned, as the other types'.
SIGNED_CODES = ("iq4_nl", "iq4_xs") if ISA == "avx2" else ()
_IQ4_BIAS = 0 if SIGNED_CODES else LUTS["iq4_nl"][2]


def _q4k_order(m: int) -> int:
    """Q4_K: the weight (of a half's 128) that xq position m pairs with: low nibble of byte m of
    the 64-byte load for m < 64, else the high nibble of byte m - 64."""
    i, high = m & 63, m >> 6
    return 64 * (i >> 5) + 32 * high + (i & 31)


def _lut32_order(m: int) -> int:
    """The 32-weight types (MXFP4, Q5_0, IQ4_NL; IQ4_XS's blocks): the weight (of four blocks'
    128) that xq position m pairs with: block m // 16's weight m % 16 (a low nibble) for m < 64,
    else block (m - 64) // 16's weight 16 + m % 16."""
    i, high = m & 63, m >> 6
    return 32 * (i >> 4) + 16 * high + (i & 15)


_Q4K_ORDER = [_q4k_order(m) for m in range(128)]
_LUT32_ORDER = [_lut32_order(m) for m in range(128)]
_NATURAL = list(range(128))
# type -> (the weight each xq position of 128 pairs with; the bias subtracted from every code,
# through the lane starts, that makes the codes unsigned bytes; the weights of a super-block,
# x's padding unit: the 32-weight types' rows end at any block, and their tile reads four)
_X_LAYOUT = {"q4_k": (_Q4K_ORDER, 0, 256), "q6_k": (_NATURAL, 32, 256), "q5_k": (_Q4K_ORDER, 0, 256),
             "mxfp4": (_LUT32_ORDER, LUTS["mxfp4"][2], 128), "q5_0": (_LUT32_ORDER, LUTS["q5_0"][2], 128),
             "iq4_nl": (_LUT32_ORDER, _IQ4_BIAS, 128), "q2_k": (_NATURAL, 0, 256), "q3_k": (_NATURAL, 4, 256),
             "iq4_xs": (_LUT32_ORDER, _IQ4_BIAS, 256)}
# the same, indexed by INT8_SCHEMES: each weight's position in xq within its 128, the bias, the
# super-block
_AT = np.array([[_X_LAYOUT[k][0].index(w) for w in range(128)] for k in INT8_SCHEMES], np.int64)
_BIAS = np.array([_X_LAYOUT[k][1] for k in INT8_SCHEMES], np.int32)
_SUPER = np.array([_X_LAYOUT[k][2] for k in INT8_SCHEMES], np.int64)


# --- x, quantized once per call --------------------------------------------------------------


@njit(cache=True)
def padded_len(kind, n):
    """The length of x's quantized form for INT8_SCHEMES[kind]: n (a multiple of 32) in whole
    super-blocks (_SUPER)."""
    return (n + _SUPER[kind] - 1) // _SUPER[kind] * _SUPER[kind]


@njit(cache=True)
def quantize_blocks_into(kind, x, xq, ni, sx, xo):
    """x float32 [n] -> for INT8_SCHEMES[kind]'s tile, p = padded_len(kind, n): xq int8 [p] in
    the tile's order (_ORDER); ni int32 [p / 4], -bias * the sum of each 4 xq (the lane
    accumulators' starts); sx float32 [p / 32], each 32 weights' scale; xo float32 [p / 16],
    s_x * the sum of each 16 xq in natural order (the mins term). Past x's end all are 0, so a
    row's missing blocks add nothing."""
    n = x.shape[0]
    at = _AT[kind]
    xq[n // 128 * 128:] = 0
    sx[n // 32:] = 0.0
    xo[n // 16:] = 0.0
    for b in range(n // 32):
        s, inv, finite = group_scale(x, 32 * b, 32)
        sx[b] = s
        base = 128 * (b >> 2)
        for h in range(2):  # (summed as written: reading the bytes back stalls on their stores)
            t = np.int32(0)
            for k in range(16 * h, 16 * h + 16):
                v = to_int8(x[32 * b + k], inv, finite)
                xq[base + at[32 * (b & 3) + k]] = v
                t += np.int32(v)
            xo[2 * b + h] = s * np.float32(t)
    bias = _BIAS[kind]
    for lane in range(xq.shape[0] // 4):
        t = np.int32(0)
        for k in range(4):
            t += np.int32(xq[4 * lane + k])
        ni[lane] = -bias * t


@njit(cache=True)
def quantize_blocks(kind, x):
    """x [n] -> (xq, ni, sx, xo) for INT8_SCHEMES[kind]; empty arrays where kind is -1 (a type
    the exact path takes)."""
    n = padded_len(kind, x.shape[0]) if kind >= 0 else 0
    xa = (np.empty(n, np.int8), np.empty(n // 4, np.int32), np.empty(n // 32, np.float32),
          np.empty(n // 16, np.float32))
    if kind >= 0:
        quantize_blocks_into(kind, x, *xa)
    return xa


@njit(cache=True)
def quantize_blocks_rows(kind, x):
    """Rows x [K, n] -> quantize_blocks of each, as arrays with a leading K axis."""
    K = x.shape[0]
    n = padded_len(kind, x.shape[1]) if kind >= 0 else 0
    xa = (np.empty((K, n), np.int8), np.empty((K, n // 4), np.int32), np.empty((K, n // 32), np.float32),
          np.empty((K, n // 16), np.float32))
    if kind >= 0:
        for k in range(K):
            quantize_blocks_into(kind, x[k], xa[0][k], xa[1][k], xa[2][k], xa[3][k])
    return xa


# --- the tile ----------------------------------------------------------------------------

_F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V64B, _V32B = ir.VectorType(_I8, 64), ir.VectorType(_I8, 32)


def _c(ty, vals):
    return ir.Constant(ty, list(vals))


def _i64(v):
    return ir.Constant(_I64, v)


def _q4k_codes(builder, blk, h, load, nvalid=None):
    """Q4_K's 64-byte load h of a super-block's nibbles: (low nibbles, high nibbles), bytes."""
    raw = load(builder.gep(blk, [_i64(16 + 64 * h)]), _V64B)
    return builder.and_(raw, _c(_V64B, [15] * 64)), builder.lshr(raw, _c(_V64B, [4] * 64))


def _q6k_codes(builder, blk, h, load, nvalid=None):
    """Q6_K's weights 128h .. 128h + 127 as 6-bit codes (0..63), bytes: weights 0..63 of the
    half, then 64..127. ql[64h + l] holds weights l (low nibble) and 64 + l (high) for l < 32,
    32 + l' and 96 + l' for l = 32 + l'; their high bits: qh[32h + l % 32] bits 0-1 (weights
    0..31), 2-3 (32..63), 4-5 (64..95), 6-7 (96..127)."""
    ql = load(builder.gep(blk, [_i64(64 * h)]), _V64B)
    qh = load(builder.gep(blk, [_i64(128 + 32 * h)]), _V32B)
    qh64 = builder.shuffle_vector(qh, builder.lshr(qh, _c(_V32B, [2] * 32)), _c(ir.VectorType(_I32, 64), range(64)))
    bits = _c(_V64B, [0x30] * 64)
    lo = builder.or_(builder.and_(ql, _c(_V64B, [15] * 64)), builder.and_(builder.shl(qh64, _c(_V64B, [4] * 64)), bits))
    hi = builder.or_(builder.lshr(ql, _c(_V64B, [4] * 64)), builder.and_(qh64, bits))
    return lo, hi


def _q5k_codes(builder, blk, h, load, nvalid=None):
    """Q5_K's 64-byte load h: Q4_K's nibbles (qs at 48) with their fifth bits, weight 64c + k's
    in bit 2c of qh[k] (low nibble) and 64c + 32 + k's in bit 2c + 1 (high), c = 2h + i // 32
    for byte i of the load: so bits 4h, 4h + 1 of qh serve bytes 0..31, bits 4h + 2, 4h + 3
    bytes 32..63."""
    raw = load(builder.gep(blk, [_i64(48 + 64 * h)]), _V64B)
    qh = load(builder.gep(blk, [_i64(16)]), _V32B)
    qh64 = builder.shuffle_vector(builder.lshr(qh, _c(_V32B, [4 * h] * 32)), builder.lshr(qh, _c(_V32B, [4 * h + 2] * 32)),
                                  _c(ir.VectorType(_I32, 64), range(64)))
    lo = builder.or_(builder.and_(raw, _c(_V64B, [15] * 64)),
                     builder.shl(builder.and_(qh64, _c(_V64B, [1] * 64)), _c(_V64B, [4] * 64)))
    hi = builder.or_(builder.lshr(raw, _c(_V64B, [4] * 64)),
                     builder.shl(builder.and_(qh64, _c(_V64B, [2] * 64)), _c(_V64B, [3] * 64)))
    return lo, hi


def _q2k_codes(builder, blk, h, load, nvalid=None):
    """Q2_K's weights 128h .. 128h + 127 as 2-bit codes, bytes in the natural order: byte l of
    qs[32h:] (at 16) holds weights l, 32 + l, 64 + l, 96 + l in its bit pairs 0, 2, 4, 6."""
    q = load(builder.gep(blk, [_i64(16 + 32 * h)]), _V32B)
    q64 = builder.shuffle_vector(q, builder.lshr(q, _c(_V32B, [2] * 32)), _c(ir.VectorType(_I32, 64), range(64)))
    three = _c(_V64B, [3] * 64)
    return builder.and_(q64, three), builder.and_(builder.lshr(q64, _c(_V64B, [4] * 64)), three)


def _q3k_codes(builder, blk, h, load, nvalid=None):
    """Q3_K's weights 128h .. 128h + 127 as 3-bit codes (less 4: the lane starts), as Q2_K's: the
    low two bits in qs[32h:] (at 32), the third of weight 32j + l (j < 4) in bit 4h + j of
    hmask[l] (at 0)."""
    q = load(builder.gep(blk, [_i64(32 + 32 * h)]), _V32B)
    q64 = builder.shuffle_vector(q, builder.lshr(q, _c(_V32B, [2] * 32)), _c(ir.VectorType(_I32, 64), range(64)))
    hm = load(blk, _V32B)

    def high(j):  # bit 4h + j, 4h + j + 1 of hmask for weights 32j + l, 32(j + 1) + l, at bit 2
        both = builder.shuffle_vector(builder.lshr(hm, _c(_V32B, [4 * h + j] * 32)),
                                      builder.lshr(hm, _c(_V32B, [4 * h + j + 1] * 32)),
                                      _c(ir.VectorType(_I32, 64), range(64)))
        return builder.shl(builder.and_(both, _c(_V64B, [1] * 64)), _c(_V64B, [2] * 64))
    three = _c(_V64B, [3] * 64)
    return (builder.or_(builder.and_(q64, three), high(0)),
            builder.or_(builder.and_(builder.lshr(q64, _c(_V64B, [4] * 64)), three), high(2)))


def _q4k_lanes(h):
    """Q4_K / Q5_K: lanes 0-7 of load h's low nibbles in sub-block 4h, 8-15 in 4h + 2; the
    high nibbles' in 4h + 1, 4h + 3."""
    return [4 * h + 2 * (lane >> 3) for lane in range(16)], [4 * h + 1 + 2 * (lane >> 3) for lane in range(16)]


def _q6k_lanes(h):
    """Q6_K (and Q2_K, Q3_K): lane l of load h's first 64 codes in group 8h + l // 4, of the next
    64 8h + 4 + l // 4."""
    return [8 * h + (lane >> 2) for lane in range(16)], [8 * h + 4 + (lane >> 2) for lane in range(16)]


def _lut32_lanes(h):
    """The 32-weight types: lane l of both of load h's 64-byte halves in block 4h + l // 4."""
    return [4 * h + (lane >> 2) for lane in range(16)], [4 * h + (lane >> 2) for lane in range(16)]


# kind -> (super-block bytes (its weights: _X_LAYOUT), scales decode, codes of a 64-byte load
# (nvalid: the super-block's blocks inside the row, for the 32-weight types; None for the
# K-quants), lane ->
# scale index of the (low, high) codes of load h, weights a scale: a sub-block or block of 32
# (Q4_K, Q5_K, MXFP4) or group of 16 (Q6_K), mins (Q4_K, Q5_K), block bytes (the 32-weight
# types, whose rows may end inside a super-block))
_KINDS = {
    "q4_k": (Q4K_BYTES, q4k_superblock, _q4k_codes, _q4k_lanes, 32, True, None),
    "q6_k": (Q6K_BYTES, q6k_superblock, _q6k_codes, _q6k_lanes, 16, False, None),
    "q5_k": (Q5K_BYTES, q4k_superblock, _q5k_codes, _q4k_lanes, 32, True, None),  # Q4_K's header and sub-blocks
    "q2_k": (Q2K_BYTES, q2k_superblock, _q2k_codes, _q6k_lanes, 16, True, None),  # a min per group of 16
    "q3_k": (Q3K_BYTES, q3k_superblock, _q3k_codes, _q6k_lanes, 16, False, None),  # codes less 4
    # The 32-weight types, four blocks a super-block as in the exact tile, their codes
    # block_tiles.lut32_codes': MXFP4's doubled E2M1 values + 12 (0..24), Q5_0's 5-bit codes, the
    # IQ4 types' table values (+ _IQ4_BIAS); the blocks' weights 0..15, then their 16..31
    # (_lut32_order); the blocks past a row's end read its last real one (nvalid)
    **{k: (4 * LUTS[k][0], lut32_superblock(k), lut32_codes(k, _X_LAYOUT[k][1]), _lut32_lanes, 32, False,
           LUTS[k][0]) for k in ("mxfp4", "q5_0", "iq4_nl")},
    "iq4_xs": (IQ4XS_BYTES, iq4xs_superblock, lut32_codes("iq4_xs", _IQ4_BIAS), _lut32_lanes, 32, False, None),
}


def _idot_codegen(kind: str, wrows: int, ncols: int | None = None):
    """The tile over `wrows` weight rows of type `kind` x one quantized x (q, r, rn, xq, ni, sx,
    xo, d): per super-block, x's scales loaded once and each row's scales decoded, multiplied by
    them ((d * sc) * s_x per sub-block, group or block) and (Q4_K, Q5_K) the mins term added; then
    per 64-byte load of codes, x's two 64-byte pieces (and the Q6_K / MXFP4 lane starts) loaded
    once for the rows walked side by side (block_tiles.row_runs), and per row two integer dots,
    each converted and added with one fmuladd; d[j] = hsum(acc).

    ncols (a prompt's tile): the x arrays are quantize_blocks_rows' [L, ...], an argument l0
    follows them, and the result goes to y [L, rows]: y[l0 + c, r + j] for c < ncols. The rows
    go one at a time, each row's codes unpacked once for the ncols x rows; every (row, x row)
    pair runs the one-x tile's operations in its order, so the same bits."""
    nbytes, superblock, codes_of, lane_scales, per_scale, mins, bb = _KINDS[kind]
    _, bias, weights = _X_LAYOUT[kind]
    biased = bias != 0
    dot = dot_s8s8 if kind in SIGNED_CODES else dot_u8s8
    nscales = weights // per_scale
    sxv = ir.VectorType(_F32, weights // 32)

    tile = ncols is not None
    nc = ncols or 1

    def codegen(context, builder, sig, args):
        qa = context.make_array(sig.args[0])(context, builder, args[0])
        r, rn = args[1], args[2]
        xqa, nia, sxa, xoa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args[3:7], args[3:7]))
        l0 = args[7] if tile else None
        oa = context.make_array(sig.args[-1])(context, builder, args[-1])
        n = cgutils.unpack_tuple(builder, xqa.shape, 2 if tile else 1)[-1]
        nsb = builder.udiv(n, _i64(weights))
        nblk = builder.udiv(cgutils.unpack_tuple(builder, qa.shape, 2)[1], _i64(bb)) if bb else None

        def xrow(a, ty, c):
            """x row c's data: the array itself, or row l0 + c of a 2-D one."""
            if not tile:
                return builder.bitcast(a.data, ty.as_pointer())
            stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
            at = builder.gep(builder.bitcast(a.data, _I8.as_pointer()), [builder.mul(builder.add(l0, _i64(c)), stride)])
            return builder.bitcast(at, ty.as_pointer())
        xqbase, nibase, sxbase, xobase = ([xrow(a, ty, c) for c in range(nc)]
                                          for a, ty in ((xqa, _I8), (nia, _I32), (sxa, _F32), (xoa, _F32)))
        rows, nexts, _, fma, pf = tile_prologue(builder, qa, r, rn, wrows)
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(nc)]
                for _ in range(wrows)]
        zero = ir.Constant(_V16I, [0] * 16)

        def load(ptr, ty, align=1):
            return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)

        cols = range(nc)
        for run in row_runs(rows, nexts, 1 if tile else ROWS_SIDE_BY_SIDE):
            with cgutils.for_range(builder, nsb) as loop:
                sb = loop.index
                b = builder.mul(sb, _i64(nbytes))
                e = builder.mul(sb, _i64(weights))
                nvalid = valid_blocks(builder, nblk, sb) if bb else None
                sx_of = []  # per x row: s_x of each scale's weights
                for c in cols:
                    sx = load(builder.gep(sxbase[c], [builder.lshr(e, _i64(5))]), sxv, 4)
                    sx_of.append(builder.shuffle_vector(sx, sx, _c(ir.VectorType(_I32, nscales),
                                                                  [g * per_scale // 32 for g in range(nscales)])))
                if mins:
                    xo16 = [load(builder.gep(xobase[c], [builder.lshr(e, _i64(4))]), _V16F, 4) for c in cols]
                scales = {}
                for j, ahead in run:  # (d * sc) * s_x per sub-block, group or block
                    sv, offs = superblock(builder, builder.gep(rows[j], [b]), load, nvalid)
                    dsc = builder.shuffle_vector(sv, sv, _c(ir.VectorType(_I32, nscales), range(nscales)))
                    for c in cols:
                        scales[j, c] = builder.fmul(dsc, sx_of[c])
                        if mins:  # through x's 16-sums
                            builder.store(builder.call(fma, [offs, xo16[c], builder.load(accs[j][c])]), accs[j][c])
                    for off in range(0, nbytes, 64):  # the same super-block of the row read next
                        at = builder.gep(ahead, [builder.add(b, _i64(off))])  # (prefetch never faults)
                        builder.call(pf, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
                for h in range(weights // 128):
                    xo_ = builder.add(e, _i64(128 * h))
                    xs = [[load(builder.gep(xqbase[c], [builder.add(xo_, _i64(64 * p))]), _V64B) for p in range(2)]
                          for c in cols]
                    if biased:
                        starts = [[load(builder.gep(nibase[c], [builder.lshr(builder.add(xo_, _i64(64 * p)), _i64(2))]),
                                        _V16I, 4) for p in range(2)] for c in cols]
                    else:
                        starts = [[zero, zero] for c in cols]
                    idx = lane_scales(h)
                    for j, _ in run:
                        codes = codes_of(builder, builder.gep(rows[j], [b]), h, load, nvalid)
                        for c in cols:
                            acc = builder.load(accs[j][c])
                            for p, code in enumerate(codes):
                                isum = dot(builder, starts[c][p], ((code, xs[c][p]),), 16)
                                s = builder.shuffle_vector(scales[j, c], scales[j, c], _c(_V16I, idx[p]))
                                acc = builder.call(fma, [builder.sitofp(isum, _V16F), s, acc])
                            builder.store(acc, accs[j][c])
        for j in range(wrows):
            for c in cols:
                total = hsum(builder, builder.load(accs[j][c]))
                if tile:  # y[l0 + c, r + j]
                    builder.store(total, builder.gep(xrow(oa, _F32, c), [builder.add(r, _i64(j))]))
                else:
                    builder.store(total, builder.gep(builder.bitcast(oa.data, _F32.as_pointer()), [_i64(j)]))
        return context.get_dummy_value()
    return codegen


def _by_type(ncols: int | None = None):
    """The codegen of one call for every type of INT8_SCHEMES: its first argument, the scheme
    code (blocks.TYPE_CODE), picks the type's tile (_idot_codegen(kind, 8, ncols)) in an LLVM
    switch, the others' arguments passed on. A code of no int8 type writes nothing."""
    tiles = {TYPE_CODE[k]: _idot_codegen(k, 8, ncols) for k in INT8_SCHEMES}

    def codegen(context, builder, sig, args):
        inner = types.void(*sig.args[1:])
        done = builder.append_basic_block("done")
        switch = builder.switch(args[0], done)
        for code, tile in tiles.items():
            block = builder.append_basic_block(f"type{code}")
            switch.add_case(ir.Constant(args[0].type, code), block)
            builder.position_at_end(block)
            tile(context, builder, inner, args[1:])
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()
    return codegen


@intrinsic
def idot8(typingctx, tc, q, r, rn, xq, ni, sx, xo, d):
    """(tc, q, r, rn, xq, ni, sx, xo, d): d[0:8] = rows r .. r+7 of the type-tc matrix q (uint8
    [rows, row bytes], C order) . x, from x's quantize_blocks; rows past the end give garbage.
    Rows rn.. are prefetched."""
    return types.void(types.intp, q, types.intp, types.intp, xq, ni, sx, xo, d), _by_type()


TILE_COLS = 4  # x rows of a prompt's tile: each row's codes unpacked once for four


@intrinsic
def idot8_tile(typingctx, tc, q, r, rn, xq, ni, sx, xo, l0, y):
    """(tc, q, r, rn, xq, ni, sx, xo, l0, y): y[l0 + c, r + j] = row r + j of the type-tc
    matrix q . x row l0 + c, for j < 8 and c < TILE_COLS, x from quantize_blocks_rows; rows
    r .. r + 7 must exist. Rows rn.. are prefetched."""
    return (types.void(types.intp, q, types.intp, types.intp, xq, ni, sx, xo, types.intp, y),
            _by_type(TILE_COLS))


# --- rows --------------------------------------------------------------------------------


@njit(cache=True)
def rows8(tc, q, r, xa, d):
    """d[0:8] = rows r .. r+7 of the type-tc matrix q times the quantized x xa (quantize_blocks);
    tc one of INT8_SCHEMES. Shared by every entry point, so a row's bits depend on its bytes
    and x only."""
    xq, ni, sx, xo = xa
    idot8(tc, q, r, r + 8, xq, ni, sx, xo, d)


@njit(parallel=True, cache=True)
def matvec(tc, q, x, y, nthreads):
    """y = dequantize(q) @ x with x rounded to int8 per 32 (tc one of INT8_SCHEMES)."""
    out = q.shape[0]
    xa = quantize_blocks(IDOT_KIND[tc], x)
    nblk = (out + 7) // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            rows8(tc, q, r, xa, d)
            for j in range(min(8, out - r)):
                y[r + j] = d[j]


@njit(parallel=True, cache=True)
def matmul_rows(tc, q, x, y, nthreads):
    """y [B, out] = x [B, n] @ dequantize(q).T, row a equal to matvec(x[a]) bit for bit: each
    8-row block's bytes read once for all tokens, in tiles of TILE_COLS tokens (the codes
    unpacked once for the four), the tokens past the last whole tile one at a time."""
    out, B = q.shape[0], x.shape[0]
    xa = quantize_blocks_rows(IDOT_KIND[tc], x)
    nblk = (out + 7) // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            a0 = 0
            if r + 8 <= out:
                while a0 + TILE_COLS <= B:
                    idot8_tile(tc, q, r, r + 8, xa[0], xa[1], xa[2], xa[3], a0, y)
                    a0 += TILE_COLS
            for a in range(a0, B):
                rows8(tc, q, r, (xa[0][a], xa[1][a], xa[2][a], xa[3][a]), d)
                for j in range(min(8, out - r)):
                    y[a, r + j] = d[j]


# --- the activation mode inside the fused MoE kernel (moe.routed_block_experts) ---------------
# As idot's: `act`'s numba type (idot.marker) picks the code, so each mode compiles its own
# specialization; in int8 mode a projection whose type has no int8 tile runs the exact tile.


def _int8(act) -> bool:
    return isinstance(act, types.Integer)


def prepare(tc, x, act):
    """What rows8_into needs of x for type tc: exact, x_sums; int8, (x_sums or empty, then
    quantize_blocks' four arrays or empty ones) as the type has no int8 tile or has one: one
    flat tuple (parfor passes a nested tuple of arrays to its threads as a scalar and fails)
    (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def prepare_rows(tc, x, act):
    """prepare() of each row of x [K, n], as arrays with a leading K axis (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def row_of(xp, k, act):
    """Row k of prepare_rows' result, as prepare() gives it (compiled only)."""
    raise NotImplementedError("called from compiled code only")


def rows8_into(tc, q, r, x, xp, codes, sc, of, d, act):
    """d[0:8] = rows r .. r+7 of dequantize(q) @ x in act's mode, xp = prepare(tc, x, act);
    codes, sc, of: blocks.block_scratch (the exact decode-then-dot types) (compiled only)."""
    raise NotImplementedError("called from compiled code only")


@overload(prepare)
def _prepare(tc, x, act):
    if _int8(act):
        def int8(tc, x, act):
            k = IDOT_KIND[tc]
            xq, ni, sx, xo = quantize_blocks(k, x)
            return x_sums(tc, x) if k < 0 else np.empty(0, np.float32), xq, ni, sx, xo
        return int8
    return lambda tc, x, act: x_sums(tc, x)


@njit(cache=True)
def _sums_rows(tc, x):
    """x_prep_into of each row of x [K, n] (the exact path's per-row x)."""
    xs = np.empty((x.shape[0], x_prep_len(tc, x.shape[1])), np.float32)
    for k in range(x.shape[0]):
        x_prep_into(tc, x[k], xs[k])
    return xs


@overload(prepare_rows)
def _prepare_rows(tc, x, act):
    if _int8(act):
        def int8(tc, x, act):
            k = IDOT_KIND[tc]
            xs = _sums_rows(tc, x) if k < 0 else np.empty((x.shape[0], 0), np.float32)
            xq, ni, sx, xo = quantize_blocks_rows(k, x)
            return xs, xq, ni, sx, xo
        return int8
    return lambda tc, x, act: _sums_rows(tc, x)


@overload(row_of)
def _row_of(xp, k, act):
    if _int8(act):
        return lambda xp, k, act: (xp[0][k], xp[1][k], xp[2][k], xp[3][k], xp[4][k])
    return lambda xp, k, act: xp[k]


@overload(rows8_into)
def _rows8_into(tc, q, r, x, xp, codes, sc, of, d, act):
    if _int8(act):
        def int8(tc, q, r, x, xp, codes, sc, of, d, act):
            if IDOT_KIND[tc] >= 0:
                rows8(tc, q, r, (xp[1], xp[2], xp[3], xp[4]), d)
            else:
                block_rows8(tc, q, r, x, xp[0], codes, sc, of, d)
        return int8
    return lambda tc, q, r, x, xp, codes, sc, of, d, act: block_rows8(tc, q, r, x, xp, codes, sc, of, d)


# --- QTensor entry points (the model's linear() calls these in int8 mode) --------------------


def matvec_q(t: QTensor, x: np.ndarray) -> np.ndarray:
    """dequantize(t) @ x with x rounded to int8 per 32 for t in INT8_SCHEMES; the other block
    types exactly (their int8 mode is the exact path)."""
    check_tensor(t)
    x = checked_x(x, 1, t.shape[1], "matvec")
    y = np.empty(t.shape[0], np.float32)
    if y.size:
        tc = TYPE_CODE[t.scheme]
        (matvec if IDOT_KIND[tc] >= 0 else matvec_blocks)(tc, t.q, x, y, get_num_threads())
    return y


def matmul_q(t: QTensor, x: np.ndarray) -> np.ndarray:
    """x @ dequantize(t).T, row l equal to matvec_q(t, x[l]) bit for bit (prefill and several
    decoded rows: the weights read once per 8-row block for all rows)."""
    check_tensor(t)
    x = checked_x(x, 2, t.shape[1], "matmul")
    y = np.empty((x.shape[0], t.shape[0]), np.float32)
    if y.size:
        tc = TYPE_CODE[t.scheme]
        (matmul_rows if IDOT_KIND[tc] >= 0 else matmul_rows_blocks)(tc, t.q, x, y, get_num_threads())
    return y
