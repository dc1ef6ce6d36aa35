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
