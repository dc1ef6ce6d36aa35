"""Quantization schemes: the in-memory tensor format the kernels read, plus plain numpy
quantizers and dequantizers that every numba kernel is tested against.

Layouts (all groups run along the input dimension, rows are output channels):
- int4_g64 (colibri default): symmetric, s = amax/7, q = clip(rint(w/s), -8, 7), stored as
  the nibble q+8; w = (nibble - 8) * s.
- q4_0 (GGUF Q4_0): group 32, w = (nibble - 8) * d.
- q4_1 (GGUF Q4_1): group 32, w = nibble * d + m.
- q8_0 (GGUF Q8_0): group 32, int8 q, w = q * d.
- f32 / f16 / bf16: unquantized; bf16 is kept as its raw uint16 bits (numpy has no bf16).
- block schemes (q2_k .. q6_k, iq4_nl, iq4_xs, q5_0, q5_1, mxfp4): GGUF's own blocks, q a row's
  run of them byte for byte, no scales arrays; quantize / dequantize hand them to
  ggml_blocks.quantize_blocks (ports of ggml's reference quantizers) / dequantize_blocks
  (gguf-py's values bit for bit).

Nibble order within a group of g elements (g/2 bytes): byte k holds element k in its low
nibble and element k + g/2 in its high nibble. That is GGUF's own Q4_0/Q4_1 order, so GGUF
import is a byte copy, and it lets a kernel expand one byte into two contiguous half-group
runs (docs/design.md section 6).
Scales and mins are float32 (GGUF's f16 scales widen exactly).

Layout: an int4 or q8_0 matrix's q is row-major as stored (interleave 1), or, for the CPU kernels,
its rows are interleaved in blocks of W (`interleaved`, done once at load): within each block
of W rows, the rows' first 64-byte blocks lie side by side, then their second ones, and so
on; the bytes past a row's last whole 64-byte block (its tail) follow, row after row. A decode
kernel reading W rows at a time then walks one contiguous run of W x 64 bytes per step where
it walked W streams a row apart: 18 -> 24-28 GB/s from DRAM on an AMD EPYC (Zen 4) VM
(bench/kernels/interleaved_layout.py; llama.cpp repacks Q4_0 the same way for x86, block_q4_0x8).
Scales and mins stay row-major: W consecutive rows' scales are one short run already. Only
where bytes sit changes, never what is computed with them: every kernel gives the same bits
on either layout (tests/kernels/test_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.formats.ggml_blocks import (
    BLOCK_SCHEMES,
    dequantize_blocks,
    quantize_blocks,
)

GROUP_SIZE = {"int4_g64": 64, "q4_0": 32, "q4_1": 32, "q8_0": 32}
FLOAT_SCHEMES = ("f32", "f16", "bf16")
SCHEMES = tuple(GROUP_SIZE) + FLOAT_SCHEMES + BLOCK_SCHEMES
INT4_SCHEMES = ("int4_g64", "q4_0", "q4_1")
INTERLEAVED_SCHEMES = INT4_SCHEMES + ("q8_0",)  # those whose rows the CPU kernels take interleaved (Layout)


@dataclass
class QTensor:
    """A 2-D weight matrix [out, in] in one of SCHEMES.

    q:      int4 schemes: uint8 [out, in // 2] packed nibbles; q8_0: int8 [out, in];
            f32: float32 [out, in]; f16: float16 [out, in]; bf16: uint16 [out, in] raw bits;
            block schemes: uint8 [out, ggml_blocks.row_bytes(scheme, in)] GGUF blocks.
    scales: float32 [out, in // group] for the GROUP_SIZE schemes, else None.
    mins:   float32 [out, in // group] for q4_1, else None.
    interleave: int4 and q8_0: q's rows interleaved in blocks of this many (1: row-major; see
            Layout above; `interleaved` makes one, `row_major` undoes it).
    """

    scheme: str
    shape: tuple[int, int]
    q: np.ndarray
    scales: np.ndarray | None = None
    mins: np.ndarray | None = None
    interleave: int = 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.q, self.scales, self.mins) if a is not None)

    def parts(self) -> dict[str, np.ndarray]:
        """The arrays that make up this tensor, by part name ("q", "scales", "mins")."""
        out = {"q": self.q}
        if self.scales is not None:
            out["scales"] = self.scales
        if self.mins is not None:
            out["mins"] = self.mins
        return out

    def rows(self, start: int, stop: int) -> "QTensor":
        """Rows [start, stop) as a view (no copy): a slice of output channels (of whole
        interleaved blocks, when q is interleaved)."""
        if start % self.interleave or stop % self.interleave:
            raise ValueError(f"rows [{start}, {stop}) cut blocks of {self.interleave} interleaved rows")
        return QTensor(
            self.scheme,
            (stop - start, self.shape[1]),
            self.q[start:stop],
            None if self.scales is None else self.scales[start:stop],
            None if self.mins is None else self.mins[start:stop],
            self.interleave,
        )


# --- Layout: interleaved int4 rows (module docstring) -------------------------------------

# Row bytes from which the decode kernels read a matrix two rows at a time, not eight
# (why: cpu.py, where the kernels use it); so also the block of rows it is interleaved in.
PAIR_ROW_BYTES = 1024


def chunk_shift(group_bytes: int) -> int:
    """log2 of the 16-byte chunks in a group's bytes (16 -> 0, 32 -> 1)."""
    chunks = group_bytes // 16
    if chunks * 16 != group_bytes or chunks & (chunks - 1):
        raise ValueError(f"group of {group_bytes} bytes is not a power-of-two number of 16-byte chunks")
    return chunks.bit_length() - 1


def interleave_width(t: QTensor) -> int:
    """The block of rows the decode kernels read t in (interleave_width_of)."""
    return interleave_width_of(t.scheme, t.shape)


def interleave_width_of(scheme: str, shape) -> int:
    """The block of rows the decode kernels read a [rows, inputs] matrix of `scheme` in: 2 for
    rows of PAIR_ROW_BYTES or more, else 8; 1 (leave row-major) for other schemes and for row
    counts the kernels' blocks of eight do not cover (their last rows are read one at a time)."""
    if scheme not in INTERLEAVED_SCHEMES or len(shape) != 2:  # (a 1-D or 3-D float tensor: as stored)
        return 1
    rows, inputs = shape
    if rows % 8 or rows == 0:
        return 1
    row_bytes = inputs if scheme == "q8_0" else inputs // 2
    return 2 if row_bytes >= PAIR_ROW_BYTES else 8


def _interleave_q(q: np.ndarray, width: int) -> np.ndarray:
    """Row-major q [rows, row_bytes] -> interleaved in blocks of `width` (a new array)."""
    rows, rb = q.shape
    nfull, groups = rb // 64, rows // width
    blocks = q[:, :64 * nfull].reshape(groups, width, nfull, 64).transpose(0, 2, 1, 3).reshape(groups, -1)
    tails = q[:, 64 * nfull:].reshape(groups, -1)
    return np.concatenate([blocks, tails], axis=1).reshape(rows, rb)


def _deinterleave_q(q: np.ndarray, width: int) -> np.ndarray:
    """_interleave_q undone (a new array)."""
    rows, rb = q.shape
    nfull, groups = rb // 64, rows // width
    flat = q.reshape(groups, width * rb)
    blocks = flat[:, :width * 64 * nfull].reshape(groups, nfull, width, 64).transpose(0, 2, 1, 3)
    tails = flat[:, width * 64 * nfull:].reshape(groups, width, rb - 64 * nfull)
    return np.concatenate([blocks.reshape(groups, width, -1), tails], axis=2).reshape(rows, rb)


def interleave_in_place(q: np.ndarray, width: int, chunk_bytes: int = 1 << 20) -> None:
    """Row-major q [rows, row_bytes] (C-contiguous) rewritten interleaved in blocks of `width`
    rows, through a buffer of about `chunk_bytes` (whole blocks at a time): a loader's
    repacking with no second copy of the matrix. numpy's copies release the GIL, so expert
    readers repack in their own threads (~7 GB/s on one core: five times the per-byte loop
    this replaced)."""
    if not q.flags.c_contiguous:  # (reshape would copy, and the rewrite be lost)
        raise ValueError("interleave_in_place needs a C-contiguous array")
    rows, rb = q.shape
    flat = q.reshape(-1)
    nfull = rb // 64
    block_bytes = width * rb
    blocks = rows // width
    per_chunk = max(1, chunk_bytes // block_bytes)
    for b0 in range(0, blocks, per_chunk):
        n = min(per_chunk, blocks - b0)
        seg = flat[b0 * block_bytes:(b0 + n) * block_bytes].reshape(n, block_bytes)
        src = seg.reshape(n, width, rb).copy()
        body = src[:, :, :64 * nfull].reshape(n, width, nfull, 64).transpose(0, 2, 1, 3)
        seg[:, :width * 64 * nfull].reshape(n, nfull, width, 64)[...] = body
        if rb > 64 * nfull:
            seg[:, width * 64 * nfull:].reshape(n, width, rb - 64 * nfull)[...] = src[:, :, 64 * nfull:]


def interleaved(t: QTensor, width: int | None = None, in_place: bool = False) -> QTensor:
    """t with q's rows interleaved in blocks of `width` (default interleave_width(t)); t
    itself when that is its layout already. in_place: rewrite t's own q array (no second copy
    of the matrix; t must not be used afterwards; interleave_in_place)."""
    width = interleave_width(t) if width is None else width
    if width == t.interleave:
        return t
    if t.interleave != 1:
        t = row_major(t)
    if t.scheme not in INTERLEAVED_SCHEMES or width & (width - 1) or t.shape[0] % width:
        raise ValueError(f"a {t.scheme} matrix of {t.shape[0]} rows cannot be interleaved in blocks of {width}")
    if in_place:
        interleave_in_place(t.q, width)
        return QTensor(t.scheme, t.shape, t.q, t.scales, t.mins, width)
    return QTensor(t.scheme, t.shape, _interleave_q(t.q, width), t.scales, t.mins, width)


def row_major(t: QTensor) -> QTensor:
    """t with a row-major q (a copy when t is interleaved; t itself otherwise)."""
    if t.interleave == 1:
        return t
    return QTensor(t.scheme, t.shape, _deinterleave_q(t.q, t.interleave), t.scales, t.mins)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> raw bfloat16 bits (uint16), round to nearest even (as torch does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((u >> 16) & 1) + np.uint32(0x7FFF)
    return ((u + rounding) >> 16).astype(np.uint16)


def pack_nibbles(nib: np.ndarray, group: int) -> np.ndarray:
    """nibbles uint8 [out, in] (values 0..15) -> packed uint8 [out, in // 2] in group order."""
    out, n = nib.shape
    g = nib.reshape(out, n // group, 2, group // 2)  # [O, G, half, g/2]
    return (g[:, :, 0, :] | (g[:, :, 1, :] << 4)).reshape(out, n // 2).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray, group: int) -> np.ndarray:
    """packed uint8 [out, in // 2] -> nibbles uint8 [out, in]."""
    out, half_n = packed.shape
    p = packed.reshape(out, (2 * half_n) // group, group // 2)  # [O, G, g/2]
    return np.concatenate([p & 0x0F, p >> 4], axis=2).reshape(out, 2 * half_n)


def _check_2d(w: np.ndarray, group: int) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D matrix, got shape {w.shape}")
    if w.shape[1] % group:
        raise ValueError(f"input dimension {w.shape[1]} is not a multiple of the group size {group}")
    return w


def _f16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest float16 value, widened back to float32 (how GGUF stores scales)."""
    return a.astype(np.float16).astype(np.float32)


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero (np.rint rounds them to even). Written as floor of the
    magnitude plus a half-step test, like gguf-py's np_roundf, so v + 0.5 never rounds."""
    a = np.abs(v)
    r = np.floor(a)
    r += np.floor(2 * (a - r))
    return np.copysign(r, v)


def quantize(w: np.ndarray, scheme: str) -> QTensor:
    """Quantize a float matrix [out, in] (numpy reference; also what `convert` uses)."""
    if scheme == "f32":
        w = np.ascontiguousarray(w, dtype=np.float32)
        return QTensor(scheme, w.shape, w)
    if scheme == "f16":
        w = np.ascontiguousarray(w, dtype=np.float16)
        return QTensor(scheme, w.shape, w)
    if scheme == "bf16":
        return QTensor(scheme, w.shape, f32_to_bf16(w))
    if scheme in BLOCK_SCHEMES:
        q = quantize_blocks(w, scheme)
        return QTensor(scheme, (q.shape[0], np.shape(w)[1]), q)
    if scheme not in GROUP_SIZE:
        raise ValueError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    g = GROUP_SIZE[scheme]
    w = _check_2d(w, g)
    out, n = w.shape
    blocks = w.reshape(out, n // g, g)  # [O, G, g]
    if scheme == "int4_g64":
        amax = np.abs(blocks).max(axis=2)
        s = (amax / np.float32(7.0)).astype(np.float32)
        inv = np.divide(1.0, s, out=np.zeros_like(s), where=s != 0)
        q = np.clip(np.rint(blocks * inv[:, :, None]), -8, 7)
        nib = (q + 8).astype(np.uint8).reshape(out, n)
        return QTensor(scheme, (out, n), pack_nibbles(nib, g), s)
    if scheme == "q4_0":
        # ggml quantize_row_q4_0_ref: d = max / -8 where max is the signed value of largest |w|.
        # As in ggml, q uses the float32 d; only the stored d is rounded to f16 (bit-exact
        # with gguf-py, tests/kernels/test_quant.py).
        idx = np.abs(blocks).argmax(axis=2)
        mx = np.take_along_axis(blocks, idx[:, :, None], axis=2)[:, :, 0]
        d = mx / np.float32(-8.0)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        nib = np.minimum(15, np.trunc(blocks * inv[:, :, None] + np.float32(8.5))).astype(np.uint8)
        return QTensor(scheme, (out, n), pack_nibbles(nib.reshape(out, n), g), _f16_round(d))
    if scheme == "q4_1":
        # ggml quantize_row_q4_1_ref: q from the float32 d and min, stored rounded to f16.
        mn = blocks.min(axis=2)
        mx = blocks.max(axis=2)
        d = (mx - mn) / np.float32(15.0)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
        nib = np.clip(np.trunc((blocks - mn[:, :, None]) * inv[:, :, None] + np.float32(0.5)), 0, 15)
        packed = pack_nibbles(nib.astype(np.uint8).reshape(out, n), g)
        return QTensor(scheme, (out, n), packed, _f16_round(d), _f16_round(mn))
    # q8_0, ggml quantize_row_q8_0_ref: q = roundf(w / d) (half away from zero) with the
    # float32 d; the stored d is rounded to f16.
    amax = np.abs(blocks).max(axis=2)
    d = amax / np.float32(127.0)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(_round_half_away(blocks * inv[:, :, None]), -127, 127).astype(np.int8).reshape(out, n)
    return QTensor(scheme, (out, n), q, _f16_round(d))


def dequantize(t: QTensor) -> np.ndarray:
    """QTensor -> float32 [out, in]. The reference every kernel is tested against."""
    if t.scheme == "f32":  # (any shape: a 3-D float tensor, such as a convolution's, is kept as stored)
        return np.asarray(row_major(t).q, dtype=np.float32)
    t = row_major(t)
    out, n = t.shape
    if t.scheme == "f16":
        return t.q.astype(np.float32)
    if t.scheme == "bf16":
        return bf16_to_f32(t.q)
    if t.scheme in BLOCK_SCHEMES:
        return dequantize_blocks(t.q, t.scheme, n)
    g = GROUP_SIZE[t.scheme]
    if t.scheme == "q8_0":
        vals = t.q.astype(np.float32).reshape(out, n // g, g)
        return (vals * t.scales[:, :, None]).reshape(out, n)
    nib = unpack_nibbles(t.q, g).reshape(out, n // g, g)
    if t.scheme == "q4_1":
        vals = nib.astype(np.float32) * t.scales[:, :, None] + t.mins[:, :, None]
    else:
        vals = (nib.astype(np.float32) - np.float32(8.0)) * t.scales[:, :, None]
    return vals.reshape(out, n).astype(np.float32)
