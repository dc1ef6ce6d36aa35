"""GGUF's block-quantized types held as the file stores them: the K-quants (Q2_K..Q6_K), the
4-bit non-linear IQ types (IQ4_NL, IQ4_XS), Q5_0 / Q5_1 and MXFP4.

A matrix of one of these "block schemes" is a QTensor whose q is uint8 [out, blocks * block
bytes]: each row is a run of GGUF blocks, byte for byte what the file holds (no scales or mins
arrays, rows never interleaved). Import is a byte copy, an expert read from a GGUF lands in RAM
as its kernels read it, and nothing is ever requantized.

Each block covers `elements` consecutive inputs of one row (256 for the K-quants and IQ4_XS, 32
for the others); a row's input count must be a multiple of it. The byte layouts are ggml's
(ggml-common.h: block_q4_K and friends); the numpy dequantizers below (dequantize_blocks) are
the reference every kernel is tested against, and they equal gguf-py's `gguf.quants.dequantize`
bit for bit (tests/formats/test_ggml_blocks.py).

quantize_blocks ports ggml-quants.c's reference quantizers (quantize_row_q4_K_ref and friends,
no importance matrix), for test fixtures and for requantizing on request: llama.cpp's quality
and, but for near-ties that float summation order decides, its bytes (Q5_0, Q5_1, MXFP4:
always, and gguf-py's too). numpy only: this module must not import gguf.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockType:
    gguf_name: str   # the GGUF / ggml type name ("Q4_K")
    elements: int    # inputs per block
    nbytes: int      # bytes per block


# scheme -> block type. Sizes from ggml-common.h (QK_K = 256).
BLOCK_TYPES: dict[str, BlockType] = {
    "q2_k": BlockType("Q2_K", 256, 84),     # scales[16] qs[64] d dmin
    "q3_k": BlockType("Q3_K", 256, 110),    # hmask[32] qs[64] scales[12] d
    "q4_k": BlockType("Q4_K", 256, 144),    # d dmin scales[12] qs[128]
    "q5_k": BlockType("Q5_K", 256, 176),    # d dmin scales[12] qh[32] qs[128]
    "q6_k": BlockType("Q6_K", 256, 210),    # ql[128] qh[64] scales[16] d
    "iq4_nl": BlockType("IQ4_NL", 32, 18),  # d qs[16]
    "iq4_xs": BlockType("IQ4_XS", 256, 136),  # d scales_h scales_l[4] qs[128]
    "q5_0": BlockType("Q5_0", 32, 22),      # d qh[4] qs[16]
    "q5_1": BlockType("Q5_1", 32, 24),      # d m qh[4] qs[16]
    "mxfp4": BlockType("MXFP4", 32, 17),    # e (E8M0) qs[16]
}
BLOCK_SCHEMES = tuple(BLOCK_TYPES)
SCHEME_OF_GGUF = {bt.gguf_name: scheme for scheme, bt in BLOCK_TYPES.items()}


def row_bytes(scheme: str, inputs: int) -> int:
    """Bytes of one row of `inputs` weights in a block scheme."""
    bt = BLOCK_TYPES[scheme]
    if inputs % bt.elements:
        raise ValueError(f"{bt.gguf_name} rows need a multiple of {bt.elements} inputs, not {inputs}")
    return inputs // bt.elements * bt.nbytes


def _block_type(scheme: str) -> BlockType:
    try:
        return BLOCK_TYPES[scheme]
    except KeyError:
        raise ValueError(f"{scheme!r} is not a block scheme; known: {', '.join(BLOCK_SCHEMES)}") from None


# --- tables and field helpers -------------------------------------------------------------

# IQ4_NL / IQ4_XS: the 16 non-linear 4-bit levels (ggml-common.h kvalues_iq4nl).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
# MXFP4: the E2M1 values doubled (ggml-common.h kvalues_mxfp4), hence the half in e8m0_to_f32_half.
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)  # ggml-quants.c: a sub-block whose |max| is below this is all zero


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian f16 at byte `offset` of every block [N, nbytes] -> float32 [N, 1]
    (exactly: every f16 is a float32)."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)


def f16_bytes(a: np.ndarray) -> np.ndarray:
    """float32 [N] -> the bytes of its nearest f16 (round to nearest even, as GGML_FP32_TO_FP16)
    [N, 2]."""
    return np.ascontiguousarray(a, dtype=np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def e8m0_to_f32_half(e: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 exponent byte -> 2^(e - 127) / 2, as ggml_e8m0_to_fp32_half: the half
    because the nibble values are E2M1 doubled. e = 0 and 1 give the subnormals 2^-128, 2^-127."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def get_scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [N, 12] -> the 8 sub-blocks' 6-bit scales and mins, each
    uint8 [N, 8] (ggml-quants.c get_scale_min_k4). Sub-blocks 0-3 sit in the low 6 bits of
    bytes 0-3 (scales) and 4-7 (mins); 4-7 have their low 4 bits in bytes 8-11 and their top
    2 bits in the spare top bits of bytes 0-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """get_scale_min_k4 inverted: 6-bit scales and mins uint8 [N, 8] -> the 12 bytes [N, 12]."""
    sc = sc.astype(np.uint8)
    mn = mn.astype(np.uint8)
    lo_d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    lo_m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([lo_d, lo_m, md], axis=1)


def _q3k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes [N, 12] -> its 16 6-bit scales uint8 [N, 16] (not yet minus 32):
    low nibbles in bytes 0-7 (sub-blocks 0-7 low halves, 8-15 high halves), the top 2 bits of
    sub-block j at bits 2*(j//4) of byte 8 + j%4."""
    lo = np.concatenate([scales[:, :8] & 0x0F, scales[:, :8] >> 4], axis=1)
    hi = (scales[:, None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 0x03
    return lo | (hi.reshape(-1, 16) << 4)


def _pack_q3k_scales(l: np.ndarray) -> np.ndarray:
    """_q3k_scales inverted: 6-bit values uint8 [N, 16] -> the 12 bytes [N, 12]."""
    l = l.astype(np.uint8)
    lo = (l[:, :8] & 0x0F) | ((l[:, 8:] & 0x0F) << 4)
    hi = (l >> 4).reshape(-1, 4, 4) << np.array([0, 2, 4, 6], np.uint8)[None, :, None]
    return np.concatenate([lo, np.bitwise_or.reduce(hi, axis=1)], axis=1)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """uint8 [N, k * run] -> [N, k, 2, run]: in each run of `run` bytes, byte j holds element j
    in its low nibble and element run + j in its high one (ggml's order everywhere)."""
    q = qs.reshape(qs.shape[0], -1, 1, run)
    return (q >> np.array([0, 4], np.uint8)[None, None, :, None]) & np.uint8(0x0F)


def _pack_nibbles(v: np.ndarray, run: int) -> np.ndarray:
    """_nibbles inverted: values 0..15 [N, k * 2 * run] -> bytes [N, k * run]."""
    v = v.astype(np.uint8).reshape(v.shape[0], -1, 2, run)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(v.shape[0], -1)


def _bits(b: np.ndarray, nbits: int) -> np.ndarray:
    """uint8 [N, k] -> [N, nbits, k]: bit i of every byte, plane by plane (ggml's qh / hmask
    order: bit i of byte j belongs to element i * k + j)."""
    return (b[:, None, :] >> np.arange(nbits, dtype=np.uint8)[None, :, None]) & np.uint8(1)


# --- dequantization -----------------------------------------------------------------------
# Each takes blocks uint8 [N, nbytes] and returns float32 [N, elements]. The arithmetic is
# ggml's dequantize_row_* (and gguf-py's), operation for operation, so the float32 results
# agree bit for bit: sub-block scale first (d * sc, in float32), then * q, then - dmin * m.


def _deq_q2_k(b):
    sc = b[:, :16]
    qs = b[:, 16:80]
    d, dmin = f16_field(b, 80), f16_field(b, 82)
    dl = (d * (sc & 0x0F).astype(np.float32))[:, :, None]        # [N, 16, 1]
    ml = (dmin * (sc >> 4).astype(np.float32))[:, :, None]
    # 2 halves of 128 elements, each 4 shifts of 32 bytes: element 128h + 32s + l is bits 2s of qs[32h + l]
    q = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & np.uint8(3)
    return (dl * q.reshape(-1, 16, 16).astype(np.float32) - ml).reshape(-1, QK_K)


def _deq_q3_k(b):
    hmask, qs, d = b[:, :32], b[:, 32:96], f16_field(b, 108)
    sc = (_q3k_scales(b[:, 96:108]).astype(np.int8) - np.int8(32)).astype(np.float32)
    dl = (d * sc)[:, :, None]
    low = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & np.uint8(3)
    # the high bit of element e is bit e // 32 of hmask[e % 32]; a clear bit means "minus 4"
    high = _bits(hmask, 8) ^ np.uint8(1)
    q = low.reshape(-1, QK_K).astype(np.int8) - (high.reshape(-1, QK_K) << 2).astype(np.int8)
    return (dl * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


def _deq_q4_k(b):
    d, dmin = f16_field(b, 0), f16_field(b, 2)
    sc, mn = get_scale_min_k4(b[:, 4:16])
    dl = (d * sc.astype(np.float32))[:, :, None]                  # [N, 8, 1]
    ml = (dmin * mn.astype(np.float32))[:, :, None]
    q = _nibbles(b[:, 16:144], 32).reshape(-1, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(-1, QK_K)


def _deq_q5_k(b):
    d, dmin = f16_field(b, 0), f16_field(b, 2)
    sc, mn = get_scale_min_k4(b[:, 4:16])
    dl = (d * sc.astype(np.float32))[:, :, None]
    ml = (dmin * mn.astype(np.float32))[:, :, None]
    low = _nibbles(b[:, 48:176], 32).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 8)                                 # element 32i + j: bit i of qh[j]
    q = (low | (high << 4)).astype(np.float32)
    return (dl * q - ml).reshape(-1, QK_K)


def _deq_q6_k(b):
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    dl = (f16_field(b, 208) * sc)[:, :, None]                    # [N, 16, 1]
    # per half of 128: element 64k + j is nibble k of ql[64h + j]; its top 2 bits are bits
    # 2s of qh[32h + l] for element 32s + l
    low = _nibbles(ql, 64).reshape(-1, 2, 128)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & np.uint8(3)
    q = (low | (high.reshape(-1, 2, 128) << 4)).astype(np.int8) - np.int8(32)
    return (dl * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, QK_K)


def _deq_iq4_nl(b):
    q = KVALUES_IQ4NL[_nibbles(b[:, 2:18], 16).reshape(-1, 32)]
    return f16_field(b, 0) * q.astype(np.float32)


def _deq_iq4_xs(b):
    d = f16_field(b, 0)
    scales_h = b[:, 2:4].copy().view(np.uint16)                   # [N, 1]
    lo = _nibbles(b[:, 4:8], 1).reshape(-1, 8)                    # sub-block 2i + k: nibble k of scales_l[i]
    hi = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 0x03
    ls = (lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    dl = (d * ls.astype(np.float32))[:, :, None]                  # [N, 8, 1]
    q = KVALUES_IQ4NL[_nibbles(b[:, 8:136], 16).reshape(-1, 8, 32)]
    return (dl * q.astype(np.float32)).reshape(-1, QK_K)


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's qh [N, 4] (a little-endian uint32) -> the 32 fifth bits [N, 32]."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _deq_q5_0(b):
    q = _nibbles(b[:, 6:22], 16).reshape(-1, 32) | (_q5_high(b[:, 2:6]) << 4)
    return f16_field(b, 0) * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _deq_q5_1(b):
    q = _nibbles(b[:, 8:24], 16).reshape(-1, 32) | (_q5_high(b[:, 4:8]) << 4)
    return f16_field(b, 0) * q.astype(np.float32) + f16_field(b, 2)


def _deq_mxfp4(b):
    q = KVALUES_MXFP4[_nibbles(b[:, 1:17], 16).reshape(-1, 32)]
    return e8m0_to_f32_half(b[:, :1]) * q.astype(np.float32)


_DEQUANT = {
    "q2_k": _deq_q2_k, "q3_k": _deq_q3_k, "q4_k": _deq_q4_k, "q5_k": _deq_q5_k, "q6_k": _deq_q6_k,
    "iq4_nl": _deq_iq4_nl, "iq4_xs": _deq_iq4_xs, "q5_0": _deq_q5_0, "q5_1": _deq_q5_1, "mxfp4": _deq_mxfp4,
}

# Blocks handled per numpy pass: ~1 MiB of float32 out, so the temporaries stay in cache.
_CHUNK_ELEMENTS = 1 << 18


def dequantize_blocks(q: np.ndarray, scheme: str, inputs: int) -> np.ndarray:
    """A block-scheme matrix's q, uint8 [out, row_bytes(scheme, inputs)] -> float32 [out, inputs].
    Equal bit for bit to gguf-py's gguf.quants.dequantize (tests/formats/test_ggml_blocks.py)."""
    bt = _block_type(scheme)
    rb = row_bytes(scheme, inputs)
    q = np.asarray(q)
    if q.dtype != np.uint8 or q.ndim != 2 or q.shape[1] != rb:
        raise ValueError(f"{bt.gguf_name} rows of {inputs} inputs need q as uint8 [out, {rb}], "
                         f"got {q.dtype.name} {q.shape}")
    blocks = np.ascontiguousarray(q).reshape(-1, bt.nbytes)
    out = np.empty((blocks.shape[0], bt.elements), np.float32)
    step = max(1, _CHUNK_ELEMENTS // bt.elements)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = _DEQUANT[scheme](blocks[i:i + step])
    return out.reshape(q.shape[0], inputs)


# --- quantization -------------------------------------------------------------------------
# numpy ports of ggml-quants.c's reference quantizers, vectorized over sub-blocks: each takes
# blocks float32 [N, elements] and returns their bytes uint8 [N, nbytes]. Q5_0, Q5_1 and MXFP4
# give gguf-py's gguf.quants.quantize bytes exactly. The K and IQ4 ports follow the reference
# searches step for step (quirks included) but sum in a different order and keep some
# per-sub-block scalars in float64, so a near-tie may go the other way: llama.cpp's quality,
# and its bytes for 97-100% of blocks (Gaussian weights, against libggml's quantize_row_*_ref;
# Q2_K, Q3_K and IQ4_XS all of them). The levels ggml's searches leave in sub-blocks whose
# quantized scale came out zero (they dequantize the same whatever they hold) are 0 here,
# but in Q3_K.


def _signed_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of x [B, n]: the largest |x| and the signed value that has it (the first one,
    as ggml's `if (ax > amax)` loops find)."""
    i = np.abs(x).argmax(axis=1)
    mx = np.take_along_axis(x, i[:, None], axis=1)[:, 0]
    return np.abs(mx), mx


def _rint_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """ggml's MAX(lo, MIN(hi, nearest_int(v))), in place on the float32 v: nearest_int is the
    float-add magic-number trick, which rounds halves to even, like np.rint."""
    np.rint(v, out=v)
    return np.clip(v, lo, hi, out=v)


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b)


def _divide_or_zero(a, b):
    """a / b where b != 0, else 0 (ggml's `d ? x/d : 0`)."""
    b = np.asarray(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.result_type(a, b, np.float32))


def _make_qkx2_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """ggml's make_qkx2_quants for every row of x [B, n] (weights w [B, n]): the scale and the
    min (returned as -min, >= 0) of the best fit x ~ scale * l + min with l in 0..nmax, trying
    the plain max-min grid and nstep + 1 stretched ones, each refit by weighted least squares.
    As in ggml, a grid that wins moves the min the later grids start from (their range is
    max - min and their levels count from min). Returns scale [B], the_min [B] (the levels
    are recomputed from the stored scales later)."""
    mn = np.minimum(x.min(axis=1), 0)
    mx = x.max(axis=1)
    flat = mx == mn
    wx = w * x
    sum_w = w.sum(axis=1, dtype=np.float64)
    sum_x = wx.sum(axis=1, dtype=np.float64)
    sum_x2 = _rowdot(wx, x).astype(np.float64)

    def levels(iscale, mn_):
        return _rint_clip(iscale[:, None] * (x - mn_[:, None]), 0, nmax)

    def error(l, sums, scale, mn_):
        if use_mad:  # weighted sum of |error|: no shortcut, one pass over the elements
            diff = scale.astype(np.float32)[:, None] * l + mn_.astype(np.float32)[:, None] - x
            return _rowdot(w, np.abs(diff, out=diff)).astype(np.float64)
        # weighted squared error expanded into sums the least-squares fit has anyway
        s_l, s_l2, s_xl = sums
        return (scale * scale * s_l2 + 2 * scale * mn_ * s_l - 2 * scale * s_xl
                + mn_ * mn_ * sum_w - 2 * mn_ * sum_x + sum_x2)

    def sums(l):  # sum w l, sum w l^2, sum w x l
        return (_rowdot(w, l).astype(np.float64), _rowdot(w * l, l).astype(np.float64),
                _rowdot(wx, l).astype(np.float64))

    iscale = np.float32(nmax) / np.where(flat, np.float32(1), mx - mn)
    scale = (1 / iscale).astype(np.float64)
    the_min = mn.astype(np.float64)
    l = levels(iscale, mn)
    best = error(l, None if use_mad else sums(l), scale, the_min)
    for step in range(nstep + 1):
        mn = the_min.astype(np.float32)
        rng = np.where(flat, np.float32(1), mx - mn)
        iscale = (np.float32(rmin) + np.float32(rdelta) * np.float32(step) + np.float32(nmax)) / rng
        l = levels(iscale, mn)
        s_l, s_l2, s_xl = s = sums(l)
        D = sum_w * s_l2 - s_l * s_l
        ok = D > 0
        Ds = np.where(ok, D, 1)
        this_scale = (sum_w * s_xl - sum_x * s_l) / Ds
        this_min = (s_l2 * sum_x - s_l * s_xl) / Ds
        pos = this_min > 0  # a positive min is not allowed: refit the scale alone through 0
        this_scale = np.where(pos, _divide_or_zero(s_xl, s_l2), this_scale)
        this_min = np.where(pos, 0, this_min)
        cur = error(l, s, this_scale, this_min)
        better = ok & (cur < best)
        best = np.where(better, cur, best)
        scale = np.where(better, this_scale, scale)
        the_min = np.where(better, this_min, the_min)
    scale = np.where(flat, 0, scale).astype(np.float32)
    return scale, (-the_min).astype(np.float32)


def _make_qx_quants(x, nmax):
    """ggml's make_qx_quants(rmse_type = 1, no importance weights) for every row of x [B, n]:
    the signed scale of the best symmetric fit x ~ scale * l, l in -nmax..nmax-1, weighted by
    x^2, over 19 grids stretched by -0.9..+0.9 levels. Returns scale [B]."""
    amax, mx = _signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, 1, mx)
    w = x * x
    wx = w * x

    def fit(iscale):
        l = _rint_clip(iscale[:, None] * x, -nmax, nmax - 1)
        return _rowdot(wx, l).astype(np.float64), _rowdot(w * l, l).astype(np.float64)

    sumlx, suml2 = fit(np.float32(-nmax) / mx)
    scale = _divide_or_zero(sumlx, suml2)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = fit(-(np.float32(nmax) + np.float32(0.1) * np.float32(step)) / mx)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = np.where(better, _divide_or_zero(sumlx, suml2), scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, scale).astype(np.float32)


def _make_q3_quants(x, nmax=4):
    """ggml's make_q3_quants(do_rmse = true) for every row of x [B, n]: start from the levels of
    the max-based scale, then up to 5 sweeps of coordinate descent, each level in turn moved to
    its best value given the others (weights x^2), kept if the fit improves. The sweeps are
    sequential within a row, so the loop runs over the n positions, vectorized across rows.
    (A row whose sweep changed nothing would change nothing in the next: running all 5 for
    every row is ggml's early exit.) Returns scale [B] and the levels l + nmax, int8 [B, n]."""
    amax, mx = _signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, 1, mx)
    xt = np.ascontiguousarray(x.T)                         # [n, B]: one position of every row
    L = _rint_clip((np.float32(-nmax) / mx)[None, :] * xt, -nmax, nmax - 1)
    w = xt * xt
    wx = w * xt
    sumlx = (wx * L).sum(axis=0)
    suml2 = (w * L * L).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(5):
            for i in range(xt.shape[0]):
                Li, wi, wxi = L[i], w[i], wx[i]
                slx = sumlx - wxi * Li
                sl2 = suml2 - wi * Li * Li
                new = _rint_clip(xt[i] * sl2 / np.where(slx > 0, slx, 1), -nmax, nmax - 1)
                slx_n = slx + wxi * new
                sl2_n = sl2 + wi * new * new
                take = (slx > 0) & (new != Li) & (sl2_n > 0) & (slx_n * slx_n * suml2 > sumlx * sumlx * sl2_n)
                L[i] = np.where(take, new, Li)
                sumlx = np.where(take, slx_n, sumlx)
                suml2 = np.where(take, sl2_n, suml2)
    scale = np.where(zero, 0, _divide_or_zero(sumlx, suml2)).astype(np.float32)
    L = np.where(zero[None, :], -nmax, L)                  # ggml: an all-zero row's levels are 0 (stored)
    return scale, (L.T + nmax).astype(np.int8)


def _k_levels(x, d, lo, hi):
    """The level ggml gives each element once its sub-block's scale d (and, for the asymmetric
    types, its min, already folded into x) is final: clip(nearest_int(x / d), lo, hi); 0 where
    d is 0 (those elements dequantize to the same value whatever they hold)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        l = _rint_clip(x / np.where(d != 0, d, 1), lo, hi)
    return np.where(d != 0, l, 0)


def _k_scales_mins(x, nmax, rmin, nstep):
    """Q4_K / Q5_K (quantize_row_q4_K_ref / q5_K_ref): 8 sub-blocks of 32, each fit by
    make_qkx2_quants with weights rms(x) + |x|, scales and mins quantized to 6 bits against
    the block's largest. Returns the f16 d and dmin bytes, the 12 scale bytes and the levels."""
    n = x.shape[0]
    xs = x.reshape(n * 8, 32)
    av_x = np.sqrt(_rowdot(xs, xs) / np.float32(32))
    w = av_x[:, None] + np.abs(xs)
    scales, mins = _make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(n, 8), mins.reshape(n, 8)
    max_scale = np.maximum(scales.max(axis=1), 0)
    max_min = np.maximum(mins.max(axis=1), 0)
    # ggml stores nearest_int into a uint8 before MIN(63, .): only a negative scale (never seen
    # from make_qkx2_quants) would wrap there; clip it to 0 instead
    ls = _rint_clip(_divide_or_zero(np.float32(63), max_scale)[:, None] * scales, 0, 63).astype(np.uint8)
    lm = _rint_clip(_divide_or_zero(np.float32(63), max_min)[:, None] * mins, 0, 63).astype(np.uint8)
    d = f16_bytes(max_scale / np.float32(63))
    dmin = f16_bytes(max_min / np.float32(63))
    dl = (d.view(np.float16).astype(np.float32) * ls.astype(np.float32))[:, :, None]
    ml = (dmin.view(np.float16).astype(np.float32) * lm.astype(np.float32))[:, :, None]
    L = _k_levels(x.reshape(n, 8, 32) + ml, dl, 0, nmax).reshape(n, QK_K).astype(np.uint8)
    return d, dmin, pack_scale_min_k4(ls, lm), L


def _q_q4_k(x):
    d, dmin, sc, L = _k_scales_mins(x, 15, -1.0, 20)
    return np.concatenate([d, dmin, sc, _pack_nibbles(L, 32)], axis=1)


def _q_q5_k(x):
    d, dmin, sc, L = _k_scales_mins(x, 31, -0.5, 15)
    # fifth bit of element 32i + j: bit i of qh[j]
    qh = np.packbits((L >> 4).reshape(-1, 8, 32).transpose(0, 2, 1), axis=2, bitorder="little")[:, :, 0]
    return np.concatenate([d, dmin, sc, qh, _pack_nibbles(L & 0x0F, 32)], axis=1)


def _pack_2bit(L):
    """Levels 0..3 [N, 256] -> qs [N, 64]: per half of 128, byte l holds elements l, l + 32,
    l + 64, l + 96 at bits 0, 2, 4, 6 (Q2_K and the low bits of Q3_K)."""
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    return np.bitwise_or.reduce(q, axis=2).reshape(-1, 64)


def _q_q2_k(x):
    # quantize_row_q2_K_ref: 16 sub-blocks of 16, make_qkx2_quants with weights |x| and the
    # weighted absolute error, then 4-bit scales and mins against the block's largest
    n = x.shape[0]
    xs = x.reshape(n * 16, 16)
    scales, mins = _make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(n, 16), mins.reshape(n, 16)
    max_scale = np.maximum(scales.max(axis=1), 0)
    max_min = np.maximum(mins.max(axis=1), 0)
    ls = _rint_clip(_divide_or_zero(np.float32(15), max_scale)[:, None] * scales, 0, 15).astype(np.uint8)
    lm = _rint_clip(_divide_or_zero(np.float32(15), max_min)[:, None] * mins, 0, 15).astype(np.uint8)
    d = f16_bytes(max_scale / np.float32(15))
    dmin = f16_bytes(max_min / np.float32(15))
    dl = (d.view(np.float16).astype(np.float32) * ls.astype(np.float32))[:, :, None]
    ml = (dmin.view(np.float16).astype(np.float32) * lm.astype(np.float32))[:, :, None]
    L = _k_levels(x.reshape(n, 16, 16) + ml, dl, 0, 3).reshape(n, QK_K)
    return np.concatenate([ls | (lm << 4), _pack_2bit(L), d, dmin], axis=1)


def _q_q3_k(x):
    # quantize_row_q3_K_ref: 16 sub-blocks of 16 fit by make_q3_quants, 6-bit signed scales
    # against the block's largest |scale| (stored d = its 1/32, sign included)
    n = x.shape[0]
    scales, L0 = _make_q3_quants(x.reshape(n * 16, 16))
    scales, L0 = scales.reshape(n, 16), L0.reshape(n, 16, 16)
    _, max_scale = _signed_absmax(scales)
    iscale = _divide_or_zero(np.float32(-32), max_scale)
    l = _rint_clip(iscale[:, None] * scales, -32, 31) + 32
    l = np.where(max_scale[:, None] != 0, l, 0).astype(np.uint8)  # ggml: scale bytes left zeroed
    d = f16_bytes(_divide_or_zero(np.float32(1), iscale))
    dl = (d.view(np.float16).astype(np.float32) * (l.astype(np.float32) - 32))[:, :, None]
    L = _k_levels(x.reshape(n, 16, 16), dl, -4, 3) + 4   # 0..7
    L = np.where(dl != 0, L, L0).reshape(n, QK_K).astype(np.uint8)  # d == 0: make_q3_quants' levels stay
    hmask = np.packbits((L >> 2).reshape(n, 8, 32).transpose(0, 2, 1), axis=2, bitorder="little")[:, :, 0]
    return np.concatenate([hmask, _pack_2bit(L & 3), _pack_q3k_scales(l), d], axis=1)


def _q_q6_k(x):
    # quantize_row_q6_K_ref: 16 sub-blocks of 16 fit by make_qx_quants, int8 scales against
    # the block's largest |scale| (stored d = its 1/128, sign included)
    n = x.shape[0]
    scales = _make_qx_quants(x.reshape(n * 16, 16), 32).reshape(n, 16)
    max_abs, max_scale = _signed_absmax(scales)
    zero = max_abs < GROUP_MAX_EPS                          # ggml: the whole block is zero bytes
    iscale = np.float32(-128) / np.where(zero, 1, max_scale)
    d = f16_bytes(np.where(zero, 0, 1 / iscale))
    sc = np.minimum(np.rint(iscale[:, None] * scales), 127)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    dl = (d.view(np.float16).astype(np.float32) * sc.astype(np.float32))[:, :, None]
    L = (_k_levels(x.reshape(n, 16, 16), dl, -32, 31) + 32).reshape(n, 2, 4, 32).astype(np.uint8)
    low = L & 0x0F   # ql: per half, bytes 0-31 hold elements 0-31 / 64-95, bytes 32-63 32-63 / 96-127
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = np.bitwise_or.reduce((L >> 4) << np.array([0, 2, 4, 6], np.uint8)[None, None, :, None], axis=2)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d], axis=1)


# best_index_int8 over KVALUES_IQ4NL as a table: the nearest level to v, a tie going to the
# upper one, is the number of midpoints <= v. The midpoints are multiples of 0.5 and v's
# distances to its two neighbours are exact near them (|v| >= 4.5 there), so comparing
# floor(2 v) with the doubled midpoints gives ggml's float comparisons exactly.
_IQ4_MID2 = KVALUES_IQ4NL[:-1].astype(np.int32) + KVALUES_IQ4NL[1:]
_IQ4_INDEX = (np.arange(-256, 257)[:, None] >= _IQ4_MID2[None, :]).sum(axis=1).astype(np.uint8)
_IQ4_VALUE = KVALUES_IQ4NL[_IQ4_INDEX].astype(np.float32)


def _iq4_slot(v: np.ndarray) -> np.ndarray:
    t = np.floor(2 * v)
    np.clip(t, -256, 256, out=t)
    return (t + 256).astype(np.intp)


def _iq4_scales(x, ntry=7):
    """quantize_row_iq4_nl_impl's per-sub-block search (no importance weights: weights x^2,
    ntry = 7 as quantize_iq4_nl / quantize_iq4_xs use) for every row of x [B, 32]: the scale
    from the max level, refit by least squares, then 15 grids (max at level -127 + itry) kept
    if their refit explains more. Returns the signed scale [B] (0 for an all-zero row)."""
    amax, mx = _signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, 1, mx)
    w = x * x
    wx = w * x
    v0 = np.float32(KVALUES_IQ4NL[0])

    def fit(iscale):
        q = _IQ4_VALUE[_iq4_slot(iscale[:, None] * x)]
        return _rowdot(wx, q).astype(np.float64), _rowdot(w * q, q).astype(np.float64)

    sumqx, sumq2 = fit(1 / (-mx / v0))
    d = _divide_or_zero(sumqx, sumq2)
    best = d * sumqx
    for itry in range(-ntry, ntry + 1):
        sumqx, sumq2 = fit((np.float32(itry) + v0) / mx)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = np.where(better, _divide_or_zero(sumqx, sumq2), d)
        best = np.where(better, d * sumqx, best)
    return np.where(zero, 0, d).astype(np.float32)


