"""FP8 checkpoints as DeepSeek-V3, Kimi-K2 and GLM ship them: float8_e4m3fn weights, each with a
float32 `weight_scale_inv` holding one scale per 128x128 block (config.json
`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}`):

    w[i, j] = fp8(q[i, j]) * weight_scale_inv[i // 128, j // 128]

`convert` reads such a checkpoint tensor by tensor through `CheckpointReader`, with preads (no
file pages stay mapped, so the converter's RSS does not grow with the checkpoint), dequantizes
to float32 and hands the values to the quantizer, so an FP8 model goes straight to int4 without
an intermediate bf16 copy on disk. A weight's scale may sit in another shard. `float32` gives a
whole tensor (one pread); `row_chunks`, which convert uses for every matrix, reads it in 16 MiB
slabs and dequantizes a few rows at a time, so neither its stored bytes nor its float32 copy
(nor the quantizer's temporaries, up to ~6x that) are ever whole in memory: DeepSeek-V3's
embeddings (129280 x 7168 bf16, 1.85 GB) quantized as one float32 matrix took ~22 GB.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from colibri.errors import ColibriError
from colibri.io.safetensors_io import SafetensorsFile
from colibri.formats.qtensor import bf16_to_f32

SCALE_SUFFIX = ".weight_scale_inv"


def _e4m3fn_table() -> np.ndarray:
    """All 256 float8_e4m3fn values (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
    infinities, 0x7F and 0xFF are NaN) as float32; every one is exact in float32."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, mant = (b >> 3) & 0xF, b & 0x7
    normal = (1.0 + mant / 8.0) * np.exp2(exp - 7.0)
    subnormal = (mant / 8.0) * 2.0 ** -6
    vals = sign * np.where(exp == 0, subnormal, normal)
    vals[(b & 0x7F) == 0x7F] = np.nan
    return vals.astype(np.float32)


E4M3FN = _e4m3fn_table()


def block_size(config: dict) -> tuple[int, int] | None:
    """The FP8 weight block of config.json's quantization_config; None for an unquantized
    checkpoint. Any other quantization is refused, naming the field."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ColibriError(f"config field quantization_config.quant_method={method!r} is not supported by "
                           "convert (only 'fp8' block-scaled checkpoints); convert the bf16 checkpoint instead")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 spells out the dtype's name
        raise ColibriError(f"config field quantization_config.fmt={fmt!r} is not supported (only 'e4m3')")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or min(block) < 1:
        raise ColibriError(f"config field quantization_config.weight_block_size={block!r} is not supported "
                           "(FP8 needs one scale per [rows, cols] block, e.g. [128, 128])")
    return int(block[0]), int(block[1])


def dequantized_config(config: dict) -> dict:
    """config.json for the container: its weights are no longer FP8, so quantization_config goes."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def dequantize_fp8(raw: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 bytes uint8 [O, I] and block scales float32 [ceil(O/bo), ceil(I/bi)] -> float32 [O, I]."""
    _check_scales(raw.shape, scale_inv, block)
    return _dequantize_rows(raw, scale_inv, block, 0)


