"""GGUF block rows read straight from their bytes: one fused IR tile of eight rows for each
block type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL, IQ4_XS, Q5_0 and Q5_1), no decoded
scratch.

The general block path (blocks.py) decodes eight rows into int8 codes and float scales, then
runs q8_0's tile over them: two passes and ~10 small calls a super-block. These tiles take
int4_g64's approach instead (codegen.py, _int4_block): a row's quant bytes are read 64 at a
time as sixteen 32-bit lanes, each lane's codes (nibbles, bit pairs, or whole 5- and 6-bit codes
assembled in its bytes) masked in place (c * 2^shift, exact) and converted, and multiplied by x
laid out and scaled by 2^-shift beforehand (prepare_x_fused), so each product is the c * x the
unprepared x gives. Per 128 weights a kind returns (t, lane scales) pairs, t a lane's products
of one sub-block; the sub-block scales are decoded once a super-block.

Q4_K, for instance: per super-block of 256 weights, d and dmin (f16), 12 bytes of 6-bit
sub-block scales and mins, then 4 chunks of 32 bytes, chunk c holding sub-block 2c in its low
nibbles and 2c + 1 in its high ones. In a 64-byte block (chunks 2h, 2h + 1) lane l's bytes lie
in chunk 2h + l // 8, so its even nibbles belong to one sub-block and its odd ones to the next:

    t_even = sum_{k even} n_k x'_k,  t_odd = sum_{k odd} n_k x'_k            (per lane)
    acc = fmuladd(t_even, d * sc[even sub-block of the lane], acc), then t_odd likewise

and the offsets (the mins, Q6_K's -32, a lookup type's bias) leave the inner loop:
acc = fmuladd(offset per 16-weight group, x's 16-wide sums, acc) once a super-block. A row is
the lane sum of acc (codegen.hsum's tree). A code whose bits lie in two places (Q3_K's and
Q5_K's high bit, Q6_K's two) is assembled in its lane first, the high bits shifted next to the
low ones. Every (weight row, x) pair gets these operations in this order whichever entry point
calls it (matvec, matvec_rows, the fused MoE kernel) and with any thread count, so the
invariants of the other kernels hold: a row's bits depend on its bytes and x only.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .codegen import f16_bits_f32, hsum
from .target import F16C, narrow_tiles

Q4K_BYTES = 144  # a super-block: d, dmin, scales[12], qs[128]
Q6K_BYTES = 210  # ql[128], qh[64], scales[16] (int8), d
Q5K_BYTES = 176  # d, dmin, scales[12], qh[32], qs[128]
Q2K_BYTES = 84   # scales[16] (4-bit scale | 4-bit min), qs[64], d, dmin
Q3K_BYTES = 110  # hmask[32], qs[64], scales[12] (6-bit), d
IQ4XS_BYTES = 136  # d, scales_h (u16), scales_l[4], qs[128]

_F32, _I8, _I16, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V8F = ir.VectorType(_F32, 8)
_V8I = ir.VectorType(_I32, 8)
_V8B = ir.VectorType(_I8, 8)
_V16B = ir.VectorType(_I8, 16)


def _c(ty, vals):
    return ir.Constant(ty, list(vals))


def _i64(v):
    return ir.Constant(_I64, v)


def tile_prologue(builder, qa, r, rn, wrows: int):
    """What every eight-row tile (these and block_idot's) starts with: the byte pointers of rows
    r .. r + wrows - 1 of the uint8 matrix qa and of rows rn .. (the next block's, prefetched),
    a row past the matrix reading its last row (its result is discarded); one zeroed 16-lane
    float accumulator per row; llvm.fmuladd.v16f32 and llvm.prefetch."""
    nrows, _ = cgutils.unpack_tuple(builder, qa.shape, 2)
    qstride = cgutils.unpack_tuple(builder, qa.strides, 2)[0]
    qbase = builder.bitcast(qa.data, _I8.as_pointer())
    last = builder.sub(nrows, _i64(1))

    def row_ptr(row, j):
        rr = builder.add(row, _i64(j))
        rr = builder.select(builder.icmp_signed(">", rr, last), last, rr)
        return builder.gep(qbase, [builder.mul(rr, qstride)])

    rows = [row_ptr(r, j) for j in range(wrows)]
    nexts = [row_ptr(rn, j) for j in range(wrows)]
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(wrows)]
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fmuladd.v16f32")
    pf = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")
    return rows, nexts, accs, fma, pf


# How many of a tile's eight rows are walked side by side, super-block by super-block. Eight
# where the target has 32 vector registers: each 128 weights' x vectors are loaded once for all
# of them. One on 16-register targets (narrow_tiles: AVX2 and older): there eight rows'
# accumulators and x vectors do not fit, LLVM spilled them every super-block, and the eight
# rows of a row-major matrix are eight streams from DRAM where one row after another is a
# single one; rows one at a time read up to 2x faster there, x coming from L1 for each row
# (docs/benchmarks.md, Kernels: block tiles on AVX2). A row's operations are the same either
# way, so its bits are.
ROWS_SIDE_BY_SIDE = 1 if narrow_tiles() else 8


def row_runs(rows, nexts, k: int = ROWS_SIDE_BY_SIDE):
    """The tile's rows (tile_prologue) in runs of k, each run a list of (row index, pointer of
    the row whose same bytes it prefetches): side by side, row j prefetches row j of the next
    block; one at a time, the row after it (the last row: the next block's first)."""
    w = len(rows)
    if k >= w:
        return [list(enumerate(nexts))]
    ahead = rows[1:] + nexts[:1]
    return [[(j, ahead[j]) for j in range(g, min(g + k, w))] for g in range(0, w, k)]


# --- x laid out for the tile ---------------------------------------------------------------


def _q4k_source(m: int) -> int:
    """Q4_K: the weight (of a 64-byte block's 128) that prepared position m = 16 k + l
    multiplies: nibble k of lane l, i.e. byte 4 (l % 8) + k // 2 of chunk l // 8, low nibble for
    even k. Nibbles 0..6 are masked in place (n * 16^k); nibble 7 is shifted down (n)."""
    k, lane = m >> 4, m & 15
    return 64 * (lane >> 3) + 32 * (k & 1) + 4 * (lane & 7) + (k >> 1)


def _q3k_source(m: int) -> int:
    """Q3_K: the weight (of a half's 128) that position m = 16 k + l multiplies: nibble k of lane
    l (_q3k_half), the low bits of weight 32 s + 4 (l % 8) + k // 2 in bit pair s =
    2 (k % 2) + l // 8 of its byte; nibbles masked in place as Q4_K's."""
    k, lane = m >> 4, m & 15
    return 64 * (k & 1) + 32 * (lane >> 3) + 4 * (lane & 7) + (k >> 1)


def _q6k_source(m: int) -> int:
    """Q6_K: position m = 64 part + 16 k + l multiplies byte k of lane l's codes, weight
    64 part + 4 l + k (of a half's 128), masked in place (c * 256^k)."""
    part, k, lane = m >> 6, (m >> 4) & 3, m & 15
    return 64 * part + 4 * lane + k


def _q5k_source(m: int) -> int:
    """Q5_K: position m = 64 part + 16 k + l multiplies byte k of lane l's codes: weight
    64 (l // 8) + 32 part + 4 (l % 8) + k of a half's 128 (low nibbles part 0, high part 1)."""
    part, k, lane = m >> 6, (m >> 4) & 3, m & 15
    return 64 * (lane >> 3) + 32 * part + 4 * (lane & 7) + k


def _q2k_source(m: int) -> int:
    """Q2_K: position m = 16 p + L multiplies field p of lane L (_q2k_half): weight
    32 (p % 4) + 4 (L % 8) + 2 (L // 8) + p // 4 of a half's 128."""
    p, lane = m >> 4, m & 15
    return 32 * (p & 3) + 4 * (lane & 7) + 2 * (lane >> 3) + (p >> 2)


def _q2k_shift(p: int) -> int:
    """The bit where Q2_K's field p sits in its 16-bit lane."""
    return 8 * (p >> 2) + 2 * (p & 3)


def _lut32_source(m: int) -> int:
    """MXFP4, IQ4_NL, Q5_0, Q5_1 (four 32-weight blocks a super-block), IQ4_XS (four of its
    32-weight sub-blocks a half): position m = 64 part + 16 k + L multiplies byte k of lane L's
    codes, weight 32 (L // 4) + 16 part + 4 (L % 4) + k (low nibbles part 0: a block's first 16
    weights)."""
    part, k, lane = m >> 6, (m >> 4) & 3, m & 15
    return 32 * (lane >> 2) + 16 * part + 4 * (lane & 3) + k


_BLOCKS32 = ("mxfp4", "iq4_nl", "q5_0", "q5_1")  # four 32-weight blocks a super-block; a row may end inside one
_NIBBLE_SCALES = [2.0 ** (-4 * k) for k in range(7)] + [1.0]  # nibble 7 shifted down, not masked
_CODE_SCALES = [2.0 ** (-8 * (k & 3)) for k in range(8)]  # whole codes in the bytes of a lane
_BYTE_SCALES = ([2.0 ** (-8 * k) for k in range(3)] + [1.0]) * 2  # byte 3 shifted down, not masked
# kind -> (the weight each position of a prepared 128 multiplies, x's scale per 16 positions,
# weights a super-block (and per prepared-x padding unit): the 32-weight types take four blocks)
_LAYOUTS = {"q4_k": (_q4k_source, _NIBBLE_SCALES, 256),
            "q6_k": (_q6k_source, _CODE_SCALES, 256),
            "q5_k": (_q5k_source, _CODE_SCALES, 256),
            "q2_k": (_q2k_source, [2.0 ** -_q2k_shift(p) for p in range(8)], 256),
            **{k: (_lut32_source, _BYTE_SCALES, 128) for k in _BLOCKS32},
            "q3_k": (_q3k_source, _NIBBLE_SCALES, 256),
            "iq4_xs": (_lut32_source, _BYTE_SCALES, 256)}
FUSED = tuple(_LAYOUTS)  # the fused tiles, in the tables' order
_ORDER = np.array([[source(m) for m in range(128)] for source, _, _ in _LAYOUTS.values()], np.int64)
_SCALE = np.array([scales for _, scales, _ in _LAYOUTS.values()], np.float32)
SUPER = np.array([weights for _, _, weights in _LAYOUTS.values()], np.int64)


@njit(cache=True)
def sums16(x, xs):
    """xs[g] = the sum of x[16g : 16g+16]: eight interleaved partial sums, then a fixed tree."""
    for g in range(xs.shape[0]):
        x0 = 16 * g
        a0 = x[x0] + x[x0 + 8]
        a1 = x[x0 + 1] + x[x0 + 9]
        a2 = x[x0 + 2] + x[x0 + 10]
        a3 = x[x0 + 3] + x[x0 + 11]
        a4 = x[x0 + 4] + x[x0 + 12]
        a5 = x[x0 + 5] + x[x0 + 13]
        a6 = x[x0 + 6] + x[x0 + 14]
        a7 = x[x0 + 7] + x[x0 + 15]
        xs[g] = ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


@njit(cache=True)
def prepared_len(kind, n):
    """The length of prepare_x_fused's xp for an x of n: n rounded up to whole super-blocks
    (the 32-weight types' rows need not fill their last four blocks)."""
    return (n + SUPER[kind] - 1) // SUPER[kind] * SUPER[kind]


@njit(cache=True)
def prepare_x_fused(kind, x, xp, xs):
    """For FUSED[kind]'s tile: xp [prepared_len] x in the tile's order and scales (powers of
    two: exact), zeros past x's end; xs [prepared_len / 16 + 16] x's 16-wide sums, in
    sums16's order (the offset term), zeros past x's end (a 128-weight super-block's
    16-lane load of them reaches 8 groups further)."""
    n = x.shape[0]
    order, scale = _ORDER[kind], _SCALE[kind]
    for b in range(0, xp.shape[0], 128):
        for m in range(128):
            src = b + order[m]
            xp[b + m] = x[src] * scale[m >> 4] if src < n else np.float32(0.0)
    xs[:] = 0.0
    sums16(x, xs[:n // 16])


# --- the tile ------------------------------------------------------------------------------

_MASKS = [_c(_V16I, [15 << (4 * k)] * 16) for k in range(7)]


def _splat(builder, value, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), _c(ir.VectorType(_I32, vty.count), [0] * vty.count))


def _k4_fields(builder, s12):
    """The 8 sub-block scales (lanes 0-7) and mins (lanes 8-15) of the 12 bytes s (a <16 x i8>
    whose first 12 are them; ggml's get_scale_min_k4), as <16 x i32>: sc j<4 = s[j] & 63,
    j>=4 = (s[j+4] & 15) | (s[j-4] >> 6) << 4; m j<4 = s[j+4] & 63, j>=4 = (s[j+4] >> 4) |
    (s[j] >> 6) << 4. Two byte shuffles and one widening each, then 16-lane integer work."""
    def pick(idx):
        return builder.zext(builder.shuffle_vector(s12, s12, _c(_V16I, idx)), _V16I)
    lo = pick([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])   # sc: s[j] | s[j+4]; m: s[j+4]
    hi = pick([0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7])       # j >= 4: sc s[j-4], m s[j]
    keep_lo = _c(_V16I, ([63] * 4 + [15] * 4) * 2)
    keep_hi = _c(_V16I, ([0] * 4 + [0x30] * 4) * 2)
    lo = builder.and_(builder.lshr(lo, _c(_V16I, [0] * 12 + [4] * 4)), keep_lo)
    return builder.or_(lo, builder.and_(builder.lshr(hi, _c(_V16I, [2] * 16)), keep_hi))


def halves_f32(builder, ptr, n: int, load, f16c: bool = F16C):
    """<n x float> of the n IEEE halves at ptr: F16C's vcvtph2ps where the target has it (every
    AVX2 CPU), else integer IR (codegen.f16_bits_f32); both exact, so the same bits
    (tests/kernels/test_block_tiles.py)."""
    return halves_value_f32(builder, load(ptr, ir.VectorType(_I16, n), 1), f16c)


def halves_value_f32(builder, h, f16c: bool = F16C):
    """halves_f32 of a vector value h (<n x i16>, the halves' bits)."""
    n = h.type.count
    if f16c:
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), n)), ir.VectorType(_F32, n))
    return f16_bits_f32(builder, builder.zext(h, ir.VectorType(_I32, n)))