def _q_iq4_nl(x):
    d = _iq4_scales(x)
    L = _IQ4_INDEX[_iq4_slot(_divide_or_zero(np.float32(1), d)[:, None] * x)]
    return np.concatenate([f16_bytes(d), _pack_nibbles(L, 16)], axis=1)


def _q_iq4_xs(x):
    # 8 sub-blocks of 32; their scales as 6-bit signed multiples of the block's d = -max/32
    # (levels from the float32 d, as ggml; the stored d is its f16)
    n = x.shape[0]
    scales = _iq4_scales(x.reshape(n * 8, 32)).reshape(n, 8)
    _, max_scale = _signed_absmax(scales)
    d = -max_scale / np.float32(32)
    l = _rint_clip(_divide_or_zero(np.float32(1), d)[:, None] * scales, -32, 31)
    idl = _divide_or_zero(np.float32(1), d[:, None] * l)
    L = _IQ4_INDEX[_iq4_slot(idl[:, :, None] * x.reshape(n, 8, 32))].reshape(n, QK_K)
    l = (l + 32).astype(np.uint16)
    scales_h = np.bitwise_or.reduce((l >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1)
    scales_l = _pack_nibbles(l & 0x0F, 1)
    return np.concatenate([f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l,
                           _pack_nibbles(L, 16)], axis=1)


def _q5_bytes(q):
    """5-bit values [N, 32] -> qh [N, 4] (fifth bits, little-endian uint32) and qs [N, 16]."""
    return np.packbits(q >> 4, axis=1, bitorder="little"), _pack_nibbles(q & 0x0F, 16)


def _q_q5_0(x):
    # quantize_row_q5_0_ref (gguf-py's bytes): d = the signed largest-|x| value / -16, q from
    # the float32 d truncated after + 16.5
    _, mx = _signed_absmax(x)
    d = mx / np.float32(-16)
    q = np.minimum(np.trunc(x * _divide_or_zero(np.float32(1), d)[:, None] + np.float32(16.5)), 31)
    qh, qs = _q5_bytes(q.astype(np.uint8))
    return np.concatenate([f16_bytes(d), qh, qs], axis=1)


def _q_q5_1(x):
    # quantize_row_q5_1_ref (gguf-py's bytes): d = (max - min) / 31, m = min, q truncated after + 0.5
    mn, mx = x.min(axis=1), x.max(axis=1)
    d = (mx - mn) / np.float32(31)
    q = np.clip(np.trunc((x - mn[:, None]) * _divide_or_zero(np.float32(1), d)[:, None] + np.float32(0.5)), 0, 31)
    qh, qs = _q5_bytes(q.astype(np.uint8))
    return np.concatenate([f16_bytes(d), f16_bytes(mn), qh, qs], axis=1)


def _q_mxfp4(x):
    # quantize_row_mxfp4_ref (gguf-py's bytes): e = floor(log2(amax)) - 2 + 127, taken with
    # float32 log2 as gguf-py does (a value just under a power of two can round up to it);
    # ggml casts that float to uint8 unchecked, here it is clipped to the byte's range
    amax = np.abs(x).max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0)
    e = np.clip(e, 0, 255).astype(np.uint8)
    d = e8m0_to_f32_half(e)
    # nearest of the 16 values, first index on a tie (best_index_mxfp4). The table is its
    # positive half then the negated half, so: the nearest magnitude among 0..7 for |x|, and
    # for x < 0 the same slot + 8, except that zero stays slot 0 (it comes first)
    pos = KVALUES_MXFP4[:8].astype(np.float32)
    a = np.abs(x)
    j = np.abs(d[:, None, None] * pos[None, None, :] - a[:, :, None]).argmin(axis=2).astype(np.uint8)
    j = np.where((x < 0) & (j > 0), j + 8, j)
    return np.concatenate([e[:, None], _pack_nibbles(j, 16)], axis=1)