def _check_scales(shape: tuple[int, ...], scale_inv: np.ndarray, block: tuple[int, int]) -> None:
    bo, bi = block
    if len(shape) != 2:
        raise ColibriError(f"FP8 weight of shape {tuple(shape)}: only 2-D block-scaled matrices are supported")
    rows, cols = shape
    want = (-(-rows // bo), -(-cols // bi))
    if scale_inv.shape != want:
        raise ColibriError(f"FP8 weight [{rows}, {cols}] needs weight_scale_inv of shape {list(want)} "
                           f"for {bo}x{bi} blocks, got {list(scale_inv.shape)}")


def _dequantize_rows(raw: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], row0: int) -> np.ndarray:
    """Rows row0 .. row0 + len(raw) of an FP8 matrix (uint8 [rows, I]) -> float32, with the
    matrix's whole scale grid."""
    bo, bi = block
    rows, cols = raw.shape
    out = E4M3FN[raw]                                                # [rows, I]
    for i in range(row0 // bo, -(-(row0 + rows) // bo)):             # one row of blocks at a time
        a, b = max(i * bo, row0) - row0, min((i + 1) * bo, row0 + rows) - row0
        out[a:b] *= np.repeat(scale_inv[i], bi)[None, :cols]
    return out


class CheckpointReader:
    """float32 tensors of a (possibly FP8) multi-shard checkpoint, one pread per tensor."""

    def __init__(self, files: list[SafetensorsFile], block: tuple[int, int] | None):
        self.block = block
        self.scales = {n: f for f in files for n in f.keys() if n.endswith(SCALE_SUFFIX)}

    def is_scale(self, name: str) -> bool:
        """Scales are read together with their weight, never on their own."""
        return name.endswith(SCALE_SUFFIX)

    def float32(self, f: SafetensorsFile, name: str) -> np.ndarray:
        dtype = f.tensors[name].dtype
        if dtype == "F8_E4M3":
            return dequantize_fp8(f.read(name), self._scale_inv(f, name), self.block)
        if dtype.startswith("F8"):
            raise ColibriError(f"{f.path}: tensor {name} is {dtype}; only F8_E4M3 FP8 weights are supported")
        return _float32(f, name)

    def _scale_inv(self, f: SafetensorsFile, name: str) -> np.ndarray:
        """The float32 block scales of FP8 weight `name`, from whichever shard holds them."""
        if self.block is None:
            raise ColibriError(f"{f.path}: tensor {name} is float8 but config.json has no quantization_config "
                               "with weight_block_size; the checkpoint's config is incomplete")
        scale_name = name.removesuffix(".weight") + SCALE_SUFFIX
        if scale_name not in self.scales:
            raise ColibriError(f"{f.path}: FP8 tensor {name} has no {scale_name} in any shard")
        return _float32(self.scales[scale_name], scale_name)

    def row_chunks(self, f: SafetensorsFile, name: str, max_elements: int = 1 << 16,
                   slab_bytes: int = 16 << 20) -> Iterator[tuple[int, np.ndarray]]:
        """A 2-D tensor as float32 [rows, I] chunks with their first row index, each at most
        max_elements (at least one row), with the same values `float32` gives. The stored bytes
        are read with one pread per slab of ~slab_bytes into one buffer, so neither the whole
        tensor nor its float32 copy is ever in memory; each chunk is a fresh array."""
        info = f.tensors[name]
        if len(info.shape) != 2:
            raise ColibriError(f"{f.path}: tensor {name} of shape {list(info.shape)} is not a matrix")
        rows, cols = info.shape
        step = max(1, max_elements // max(cols, 1))
        if info.dtype == "F8_E4M3":
            scale_inv = self._scale_inv(f, name)
            _check_scales(info.shape, scale_inv, self.block)
            widen = lambda a, r: _dequantize_rows(a, scale_inv, self.block, r)  # noqa: E731
        elif info.dtype.startswith("F8"):
            raise ColibriError(f"{f.path}: tensor {name} is {info.dtype}; only F8_E4M3 FP8 weights are supported")
        elif info.dtype == "BF16":
            widen = lambda a, r: bf16_to_f32(a)  # noqa: E731
        else:
            widen = lambda a, r: a.astype(np.float32)  # noqa: E731  (a copy: the buffer is reused)
        dtype = f.raw(name).dtype                        # a memmap view: no byte is touched
        row_bytes = cols * dtype.itemsize
        slab = max(step, slab_bytes // max(row_bytes, 1) // step * step)
        buf = np.empty((min(slab, rows), cols), dtype)
        with open(f.path, "rb", buffering=0) as fh:
            for s0 in range(0, rows, slab):
                part = buf[: min(slab, rows - s0)]
                n = os.preadv(fh.fileno(), [memoryview(part.reshape(-1).view(np.uint8))], info.offset + s0 * row_bytes)
                if n != part.nbytes:
                    raise ColibriError(f"{f.path}: short read of tensor {name}; the file is truncated")
                for r in range(0, len(part), step):
                    yield s0 + r, widen(part[r : r + step], s0 + r)


def _float32(f: SafetensorsFile, name: str) -> np.ndarray:
    a = f.read(name)
    if f.tensors[name].dtype == "BF16":
        return bf16_to_f32(a)
    return a.astype(np.float32, copy=False)
