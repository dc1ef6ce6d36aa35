"""gpt-oss's routed experts as its checkpoints store them -> colibri's expert matrices, after
transformers' models/gpt_oss (GptOssExperts) and integrations/mxfp4.py.

A layer's experts are stacked tensors: `experts.gate_up_proj` float [E, D, 2I] with gate and
up interleaved along the last axis (gate = [..., 0::2], up = [..., 1::2]) and `down_proj`
[E, I, D], both transposed against colibri's [out, in]; or, in the released checkpoints,
MXFP4: `*_blocks` uint8 [E, out, in / 32, 16] and `*_scales` uint8 [E, out, in / 32] (E8M0
exponents), the gate/up rows interleaved the same way. MXFP4 is kept as it is: its bytes are
repacked into ggml's MXFP4 blocks (formats/ggml_blocks.py, scheme "mxfp4"), which hold the
same values. The biases `*_bias` [E, 2I] / [E, D] become dense float32 tensors
`{prefix}.experts.{gate_proj,up_proj,down_proj}.bias` [E, out].
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor

# The stacked expert tensors of one layer: `prefix` is the layer's "model.layers.N.mlp".
EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<part>_blocks|_scales|_bias|)$")
MXFP4_BLOCK = 32  # values per E8M0 scale


def is_mxfp4(config: dict) -> bool:
    """Whether config.json says the experts are stored as MXFP4 (the released checkpoints)."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "mxfp4":
        return False
    if config.get("model_type") != "gpt_oss":
        raise ColibriError(f"config field quantization_config.quant_method='mxfp4' is only supported for "
                           f"gpt_oss, not {config.get('model_type')!r}")
    return True


def mxfp4_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP MXFP4 rows -> ggml MXFP4 rows, the same values (a lossless byte repack).

    blocks uint8 [R, G, 16]: byte j of a block holds value 2j in its low nibble and 2j + 1 in
    its high one; scales uint8 [R, G]: the block's E8M0 exponent. ggml's block is that
    exponent byte, then 16 bytes whose byte j holds value j low and value j + 16 high; its
    nibble codes index the same E2M1 table (doubled, with the exponent halved to match).
    Returns uint8 [R, G * 17]."""
    R, G, _ = blocks.shape
    if scales.shape != (R, G):
        raise ColibriError(f"MXFP4 scales {scales.shape} do not match blocks {blocks.shape}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(R, G, MXFP4_BLOCK)  # value order
    qs = codes[..., :16] | (codes[..., 16:] << 4)                                       # [R, G, 16]
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(R, G * 17)


def mxfp4_matrix(blocks: np.ndarray, scales: np.ndarray) -> QTensor:
    """One OCP MXFP4 matrix (blocks [R, G, 16], E8M0 scales [R, G]) as a ggml MXFP4 QTensor
    [R, 32 G]: the same values (DeepSeek V4's FP4 experts share the layout)."""
    return _mxfp4(mxfp4_rows(blocks, scales), blocks.shape[1] * MXFP4_BLOCK)


def _mxfp4(rows: np.ndarray, inputs: int) -> QTensor:
    return QTensor("mxfp4", (rows.shape[0], inputs), np.ascontiguousarray(rows))


def split_float(proj: str, w: np.ndarray) -> Iterator[tuple[int, str, np.ndarray]]:
    """A float stacked tensor ([E, D, 2I] gate_up or [E, I, D] down) -> (expert, projection,
    float32 [out, in]) for each expert."""
    for e in range(w.shape[0]):
        if proj == "down_proj":
            yield e, "down_proj", np.ascontiguousarray(w[e].T)
        else:
            yield e, "gate_proj", np.ascontiguousarray(w[e][:, 0::2].T)
            yield e, "up_proj", np.ascontiguousarray(w[e][:, 1::2].T)


def split_mxfp4(proj: str, blocks: np.ndarray, scales: np.ndarray) -> Iterator[tuple[int, str, QTensor]]:
    """MXFP4 stacked blocks/scales -> (expert, projection, mxfp4 QTensor [out, in]) per expert."""
    if blocks.ndim != 4 or blocks.shape[-1] != 16:
        raise ColibriError(f"{proj}_blocks has shape {blocks.shape}; expected [experts, rows, blocks, 16]")
    inputs = blocks.shape[2] * MXFP4_BLOCK
    for e in range(blocks.shape[0]):
        rows = mxfp4_rows(blocks[e], scales[e])
        if proj == "down_proj":
            yield e, "down_proj", _mxfp4(rows, inputs)
        else:
            yield e, "gate_proj", _mxfp4(rows[0::2], inputs)
            yield e, "up_proj", _mxfp4(rows[1::2], inputs)


def split_bias(prefix: str, proj: str, b: np.ndarray) -> dict[str, np.ndarray]:
    """A stacked bias ([E, 2I] gate_up, interleaved, or [E, D] down) -> the dense tensors
    {name: float32 [E, out]} the model reads."""
    if proj == "down_proj":
        return {f"{prefix}.experts.down_proj.bias": np.ascontiguousarray(b, np.float32)}
    return {f"{prefix}.experts.gate_proj.bias": np.ascontiguousarray(b[:, 0::2], np.float32),
            f"{prefix}.experts.up_proj.bias": np.ascontiguousarray(b[:, 1::2], np.float32)}
