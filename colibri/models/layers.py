"""The numerics every block shares: RMSNorm, SwiGLU's silu(gate) * up, linear layers over the
kernels (one row, several rows, fused matrices) and the dense SwiGLU MLP. Numerics follow the
transformers implementations (float32 throughout).

Shape letters: L tokens, D hidden, I intermediate.
"""
from __future__ import annotations

import numpy as np

from colibri.memory import WEIGHTS
from colibri.kernels import block_idot, idot, matmul, matvec, ops
from colibri.kernels.tasks import over_rows
from colibri.kernels.cpu import matvec_rows
from colibri.formats.qtensor import QTensor


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] -> weight * x / sqrt(mean(x^2) + eps), as transformers' RMSNorm in float32."""
    shape = x.shape
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, shape[-1])
    w, eps = np.ascontiguousarray(weight, dtype=np.float32), np.float32(eps)
    out = np.empty_like(x2)
    over_rows(lambda a, b: ops.rms_norm_into(x2[a:b], w, eps, out[a:b]), x2.shape[0])
    return out.reshape(shape)


def silu_mul(gu: np.ndarray, n: int) -> np.ndarray:
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n] (ops.silu_mul, rows over the threads)."""
    out = np.empty((gu.shape[0], n), np.float32)
    over_rows(lambda a, b: ops.silu_mul_into(gu[a:b], n, out[a:b]), gu.shape[0])
    return out


def fuse_rows(*ts: QTensor) -> QTensor | None:
    """Stack matrices that read the same input into one (q/k/v, gate/up): one kernel call
    instead of several per token. Rows are computed independently, so the outputs are the
    same numbers. None when the schemes or input widths differ."""
    if len({t.scheme for t in ts}) != 1 or len({t.shape[1] for t in ts}) != 1 or len({t.interleave for t in ts}) != 1:
        return None

    def cat(arrays):  # into the huge-page slab, where the container puts the weights it reads
        if arrays[0] is None:
            return None
        out = WEIGHTS.empty((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
        return np.concatenate(arrays, axis=0, out=out)

    # (interleaved blocks never straddle two matrices: stacked, they stay whole)
    return QTensor(ts[0].scheme, (sum(t.shape[0] for t in ts), ts[0].shape[1]), cat([t.q for t in ts]),
                   cat([t.scales for t in ts]), cat([t.mins for t in ts]), ts[0].interleave)


def _int8_kernels(w: QTensor):
    """The integer-dot module for w under `--activations int8` (int4 and q8_0: kernels/idot.py;
    the GGUF types of block_idot.INT8_SCHEMES, all but Q5_1: kernels/block_idot.py), or
    None: the exact kernels (every other scheme, and any scheme in the default f32 mode)."""
    if idot.current() != "int8":
        return None
    if w.scheme in idot.SCHEMES:
        return idot
    return block_idot if w.scheme in block_idot.INT8_SCHEMES else None


def linear(x: np.ndarray, w: QTensor, bias: np.ndarray | None = None) -> np.ndarray:
    """x [L, in] -> [L, out]. Decode (L == 1) takes the matvec kernel, prefill the matmul one;
    int4, q8_0 and block_idot.INT8_SCHEMES weights under `--activations int8` take the integer-dot
    kernels, whose prompt rows equal decoding each token (_int8_kernels)."""
    int8 = _int8_kernels(w)
    if int8 is not None:
        y = int8.matvec_q(w, x[0])[None, :] if x.shape[0] == 1 else int8.matmul_q(w, x)
    elif x.shape[0] == 1:
        y = matvec(w, x[0])[None, :]
    else:
        y = matmul(w, x)
    if bias is not None:
        y += bias
    return y


def linear_rows(x: np.ndarray, w: QTensor) -> np.ndarray:
    """linear(x[r:r+1], w) for each row of x [B, in] -> [B, out], the same bits, with the
    weights read once for all rows (several tokens decoded in one pass)."""
    if x.shape[0] == 1:  # the one-row kernels' 8-row blocks beat a tile of one token
        return linear(x, w)
    int8 = _int8_kernels(w)
    if int8 is not None:
        return int8.matmul_q(w, x)
    return matvec_rows(w, x)


def unweighted_rms(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) over the last axis, float32: RMSNorm without a weight
    (DeepseekV4UnweightedRMSNorm)."""
    x = x.astype(np.float32)
    return x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(eps))


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), float32 (overflow in exp is the intended 0)."""
    with np.errstate(over="ignore"):
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax along `axis`, float32."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32)


def clipped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(gate, limit)) * clip(up, -limit, limit): the SwiGLU of DeepSeek V4 and GLM-5.3-Flash,
    whose gate and up are clipped at `swiglu_limit` (DeepseekV4MLP, Glm5NextTextMLP); the fused
    decode kernel's own code for their routed experts (ops.expert_glu_into)."""
    return ops.expert_glu(gate, up, ops.CLIPPED_SILU, 1.0, limit)


class MLP:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down
        self.gate_up = fuse_rows(gate, up)

    @classmethod
    def from_weights(cls, w, prefix: str) -> "MLP":
        return cls(*(w.tensor(f"{prefix}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up is None:
            return linear(ops.silu_gate(linear(x, self.gate), linear(x, self.up)), self.down)
        gu = linear(x, self.gate_up)  # [L, 2I]
        return linear(silu_mul(gu, self.gate.shape[0]), self.down)

