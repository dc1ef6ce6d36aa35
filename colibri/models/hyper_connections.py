"""Manifold-constrained hyper-connections (mHC) of DeepSeek V4 and GLM-5.3-Flash: the residual is
`hc_mult` parallel streams [L, S, D]. Before each block (attention, then the MLP) a small
projection of the normed streams gives three mixes: `pre` collapses the streams into the
block's input, `post` spreads the block's output over them, and `comb`, made doubly stochastic
by Sinkhorn iterations, mixes the old streams into the new (after transformers'
DeepseekV4HyperConnection / Glm5NextTextHyperConnection, which compute the same). `args` needs
hc_mult, hc_sinkhorn_iters, hc_eps and rms_norm_eps; the weights are `{prefix}.fn / .base /
.scale`.

Shape letters: L tokens, S streams, D hidden.
"""
from __future__ import annotations

import numpy as np

from colibri.formats.qtensor import dequantize
from colibri.models.layers import sigmoid, softmax, unweighted_rms


class HyperConnection:
    """mHC weights from the streams [L, S, D]: `pre` collapses them into the block's input,
    `post` spreads the block's output over them, `comb` (Sinkhorn-normalised, doubly
    stochastic) mixes them (DeepseekV4HyperConnection, Glm5NextTextHyperConnection)."""

    def __init__(self, args, w, prefix: str):
        self.fn = dequantize(w.tensor(f"{prefix}.fn")).astype(np.float32)   # [(2 + S) S, S D]
        self.base = w.tensor(f"{prefix}.base").astype(np.float32)
        self.scale = w.tensor(f"{prefix}.scale").astype(np.float32)
        self.s, self.iters = args.hc_mult, args.hc_sinkhorn_iters
        self.eps, self.norm_eps = args.hc_eps, args.rms_norm_eps

    def __call__(self, streams: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        L, S = streams.shape[0], self.s
        mixes = unweighted_rms(streams.reshape(L, -1), self.norm_eps) @ self.fn.T           # [L, (2 + S) S]
        eps = np.float32(self.eps)
        pre = sigmoid(mixes[:, :S] * self.scale[0] + self.base[:S]) + eps
        post = np.float32(2.0) * sigmoid(mixes[:, S:2 * S] * self.scale[1] + self.base[S:2 * S])
        comb = softmax(mixes[:, 2 * S:].reshape(L, S, S) * self.scale[2] + self.base[2 * S:].reshape(S, S), -1) + eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
            comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
        collapsed = np.sum(pre[:, :, None] * streams, axis=1, dtype=np.float32)          # [L, D]
        return post, comb, collapsed


def merge(streams: np.ndarray, out: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """The streams after a block: post spreads its output [L, D], comb^T mixes the old streams."""
    return (post[:, :, None] * out[:, None, :] + np.matmul(comb.transpose(0, 2, 1), streams)).astype(np.float32)


