"""GGUF's block-quantized types held as the file stores them: the K-quants (Q2_K..Q6_K), the
4-bit non-linear IQ types (IQ4_NL, IQ4_XS), Q5_0 / Q5_1 and MXFP4.

A matrix of one of these "block schemes" is a QTensor whose q is uint8 [out, blocks * block
bytes]: each row is a run of GGUF blocks, byte for byte what the file holds (no scales or mins
arrays, rows never interleaved). Import is a byte copy, an expert read from a GGUF lands in RAM
as its kernels read it, and nothing is ever requantized.

Each block covers `elements` consecutive inputs of one row (256 for the K-quants and IQ4_XS, 32
for the others); a row's input count must be a multiple of it. The byte layouts are ggml's
(ggml-common.h: block_q4_K and friends); the numpy dequantizers below are the reference every
kernel is tested against, and they equal gguf-py's `gguf.quants.dequantize` bit for bit
(tests/formats/test_ggml_blocks.py).
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
