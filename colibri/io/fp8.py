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
# DeepSeek V4's release names a weight's scales `<module>.scale` beside `<module>.weight`.
SCALE_SUFFIXES = (SCALE_SUFFIX, ".scale")
SCALE_FORMATS = ("float", "ue8m0")   # float32 scales (V3), or E8M0 exponent bytes (V4: 2 ** (byte - 127))
EXPERT_DTYPES = ("fp8", "fp4")       # fp4: DeepSeek V4's experts, two E2M1 codes a byte, an E8M0 scale per 32
FP4_BLOCK = 32


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
    for field, allowed in (("scale_fmt", SCALE_FORMATS), ("expert_dtype", EXPERT_DTYPES)):
        if q.get(field) is not None and q[field] not in allowed:
            raise ColibriError(f"config field quantization_config.{field}={q[field]!r} is not supported "
                               f"(one of {', '.join(allowed)})")
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
        names = {n for f in files for n in f.keys()}
        # a scale: `X.weight_scale_inv`, or `X.scale` beside an `X.weight` (not, say, mHC's `hc_attn_scale`)
        self.scales = {n: f for f in files for n in f.keys()
                       if n.endswith(SCALE_SUFFIX) or (n.endswith(".scale") and n[:-6] + ".weight" in names)}

    def is_scale(self, name: str) -> bool:
        """Scales are read together with their weight, never on their own."""
        return name in self.scales

    def is_fp4(self, f: SafetensorsFile, name: str) -> bool:
        """A DeepSeek V4 FP4 weight: int8 / uint8 codes, two a byte, with E8M0 scales per 32."""
        return f.tensors[name].dtype in ("I8", "U8") and self._scale_name(name) is not None

    def shape(self, f: SafetensorsFile, name: str) -> tuple[int, ...]:
        """The tensor's shape as values (an FP4 row holds two values a byte)."""
        shape = tuple(f.tensors[name].shape)
        return (*shape[:-1], 2 * shape[-1]) if self.is_fp4(f, name) else shape

    def float32(self, f: SafetensorsFile, name: str) -> np.ndarray:
        dtype = f.tensors[name].dtype
        if dtype == "F8_E4M3":
            return dequantize_fp8(f.read(name), self._scale_inv(f, name), self.block)
        if self.is_fp4(f, name):
            return dequantize_fp4(*self.fp4_parts(f, name))
        if dtype.startswith("F8"):
            raise ColibriError(f"{f.path}: tensor {name} is {dtype}; only F8_E4M3 FP8 weights are supported")
        return _float32(f, name)

    def fp4_parts(self, f: SafetensorsFile, name: str) -> tuple[np.ndarray, np.ndarray]:
        """FP4 weight `name` as (codes uint8 [R, K / 32, 16], E8M0 exponent bytes uint8 [R, K / 32]),
        the OCP MXFP4 layout (io/gpt_oss_experts.mxfp4_rows repacks it losslessly)."""
        codes = np.ascontiguousarray(f.read(name)).view(np.uint8)
        scale_name = self._scale_name(name)
        sf = self.scales[scale_name]
        exps = _e8m0_bytes(sf, scale_name)
        R, half = codes.shape
        if half % (FP4_BLOCK // 2) or exps.shape != (R, 2 * half // FP4_BLOCK):
            raise ColibriError(f"{f.path}: FP4 tensor {name} {list(codes.shape)} and its scales {list(exps.shape)} "
                               f"are not one E8M0 scale per {FP4_BLOCK} values of each row")
        return codes.reshape(R, -1, FP4_BLOCK // 2), exps

    def _scale_name(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        return next((base + s for s in SCALE_SUFFIXES if base + s in self.scales), None)

    def _scale_inv(self, f: SafetensorsFile, name: str) -> np.ndarray:
        """The float32 block scales of FP8 weight `name`, from whichever shard holds them."""
        if self.block is None:
            raise ColibriError(f"{f.path}: tensor {name} is float8 but config.json has no quantization_config "
                               "with weight_block_size; the checkpoint's config is incomplete")
        scale_name = self._scale_name(name)
        if scale_name is None:
            raise ColibriError(f"{f.path}: FP8 tensor {name} has no {name.removesuffix('.weight') + SCALE_SUFFIX} "
                               "(or .scale) in any shard")
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
        rows, cols = self.shape(f, name)
        step = max(1, max_elements // max(cols, 1))
        if self.is_fp4(f, name):  # (a routed expert's FP4 is kept as it is: only a dense one gets here)
            full = self.float32(f, name)
            for r in range(0, rows, step):
                yield r, full[r:r + step]
            return
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
    dtype = f.tensors[name].dtype
    if dtype == "BF16":
        return bf16_to_f32(a)
    if dtype == "F8_E8M0":  # exponent bytes: 2 ** (byte - 127), 0xFF NaN
        out = np.exp2(a.astype(np.float32) - np.float32(127))
        out[a == 0xFF] = np.nan
        return out
    return a.astype(np.float32, copy=False)


def _e8m0_bytes(f: SafetensorsFile, name: str) -> np.ndarray:
    """Scales as E8M0 exponent bytes: stored so (F8_E8M0 / U8), or float powers of two converted
    exactly; any other float has no E8M0 form and is refused."""
    if f.tensors[name].dtype in ("F8_E8M0", "U8"):
        return np.ascontiguousarray(f.read(name)).view(np.uint8)
    s = _float32(f, name)
    mant, exp = np.frexp(s)
    if not np.all((mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)):
        raise ColibriError(f"{f.path}: FP4 scales {name} are not powers of two (E8M0); not a DeepSeek V4 FP4 tensor")
    return (exp - 1 + 127).astype(np.uint8)


_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize_fp4(codes: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """FP4 (E2M1 codes [R, G, 16], value 2j low nibble, 2j + 1 high; E8M0 exponents [R, G]) ->
    float32 [R, 32 G]: every value exact in float32."""
    vals = np.stack([_E2M1[codes & 0x0F], _E2M1[codes >> 4]], axis=-1).reshape(*exps.shape, FP4_BLOCK)
    return (vals * np.exp2(exps.astype(np.float32) - np.float32(127))[..., None]).reshape(exps.shape[0], -1)