_QUANT = {
    "q2_k": _q_q2_k, "q3_k": _q_q3_k, "q4_k": _q_q4_k, "q5_k": _q_q5_k, "q6_k": _q_q6_k,
    "iq4_nl": _q_iq4_nl, "iq4_xs": _q_iq4_xs, "q5_0": _q_q5_0, "q5_1": _q_q5_1, "mxfp4": _q_mxfp4,
}


def quantize_blocks(w: np.ndarray, scheme: str) -> np.ndarray:
    """A float matrix [out, in] -> its GGUF blocks in `scheme`, uint8 [out, row_bytes(scheme, in)]
    (the numpy reference quantizers above).

    Cost, 2048 x 2048 on one shared EPYC core (CPU seconds, quantize / dequantize): q2_k 1.15 /
    0.09 (its absolute-error search has no shortcut), q4_k 0.72, q3_k 0.52, q5_k 0.50,
    iq4_xs 0.46, q6_k 0.44, iq4_nl 0.39, mxfp4 0.28, q5_1 0.04, q5_0 0.03; dequantize
    0.02-0.03 for the others. 4096 x 4096 takes four times that."""
    bt = _block_type(scheme)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {w.shape}")
    rb = row_bytes(scheme, w.shape[1])
    blocks = w.reshape(-1, bt.elements)
    out = np.empty((blocks.shape[0], bt.nbytes), np.uint8)
    step = max(1, _CHUNK_ELEMENTS // bt.elements)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = _QUANT[scheme](blocks[i:i + step])
    return out.reshape(w.shape[0], rb)
