"""Compute kernels: the QTensor format and its numpy reference (quant), numba CPU kernels (cpu)."""
from . import ops
from .cpu import embedding, matmul, matvec
from .quant import (
    FLOAT_SCHEMES,
    GROUP_SIZE,
    INT4_SCHEMES,
    SCHEMES,
    QTensor,
    bf16_to_f32,
    dequantize,
    f32_to_bf16,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)

__all__ = [
    "QTensor", "SCHEMES", "GROUP_SIZE", "FLOAT_SCHEMES", "INT4_SCHEMES",
    "quantize", "dequantize", "pack_nibbles", "unpack_nibbles", "bf16_to_f32", "f32_to_bf16",
    "matvec", "matmul", "embedding", "ops",
]
