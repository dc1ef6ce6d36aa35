"""Int4 weights as compressed-tensors' "pack-quantized" format writes them (Kimi-K2-Thinking,
Kimi-K2.5 / K2.6 routed experts; config.json `quantization_config.quant_method =
"compressed-tensors"`, `format = "pack-quantized"`): each quantized Linear is three tensors,

    X.weight_packed  int32 [O, I / 8]   eight 4-bit values a word, element j at bits 4j, each
                                        stored as q + 8 (q in -8..7)
    X.weight_scale   bf16  [O, I / 32]  one scale per group of 32 inputs
    X.weight_shape   int32 [2]          (O, I)

and w = q * scale (symmetric: no zero point). That is GGUF's Q4_0 exactly, w = (nibble - 8) * d
with group 32 (colibri/formats/qtensor.py): the nibbles move into q4_0's group order and the
bf16 scales widen to float32 exactly, so `convert` keeps these weights int4 with no rounding.
Only that configuration (4 bits, int, symmetric, group strategy, group size 32) is read; any
other is refused, naming the field. After compressed_tensors' pack_to_int32 / unpack_from_int32.
"""
from __future__ import annotations

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor, bf16_to_f32, pack_nibbles

PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
GROUP = 32


def pack_quantized(config: dict) -> bool:
    """Whether config.json's quantization_config is compressed-tensors int4 pack-quantized in the
    one layout read here (False: no such quantization_config); any other is a ColibriError."""
    q = config.get("quantization_config")
    if not q or q.get("quant_method") != "compressed-tensors":
        return False
    where = "quantization_config"
    if q.get("format") != "pack-quantized":
        raise ColibriError(f"config field {where}.format={q.get('format')!r} is not supported (only 'pack-quantized')")
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
        for key, value in want.items():
            if w.get(key) != value:
                raise ColibriError(f"config field {where}.config_groups.{name}.weights.{key}={w.get(key)!r} is not "
                                   f"supported (int4 pack-quantized needs {key}={value!r})")
        if group.get("input_activations"):
            raise ColibriError(f"config field {where}.config_groups.{name}.input_activations is not supported "
                               "(weight-only quantization)")
    return True


def is_side_tensor(name: str) -> bool:
    """A packed weight's scale and shape are read with it, never on their own."""
    return name.endswith((SCALE, SHAPE))


def weight_name(packed_name: str) -> str:
    """"...down_proj.weight_packed" -> "...down_proj.weight"."""
    return packed_name[: -len(PACKED)] + ".weight"


def to_q4_0(packed: np.ndarray, scale_bits: np.ndarray, shape) -> QTensor:
    """weight_packed int32 [O, I/8], weight_scale raw bf16 bits uint16 [O, I/32] (or float32),
    weight_shape (O, I) -> the same values as a q4_0 QTensor (bit for bit: no rounding)."""
    rows, cols = (int(v) for v in shape)
    if cols % GROUP:
        raise ColibriError(f"pack-quantized weight of shape [{rows}, {cols}]: inputs are not a multiple of {GROUP}")
    words = np.ascontiguousarray(packed).view(np.uint32)
    if words.shape != (rows, cols // 8):
        raise ColibriError(f"pack-quantized weight [{rows}, {cols}] needs weight_packed of shape "
                           f"[{rows}, {cols // 8}], got {list(words.shape)}")
    shifts = np.arange(8, dtype=np.uint32) * np.uint32(4)
    nib = ((words[:, :, None] >> shifts) & np.uint32(0xF)).astype(np.uint8).reshape(rows, cols)  # q + 8
    scales = bf16_to_f32(scale_bits) if scale_bits.dtype == np.uint16 else scale_bits.astype(np.float32)
    if scales.shape != (rows, cols // GROUP):
        raise ColibriError(f"pack-quantized weight [{rows}, {cols}] needs weight_scale of shape "
                           f"[{rows}, {cols // GROUP}], got {list(scales.shape)}")
    return QTensor("q4_0", (rows, cols), pack_nibbles(nib, GROUP), np.ascontiguousarray(scales))


def from_q4_0_values(q: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse, for writing such checkpoints (tests): q int [O, I] in -8..7, scales [O, I/32]
    -> (weight_packed int32 [O, I/8], weight_shape int32 [2]), as pack_to_int32 writes them."""
    rows, cols = q.shape
    nib = (q.astype(np.int64) + 8).astype(np.uint32).reshape(rows, cols // 8, 8)
    words = (nib << (np.arange(8, dtype=np.uint32) * np.uint32(4))).sum(axis=2, dtype=np.uint32)
    return words.view(np.int32), np.array([rows, cols], dtype=np.int32)