def _nibble_products(builder, lanes, xs, fma):
    """(t_even, t_odd): per lane, the products of its even (odd) nibbles (codes of up to 4 bits)
    with x prepared for nibbles (_NIBBLE_SCALES), nibbles 0-6 masked in place, 7 shifted down."""
    ns = [builder.sitofp(builder.and_(lanes, mk), _V16F) for mk in _MASKS]
    ns.append(builder.sitofp(builder.lshr(lanes, _c(_V16I, [28] * 16)), _V16F))
    t_even = builder.fmul(ns[0], xs[0])
    t_odd = builder.fmul(ns[1], xs[1])
    for k in range(2, 8, 2):
        t_even = builder.call(fma, [ns[k], xs[k], t_even])
        t_odd = builder.call(fma, [ns[k + 1], xs[k + 1], t_odd])
    return t_even, t_odd


def q4k_superblock(builder, blk, load, nvalid=None):
    """Q4_K (and Q5_K): (<16 x float> whose lanes 0-7 are d * sc of the 8 sub-blocks,
    -(dmin * m) over the 16 groups of 16) of the block at blk: d, dmin, then the 6-bit fields."""
    dd = builder.fmul(halves_f32(builder, blk, 2, load), _c(ir.VectorType(_F32, 2), [1.0, -1.0]))  # -dmin: exact
    dd = builder.shuffle_vector(dd, dd, _c(_V16I, [0] * 8 + [1] * 8))  # so (-dmin) m is -(dmin m)
    v = builder.fmul(dd, builder.sitofp(_k4_fields(builder, load(builder.gep(blk, [_i64(4)]), _V16B, 1)), _V16F))
    return v, builder.shuffle_vector(v, v, _c(_V16I, [8 + i // 2 for i in range(16)]))


def _q4k_half(builder, blk, h, sv, xs, load, fma, nvalid=None):
    """Q4_K's 64-byte block h of a super-block . x: nibble k of lane l is weight
    64 (l // 8) + 32 (k % 2) + 4 (l % 8) + k // 2, so lanes 0-7 take sub-blocks 4h (even k) and
    4h + 1 (odd k), lanes 8-15 sub-blocks 4h + 2 and 4h + 3 (sv: its lanes 0-7 the
    sub-block scales)."""
    t_even, t_odd = _nibble_products(builder, load(builder.gep(blk, [_i64(16 + 64 * h)]), _V16I, 1), xs, fma)
    s_even = builder.shuffle_vector(sv, sv, _c(_V16I, [4 * h] * 8 + [4 * h + 2] * 8))
    s_odd = builder.shuffle_vector(sv, sv, _c(_V16I, [4 * h + 1] * 8 + [4 * h + 3] * 8))
    return (t_even, s_even), (t_odd, s_odd)


def q6k_superblock(builder, blk, load, nvalid=None):
    """Q6_K: (<16 x float> d * sc of the 16 groups, -32 d sc: the codes' offset) of the block
    at blk (ql[128] qh[64] scales[16] d)."""
    dh = halves_f32(builder, builder.gep(blk, [_i64(208)]), 1, load)
    d = builder.shuffle_vector(dh, dh, _c(_V16I, [0] * 16))
    sc = builder.fmul(d, builder.sitofp(load(builder.gep(blk, [_i64(192)]), _V16B, 1), _V16F))
    return sc, builder.fmul(sc, _c(_V16F, [-32.0] * 16))


_LOW4 = _c(_V16I, [0x0F0F0F0F] * 16)
_BITS45 = _c(_V16I, [0x30303030] * 16)
_BIT4 = _c(_V16I, [0x10101010] * 16)
_CODE_MASKS = [_c(_V16I, [63 << (8 * k)] * 16) for k in range(4)]


def _with_shifted(builder, v8, bits: int):
    """Eight 32-bit lanes of bytes -> sixteen: lanes 8-15 the same shifted down `bits` bits (a
    32-bit shift carries bits across bytes, but only into bits the callers mask off), so a
    uniform mask or shift then reaches bit s in lanes 0-7 and s + bits in lanes 8-15."""
    return builder.shuffle_vector(v8, builder.lshr(v8, _c(_V8I, [bits] * 8)), _c(_V16I, range(16)))


def _bits_to(builder, v, s: int, t: int):
    """v's bits s.. moved to bit t (a left or right shift by |t - s|)."""
    if s < t:
        return builder.shl(v, _c(_V16I, [t - s] * 16))
    return builder.lshr(v, _c(_V16I, [s - t] * 16)) if s > t else v


def _q6k_half(builder, blk, h, sv, xs, load, fma, nvalid=None):
    """Q6_K's weights 128h .. 128h+127 . x: lane l's four bytes of ql[64h:] hold the low 4 bits
    of weights 4l .. 4l+3 (low nibbles) and 64 + 4l .. (high ones); their 2 high bits sit in
    qh[32h + (w % 32)] at bit 2 (w // 32). Whole 6-bit codes are assembled in the bytes of each
    lane, then masked in place (c * 256^k, exact) against x scaled by 256^-k. Lane l's four
    weights lie in group 8h + l // 4 (low) and 8h + 4 + l // 4 (high)."""
    ql = load(builder.gep(blk, [_i64(64 * h)]), _V16I, 1)
    qh = _with_shifted(builder, load(builder.gep(blk, [_i64(128 + 32 * h)]), _V8I, 1), 2)
    four = _c(_V16I, [4] * 16)

    def codes(nib, s):
        return builder.or_(builder.and_(nib, _LOW4), builder.and_(_bits_to(builder, qh, s, 4), _BITS45))
    out = []
    for part, c in enumerate((codes(ql, 0), codes(builder.lshr(ql, four), 4))):
        ns = [builder.sitofp(builder.and_(c, mk), _V16F) for mk in _CODE_MASKS]
        t = builder.fmul(ns[0], xs[4 * part])
        for k in range(1, 4):
            t = builder.call(fma, [ns[k], xs[4 * part + k], t])
        s = builder.shuffle_vector(sv, sv, _c(_V16I, [8 * h + 4 * part + l // 4 for l in range(16)]))
        out.append((t, s))
    return out


def _q5k_half(builder, blk, h, sv, xs, load, fma, nvalid=None):
    """Q5_K's weights 128h .. 128h+127 . x: qs[64h:] as Q4_K's (lane l's bytes in chunk
    2h + l // 8, low nibbles sub-block 2 (2h + l // 8), high ones the next), the fifth bit of
    weight 64c + p in bit 2c of qh[p] (low) or 2c + 1 (high). Codes assembled per byte as in
    _q6k_half."""
    ql = load(builder.gep(blk, [_i64(48 + 64 * h)]), _V16I, 1)
    qh = _with_shifted(builder, load(builder.gep(blk, [_i64(16)]), _V8I, 1), 2)
    four = _c(_V16I, [4] * 16)

    def codes(nib, bit):
        return builder.or_(builder.and_(nib, _LOW4), builder.and_(_bits_to(builder, qh, 4 * h + bit, 4), _BIT4))
    out = []
    for part, c in enumerate((codes(ql, 0), codes(builder.lshr(ql, four), 1))):
        ns = [builder.sitofp(builder.and_(c, mk), _V16F) for mk in _CODE_MASKS]
        t = builder.fmul(ns[0], xs[4 * part])
        for k in range(1, 4):
            t = builder.call(fma, [ns[k], xs[4 * part + k], t])
        s = builder.shuffle_vector(sv, sv, _c(_V16I, [4 * h + part] * 8 + [4 * h + 2 + part] * 8))
        out.append((t, s))
    return out


def q2k_superblock(builder, blk, load, nvalid=None):
    """Q2_K (scales[16] qs[64] d dmin): (d * (scale & 15), -(dmin * (scale >> 4))) of its 16
    groups of 16."""
    dd = builder.fmul(halves_f32(builder, builder.gep(blk, [_i64(80)]), 2, load), _c(ir.VectorType(_F32, 2), [1.0, -1.0]))
    b = builder.zext(load(blk, _V16B, 1), _V16I)
    sc = builder.sitofp(builder.and_(b, _c(_V16I, [15] * 16)), _V16F)
    mn = builder.sitofp(builder.lshr(b, _c(_V16I, [4] * 16)), _V16F)
    d = builder.shuffle_vector(dd, dd, _c(_V16I, [0] * 16))
    dmin = builder.shuffle_vector(dd, dd, _c(_V16I, [1] * 16))
    return builder.fmul(d, sc), builder.fmul(dmin, mn)


_Q2K_MASKS = [_c(_V16I, [3 << _q2k_shift(p)] * 16) for p in range(8)]


def _q2k_half(builder, blk, h, sv, xs, load, fma, nvalid=None):
    """Q2_K's weights 128h .. 128h+127 . x: byte l of qs[32h:] holds weights l, 32 + l, 64 + l,
    96 + l in its bit pairs 0, 2, 4, 6. The 32 bytes as eight 32-bit lanes, and the same shifted
    down 16 bits as eight more: each of the 16 lanes holds 8 fields in its low 16 bits (masked
    in place: v * 2^shift, exact). Field p of lane L is weight 32 (p % 4) + 4 (L % 8) +
    2 (L // 8) + p // 4, in group 8h + 2 (p % 4) + (L % 8) // 4: one t per p % 4."""
    v = _with_shifted(builder, load(builder.gep(blk, [_i64(16 + 32 * h)]), _V8I, 1), 16)
    ns = [builder.sitofp(builder.and_(v, mk), _V16F) for mk in _Q2K_MASKS]
    out = []
    for f in range(4):
        t = builder.call(fma, [ns[f + 4], xs[f + 4], builder.fmul(ns[f], xs[f])])
        s = builder.shuffle_vector(sv, sv, _c(_V16I, [8 * h + 2 * f + (lane & 7) // 4 for lane in range(16)]))
        out.append((t, s))
    return out


def _signed6(builder, raw, low, high):
    """Q3_K's and IQ4_XS's 6-bit sub-block scales less 32, one a lane, as float: lane j's low 4
    bits are byte low[j][0] of raw shifted down low[j][1], its high 2 bits high[j]'s."""
    n = len(low)
    vi = ir.VectorType(_I32, n)

    def field(at, mask):
        v = builder.zext(builder.shuffle_vector(raw, raw, _c(vi, [a for a, _ in at])), vi)
        return builder.and_(builder.lshr(v, _c(vi, [sh for _, sh in at])), _c(vi, [mask] * n))
    sc = builder.or_(field(low, 15), builder.shl(field(high, 3), _c(vi, [4] * n)))
    return builder.sitofp(builder.sub(sc, _c(vi, [32] * n)), ir.VectorType(_F32, n))


def q3k_superblock(builder, blk, load, nvalid=None):
    """Q3_K (hmask[32] qs[64] scales[12] d): (<16 x float> d * (sc - 32) of its 16 groups of 16,
    -4 d (sc - 32)): a weight is d (sc - 32) (low bits + 4 high bit - 4), the tile's code the
    3-bit low bits + 4 high bit, so the -4 is an offset."""
    raw = load(builder.gep(blk, [_i64(94)]), _V16B, 1)  # ends at the block's end: scales at 2..13
    sc = _signed6(builder, raw, [(2 + (j & 7), 4 * (j >> 3)) for j in range(16)],
                  [(10 + (j & 3), 2 * (j >> 2)) for j in range(16)])
    dh = halves_f32(builder, builder.gep(blk, [_i64(108)]), 1, load)
    dl = builder.fmul(builder.shuffle_vector(dh, dh, _c(_V16I, [0] * 16)), sc)
    return dl, builder.fmul(dl, _c(_V16F, [-4.0] * 16))


_PAIRS02 = _c(_V16I, [0x33333333] * 16)
_BIT2 = _c(_V16I, [0x04040404] * 16)
_BIT6 = _c(_V16I, [0x40404040] * 16)


def _q3k_half(builder, blk, h, sv, xs, load, fma, nvalid=None):
    """Q3_K's weights 128h .. 128h+127 . x: byte i of qs[32h:] holds the low bits of weights
    32s + i in its bit pairs s = 0..3, their high bits bit 4h + s of hmask[i]. Lanes 0-7 are the
    32 bytes with bit pairs 0 and 2 kept in place, lanes 8-15 the same shifted down 2 bits (pairs
    1 and 3), each pair's high bit moved to bit 2 of its nibble: eight 3-bit codes a lane in
    nibbles, taken as Q4_K's. Nibble k of lane l is weight 32 s + 4 (l % 8) + k // 2, s =
    2 (k % 2) + l // 8, in group 8h + 2s + (l % 8) // 4."""
    low = builder.and_(_with_shifted(builder, load(builder.gep(blk, [_i64(32 + 32 * h)]), _V8I, 1), 2), _PAIRS02)
    hm = _with_shifted(builder, load(blk, _V8I, 1), 1)  # bit 4h + s: pair s's high bit (8-15: s + 1's)
    high = builder.or_(builder.and_(_bits_to(builder, hm, 4 * h, 2), _BIT2),
                       builder.and_(_bits_to(builder, hm, 4 * h + 2, 6), _BIT6))
    t_even, t_odd = _nibble_products(builder, builder.or_(low, high), xs, fma)
    group = [2 * (lane >> 3) + (lane & 7) // 4 for lane in range(16)]
    s_even = builder.shuffle_vector(sv, sv, _c(_V16I, [8 * h + g for g in group]))
    s_odd = builder.shuffle_vector(sv, sv, _c(_V16I, [8 * h + 4 + g for g in group]))
    return (t_even, s_even), (t_odd, s_odd)


# --- the 32-weight types: MXFP4, IQ4_NL, Q5_0, Q5_1; IQ4_XS ---------------------------------
# Four blocks make a super-block of 128 weights (a row's last may be partial: its missing blocks
# read the last real one, their scales 0 and their x zeros). A block's 16 bytes hold weights
# 0..15 in their low nibbles and 16..31 in their high ones: for MXFP4 and IQ4_NL an index into a
# table of 16 small integers, looked up with a byte shuffle (pshufb) into value + bias, a byte
# 0..255; for Q5_0 / Q5_1 the low 4 bits of a 5-bit code whose fifth is bit w of the block's
# 32-bit qh. Either way the bytes of a 32-bit lane are masked in place (v * 256^k, exact; byte 3
# shifted down) as Q6_K's codes are, and w = d * byte + offset, offset -bias * d (Q5_1: its m),
# through x's sums. IQ4_XS's super-block of 256 is eight such blocks' nibbles (IQ4_NL's table)
# after one header of d and the eight 6-bit sub-block scales: two halves of four blocks.

_IQ4_VALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
# type -> (bytes from a block's qs to the next's, offset of the first qs, bias, table (None:
# Q5's qh bits, the 4 bytes before qs))
LUTS = {"mxfp4": (17, 1, 12, [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]),  # e2m1, doubled
        "iq4_nl": (18, 2, 128, _IQ4_VALUES),
        "q5_0": (22, 6, 16, None),
        "q5_1": (24, 8, 0, None),
        "iq4_xs": (16, 8, 128, _IQ4_VALUES)}
PSHUFB_KINDS = tuple(k for k, (_, _, _, table) in LUTS.items() if table is not None)  # x86 only
_BYTE_MASKS = [_c(_V16I, [255 << (8 * k)] * 16) for k in range(3)]
_V4F = ir.VectorType(_F32, 4)
_V4I = ir.VectorType(_I32, 4)


def _block_at(builder, blk, c: int, nvalid, bb: int):
    """Block c of a super-block at blk, or its last real block where c >= nvalid (None: a whole
    IQ4_XS super-block)."""
    if nvalid is None:
        return builder.gep(blk, [_i64(c * bb)])
    cc = builder.select(builder.icmp_signed("<", _i64(c), nvalid), _i64(c), builder.sub(nvalid, _i64(1)))
    return builder.gep(blk, [builder.mul(cc, _i64(bb))])


def valid_blocks(builder, nblk, sb):
    """How many of super-block sb's four 32-weight blocks lie inside a row of nblk blocks (1..4)."""
    left = builder.sub(nblk, builder.shl(sb, _i64(2)))
    return builder.select(builder.icmp_signed("<", left, _i64(4)), left, _i64(4))


def lut32_superblock(kind: str):
    bb, _, bias, _ = LUTS[kind]

    def superblock(builder, blk, load, nvalid):
        """(<4 x float> the scales of the four blocks, -bias * scale over the 8 groups of 16,
        then 8 zero lanes): 0 for the blocks past the row's end."""
        if kind == "mxfp4":
            return _mxfp4_scales(builder, blk, load, nvalid)
        if kind != "q5_1":
            return _half_scales(builder, blk, load, nvalid, bb, bias)
        ds = ms = ir.Constant(_V4F, ir.Undefined)
        for c in range(4):
            at = _block_at(builder, blk, c, nvalid, bb)
            if kind == "q5_1":  # d and m
                dm = halves_f32(builder, at, 2, load)
                d = builder.extract_element(dm, ir.Constant(_I32, 0))
                m = builder.select(builder.icmp_signed("<", _i64(c), nvalid), builder.extract_element(dm, ir.Constant(_I32, 1)),
                                   ir.Constant(_F32, 0.0))
                ms = builder.insert_element(ms, m, ir.Constant(_I32, c))
            else:
                d = builder.extract_element(halves_f32(builder, at, 1, load), ir.Constant(_I32, 0))
            d = builder.select(builder.icmp_signed("<", _i64(c), nvalid), d, ir.Constant(_F32, 0.0))
            ds = builder.insert_element(ds, d, ir.Constant(_I32, c))
        neg = ms if kind == "q5_1" else builder.fmul(ds, _c(_V4F, [-float(bias)] * 4))
        offs = builder.shuffle_vector(neg, ir.Constant(_V4F, [0.0] * 4), _c(_V16I, [g // 2 for g in range(8)] + [4] * 8))
        return ds, offs
    return superblock


def _mxfp4_scales(builder, blk, load, nvalid):
    """MXFP4's lut32_superblock: the four E8M0 bytes gathered into one vector and decoded
    together (ggml_e8m0_to_fp32_half: 2^(e - 128), as bits; 2^-127 and 2^-128 subnormal), 0 for
    the blocks past the row's end. One vector decode instead of four scalar ones: the tile
    decodes these per 128 weights and row, where the K-quants decode theirs per 256."""
    bb, bias = LUTS["mxfp4"][0], LUTS["mxfp4"][2]
    e = ir.Constant(ir.VectorType(_I8, 4), ir.Undefined)
    for c in range(4):
        e = builder.insert_element(e, load(_block_at(builder, blk, c, nvalid, bb), _I8, 1), ir.Constant(_I32, c))
    e = builder.zext(e, _V4I)
    tiny = builder.shl(_c(_V4I, [0x00200000] * 4), e)
    normal = builder.shl(builder.sub(e, _c(_V4I, [1] * 4)), _c(_V4I, [23] * 4))
    d = builder.select(builder.icmp_unsigned("<", e, _c(_V4I, [2] * 4)), tiny, normal)
    return _scales_and_offsets(builder, builder.bitcast(d, _V4F), nvalid, bias)


def _half_scales(builder, blk, load, nvalid, bb: int, bias: int):
    """IQ4_NL's and Q5_0's lut32_superblock: the four blocks' half d gathered into one vector and
    converted at once (one vcvtph2ps, not four), 0 past the row's end; -bias * d over the 8
    groups of 16, then 8 zero lanes."""
    h = ir.Constant(ir.VectorType(_I16, 4), ir.Undefined)
    for c in range(4):
        h = builder.insert_element(h, load(_block_at(builder, blk, c, nvalid, bb), _I16, 1), ir.Constant(_I32, c))
    return _scales_and_offsets(builder, halves_value_f32(builder, h), nvalid, bias)


def _scales_and_offsets(builder, d, nvalid, bias: int):
    """lut32_superblock's result from the four blocks' scales d (<4 x float>): d, 0 for the
    blocks at or past nvalid; -bias * d over the 8 groups of 16, then 8 zero lanes."""
    inside = builder.icmp_signed("<", _c(ir.VectorType(_I64, 4), range(4)),
                                 builder.shuffle_vector(builder.insert_element(
                                     ir.Constant(ir.VectorType(_I64, 1), ir.Undefined), nvalid, ir.Constant(_I32, 0)),
                                     ir.Constant(ir.VectorType(_I64, 1), ir.Undefined), _c(_V4I, [0] * 4)))
    ds = builder.select(inside, d, ir.Constant(_V4F, [0.0] * 4))
    neg = builder.fmul(ds, _c(_V4F, [-float(bias)] * 4))
    offs = builder.shuffle_vector(neg, ir.Constant(_V4F, [0.0] * 4), _c(_V16I, [g // 2 for g in range(8)] + [4] * 8))
    return ds, offs


def iq4xs_superblock(builder, blk, load, nvalid=None):
    """IQ4_XS (d, scales_h (u16), scales_l[4], qs[128]): (<8 x float> d * (sc - 32) of its 8
    blocks, -128 d (sc - 32) over its 16 groups of 16: the table's bias). Block j's scale: low
    4 bits nibble j % 2 of scales_l[j // 2], high 2 bits bits 2j of scales_h."""
    raw = load(blk, _V8B, 1)
    sc = _signed6(builder, raw, [(4 + j // 2, 4 * (j & 1)) for j in range(8)],
                  [(2 + j // 4, 2 * (j & 3)) for j in range(8)])
    dh = halves_f32(builder, blk, 1, load)
    ds = builder.fmul(builder.shuffle_vector(dh, dh, _c(_V8I, [0] * 8)), sc)
    neg = builder.fmul(ds, _c(_V8F, [-float(LUTS["iq4_xs"][2])] * 8))
    return ds, builder.shuffle_vector(neg, neg, _c(_V16I, [g // 2 for g in range(16)]))


def lut32_codes(kind: str, bias: int | None = None):
    """The codes of a 32-weight type (shared with block_idot's int8 tile): codes(builder, blk,
    h, load, nvalid) -> (lows, highs), blocks 4h .. 4h+3's value + bias bytes as two 64-byte
    vectors: block c's weights 0..15 in bytes 16c .. 16c+15 of lows, its 16..31 in highs. The
    four blocks' bytes are joined before anything else, so the masks, shifts, lookups and Q5's
    fifth bits each take one 64-byte operation (one zmm instruction on AVX-512), not four.
    bias: the lookup types' (default LUTS'; 0: the table's values as signed bytes)."""
    bb, qoff, lut_bias, values = LUTS[kind]
    bias = lut_bias if bias is None else bias
    v64 = ir.VectorType(_I8, 64)
    if values is not None:
        table = _c(_V16B, [((v + bias) + 128) % 256 - 128 for v in values])  # value + bias as a byte
    bit = _c(v64, [1 << (j & 7) for j in range(64)])

    def join(builder, parts):  # four 16-byte vectors -> one of 64
        ab = builder.shuffle_vector(parts[0], parts[1], _c(ir.VectorType(_I32, 32), range(32)))
        cd = builder.shuffle_vector(parts[2], parts[3], _c(ir.VectorType(_I32, 32), range(32)))
        return builder.shuffle_vector(ab, cd, _c(ir.VectorType(_I32, 64), range(64)))

    def codes(builder, blk, h, load, nvalid):
        ats = [_block_at(builder, blk, c, nvalid, bb) for c in range(4 * h, 4 * h + 4)]
        raw = join(builder, [load(builder.gep(at, [_i64(qoff)]), _V16B, 1) for at in ats])
        lo = builder.and_(raw, _c(v64, [15] * 64))
        hi = builder.lshr(raw, _c(v64, [4] * 64))
        if values is not None:
            shuf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16B, [_V16B, _V16B]),
                                                  "llvm.x86.ssse3.pshuf.b.128")
            return tuple(join(builder, [builder.call(shuf, [table, builder.shuffle_vector(
                nib, nib, _c(_V16I, range(16 * c, 16 * c + 16)))]) for c in range(4)]) for nib in (lo, hi))
        # Q5: weight w's fifth bit is bit w of its block's 32-bit qh, the 4 bytes before qs
        qh = ir.Constant(_V4I, ir.Undefined)
        for c, at in enumerate(ats):
            qh = builder.insert_element(qh, load(builder.gep(at, [_i64(qoff - 4)]), _I32, 1), ir.Constant(_I32, c))
        qh = builder.bitcast(qh, _V16B)
        out = []
        for nib, first in ((lo, 0), (hi, 2)):  # weights 0..15 take qh bytes 0-1, 16..31 bytes 2-3
            spread = builder.shuffle_vector(qh, qh, _c(ir.VectorType(_I32, 64),
                                                       [4 * (j // 16) + first + (j % 16) // 8 for j in range(64)]))
            on = builder.icmp_unsigned("!=", builder.and_(spread, bit), _c(v64, [0] * 64))
            out.append(builder.or_(nib, builder.select(on, _c(v64, [16] * 64), _c(v64, [0] * 64))))
        return tuple(out)
    return codes


def _lut32_half(kind: str):
    codes = lut32_codes(kind)

    def half(builder, blk, h, sv, xs, load, fma, nvalid):
        """Blocks 4h .. 4h+3 of the super-block (its 128 weights) . x: one t, lane L's eight
        products all in block 4h + L // 4 (sv: the blocks' scales)."""
        t = None
        for part, v in enumerate(codes(builder, blk, h, load, nvalid)):
            v = builder.bitcast(v, _V16I)  # sixteen 32-bit lanes, four codes each
            ns = [builder.sitofp(builder.and_(v, mk), _V16F) for mk in _BYTE_MASKS]
            ns.append(builder.sitofp(builder.lshr(v, _c(_V16I, [24] * 16)), _V16F))
            for k in range(4):
                x = xs[4 * part + k]
                t = builder.fmul(ns[k], x) if t is None else builder.call(fma, [ns[k], x, t])
        return [(t, builder.shuffle_vector(sv, sv, _c(_V16I, [4 * h + lane // 4 for lane in range(16)])))]
    return half


# type -> (super-block bytes, per super-block decode, per half dot); Q5_K's header is Q4_K's
_KINDS = {"q4_k": (Q4K_BYTES, q4k_superblock, _q4k_half), "q6_k": (Q6K_BYTES, q6k_superblock, _q6k_half),
          "q5_k": (Q5K_BYTES, q4k_superblock, _q5k_half), "q2_k": (Q2K_BYTES, q2k_superblock, _q2k_half),
          **{k: (4 * LUTS[k][0], lut32_superblock(k), _lut32_half(k)) for k in _BLOCKS32},
          "q3_k": (Q3K_BYTES, q3k_superblock, _q3k_half),
          "iq4_xs": (IQ4XS_BYTES, iq4xs_superblock, _lut32_half("iq4_xs"))}


def _fused_codegen(kind: str, wrows: int):
    """The tile over `wrows` weight rows of type `kind` x one prepared x: per super-block and
    row, its scales decoded and the offset term added (acc = fmuladd(offsets, x's 16-wide
    sums, acc)); then per 128-weight half the 8 prepared x vectors, loaded once for the rows
    walked side by side (row_runs), and per row two (t, lane scales) pairs: acc = fmuladd(t, s,
    acc) in that order; a row's result is hsum(acc)."""
    nbytes, superblock, half = _KINDS[kind]
    weights = int(SUPER[FUSED.index(kind)])  # a super-block's: 256, or four 32-weight blocks
    halves, bb = weights // 128, LUTS[kind][0] if kind in _BLOCKS32 else None

    def codegen(context, builder, sig, args):
        qty, _, _, xpty, xsty, dty = sig.args
        qa = context.make_array(qty)(context, builder, args[0])
        r, rn = args[1], args[2]
        xpa = context.make_array(xpty)(context, builder, args[3])
        xsa = context.make_array(xsty)(context, builder, args[4])
        da = context.make_array(dty)(context, builder, args[5])
        n = cgutils.unpack_tuple(builder, xpa.shape, 1)[0]  # whole super-blocks (prepared_len)
        nsb = builder.udiv(n, _i64(weights))
        nblk = builder.udiv(cgutils.unpack_tuple(builder, qa.shape, 2)[1], _i64(bb)) if bb else None
        xpbase = builder.bitcast(xpa.data, _F32.as_pointer())
        xsbase = builder.bitcast(xsa.data, _F32.as_pointer())
        dbase = builder.bitcast(da.data, _F32.as_pointer())
        rows, nexts, accs, fma, pf = tile_prologue(builder, qa, r, rn, wrows)

        def load(ptr, ty, align):
            return builder.load(builder.bitcast(ptr, ty.as_pointer()), align=align)

        for run in row_runs(rows, nexts):
            with cgutils.for_range(builder, nsb) as loop:
                sb = loop.index
                b = builder.mul(sb, _i64(nbytes))
                e = builder.mul(sb, _i64(weights))
                nvalid = None  # the 32-weight types: the super-block's blocks inside the row (1..4)
                if bb:
                    nvalid = valid_blocks(builder, nblk, sb)
                xs16 = load(builder.gep(xsbase, [builder.lshr(e, _i64(4))]), _V16F, 4)
                scales = {}
                for j, ahead in run:
                    sv, offs = superblock(builder, builder.gep(rows[j], [b]), load, nvalid)
                    scales[j] = sv
                    builder.store(builder.call(fma, [offs, xs16, builder.load(accs[j])]), accs[j])
                    for off in range(0, nbytes, 64):  # the same super-block of the row read next
                        at = builder.gep(ahead, [builder.add(b, _i64(off))])  # (prefetch never faults)
                        builder.call(pf, [at, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
                for h in range(halves):
                    xo = builder.add(e, _i64(128 * h))
                    xs = [load(builder.gep(xpbase, [builder.add(xo, _i64(16 * k))]), _V16F, 4) for k in range(8)]
                    for j, _ in run:
                        acc = builder.load(accs[j])
                        for t, s in half(builder, builder.gep(rows[j], [b]), h, scales[j], xs, load, fma, nvalid):
                            acc = builder.call(fma, [t, s, acc])
                        builder.store(acc, accs[j])
        for j in range(wrows):
            builder.store(hsum(builder, builder.load(accs[j])), builder.gep(dbase, [_i64(j)]))
        return context.get_dummy_value()
    return codegen


def _dot8_intrinsic(kind: str):
    """An intrinsic (q, r, rn, xp, xs, d): d[0:8] = rows r .. r+7 of the `kind` matrix q (uint8
    [rows, row bytes], C order) . x, from x's prepare_x_fused (xp, xs); rows past the end give
    garbage. Rows rn.. are prefetched."""
    def dot8(typingctx, q, r, rn, xp, xs, d):
        return types.void(q, types.intp, types.intp, xp, xs, d), _fused_codegen(kind, 8)
    dot8.__name__ = dot8.__qualname__ = f"{kind}_dot8"
    return intrinsic(dot8)


# each FUSED kind's tile (the lookup types, PSHUFB_KINDS, compile on x86 only: pshufb)
DOT8 = tuple(_dot8_intrinsic(k) for k in FUSED)
q4k_dot8, q6k_dot8, q5k_dot8, q2k_dot8, mxfp4_dot8, iq4nl_dot8, q5_0_dot8, q5_1_dot8, q3k_dot8, iq4xs_dot8 = DOT8
