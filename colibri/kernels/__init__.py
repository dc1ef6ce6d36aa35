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



def set_threads(n: int) -> None:
    """Threads the parallel kernels use (numba's pool; at most the cores numba started with)."""
    from numba import config, set_num_threads

    set_num_threads(max(1, min(int(n), config.NUMBA_NUM_THREADS)))


__all__ = [
    "QTensor", "SCHEMES", "GROUP_SIZE", "FLOAT_SCHEMES", "INT4_SCHEMES",
    "quantize", "dequantize", "pack_nibbles", "unpack_nibbles", "bf16_to_f32", "f32_to_bf16",
    "matvec", "matmul", "embedding", "ops", "set_threads",
]
