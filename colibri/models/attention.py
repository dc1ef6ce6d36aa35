"""Grouped-query attention over a KV cache: fused q/k/v, optional biases, q/k RMSNorm (per head or
over all heads) and clipping, after transformers' llama / qwen3 / olmoe attention. MLA lives in
mla.py.

Shape letters: L tokens, D hidden, H query heads, KV key/value heads, Dh head dim.
"""
from __future__ import annotations

import numpy as np

from numba import get_num_threads

from colibri.kernels import ops
from colibri.kernels.attention import causal_attention
from colibri.models.args import ModelArgs
from colibri.models.cache import KVCache
from colibri.models.layers import fuse_rows, linear, rms_norm
from colibri.models.rope import Rope, apply_rope


class Attention:
    """Grouped-query attention with optional q/k bias and q/k RMSNorm (per head or over all heads)."""

    def __init__(self, args: ModelArgs, w, prefix: str, rope: Rope, qk_norm: str | None = None,
                 clip_qkv: float | None = None):
        self.h, self.kv, self.dh = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.eps = args.rms_norm_eps
        self.rope = rope
        self.q_proj, self.k_proj = w.tensor(f"{prefix}.q_proj.weight"), w.tensor(f"{prefix}.k_proj.weight")
        self.v_proj, self.o_proj = w.tensor(f"{prefix}.v_proj.weight"), w.tensor(f"{prefix}.o_proj.weight")
        self.q_bias, self.k_bias, self.v_bias = (
            w.tensor(f"{prefix}.{p}.bias") if w.has(f"{prefix}.{p}.bias") else None
            for p in ("q_proj", "k_proj", "v_proj"))
        self.o_bias = w.tensor(f"{prefix}.o_proj.bias") if w.has(f"{prefix}.o_proj.bias") else None
        self.qk_norm = qk_norm  # None, "head" (qwen3: over Dh) or "full" (olmoe: over H*Dh)
        if qk_norm:
            self.q_norm, self.k_norm = w.tensor(f"{prefix}.q_norm.weight"), w.tensor(f"{prefix}.k_norm.weight")
        self.clip_qkv = clip_qkv
        self.scale = np.float32(self.dh ** -0.5)
        self.qkv = fuse_rows(self.q_proj, self.k_proj, self.v_proj)
        biases = (self.q_bias, self.k_bias, self.v_bias)
        self.qkv_bias = None if all(b is None for b in biases) else np.concatenate(
            [b if b is not None else np.zeros(t.shape[0], np.float32)
             for b, t in zip(biases, (self.q_proj, self.k_proj, self.v_proj))])

    def __call__(self, x: np.ndarray, cache: KVCache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        L = x.shape[0]
        if self.qkv is not None:
            qkv = linear(x, self.qkv, self.qkv_bias)  # [L, (H + 2 KV) * Dh]
            nq, nk = self.h * self.dh, self.kv * self.dh
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q = linear(x, self.q_proj, self.q_bias)  # [L, H*Dh]
            k = linear(x, self.k_proj, self.k_bias)  # [L, KV*Dh]
            v = linear(x, self.v_proj, self.v_bias)  # [L, KV*Dh]
        if self.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:  # after the norm, as transformers' olmoe does
            c = np.float32(self.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(L, self.h, self.dh)
        k = k.reshape(L, self.kv, self.dh)
        if self.qk_norm == "head":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = apply_rope(q, cos, sin, self.rope.rotary_dim)
        k = apply_rope(k, cos, sin, self.rope.rotary_dim)
        cache.write_rows(layer, pos0, k.transpose(1, 0, 2), v.reshape(L, self.kv, self.dh).transpose(1, 0, 2))
        if L == 1:  # decode: one fused kernel over the cache
            out = ops.attend_one(q[0], cache.k[layer], cache.v[layer], pos0 + 1, self.scale)[None, :]
        else:
            out = causal_attention(q, cache.keys(layer, pos0 + L), cache.values(layer, pos0 + L), pos0, self.scale,
                                   get_num_threads())  # [L, H*Dh]
        return linear(out, self.o_proj, self.o_bias)

