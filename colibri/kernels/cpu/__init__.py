"""The CPU matrix kernels (numba) over QTensor, in parts:

    codegen.py   LLVM vector IR through numba intrinsics: bit decoders, row tiles, offset sums
    dequant.py   exact row dequantizers and the embedding lookup
    matvec.py    decode's matvec (one token) and matvec_rows (a few tokens, the same bits)
    checks.py    the argument checks every entry point runs
    fpenv.py     the floating-point setting a kernel runs in (subnormals flushed to zero)

Prefill's matmul is gemm.py; int4 x int8 dots idot.py. The package attribute `matvec` is the
function; take the module's other names with `from colibri.kernels.cpu.matvec import ...`.
"""
from .checks import check_tensor
from .codegen import TILE_A, TILE_W
from .dequant import embedding
from .matvec import int4_weight, matvec, matvec_rows

__all__ = ["TILE_A", "TILE_W", "check_tensor", "embedding", "int4_weight", "matvec", "matvec_rows"]
