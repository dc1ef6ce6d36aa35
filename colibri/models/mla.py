"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2, GLM-5) with a KV cache that holds only
the compressed latent, after transformers' DeepseekV3Attention.

Per token and layer the cache keeps c = RMSNorm(kv_a(x))[:kv_lora_rank] and the shared rotary
key k_rope (qk_rope_head_dim values) -- (512 + 64) * 4 = 2304 bytes in float32 for DeepSeek-V3,
instead of H * (qk_head_dim + v_head_dim) expanded K/V values (128 * 320 * 4 = 160 KiB).
kv_b_proj = [W_uk; W_uv] per head turns c back into k_nope and v. Decode (and any short run of
new tokens) uses the absorbed form, which never expands the cache:

    score(t) = (W_uk^T q_nope) . c_t + q_rope . k_rope_t      out = W_uv (sum_t p_t c_t)

It costs ~2r multiply-adds per head, query and cached token; expanding the N cached latents costs
r * (Dn + Dv) per head and cached token once per call, so a long prefill (2L >= Dn + Dv) expands,
like transformers does.

Shape letters: L tokens, N cached positions, H heads, r kv_lora_rank, R qk_rope_head_dim,
Dn qk_nope_head_dim, Dv v_head_dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.kernels.attention import OnlineSoftmax, key_block, seen_rows
from colibri.kernels.tasks import run_tasks, split
from colibri.formats.qtensor import dequantize
from colibri.models.cache import MLACache
from colibri.models.decoder import DecoderModel
from colibri.models.layers import linear, rms_norm
from colibri.models.moe import GroupedMoEArgs
from colibri.models.rope import Rope, apply_rope


@dataclass
class MLAArgs(GroupedMoEArgs):
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    rope_interleave: bool | None = True

    def __post_init__(self):
        super().__post_init__()
        window = self.extra.get("sliding_window")
        if window is not None or self.extra.get("use_sliding_window"):
            raise ColibriError(f"config field sliding_window={window!r} is not implemented for MLA attention")
        if self.qk_rope_head_dim % 2:
            raise ColibriError(f"config field qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim (transformers' yarn_apply_mscale)."""
        scale = self.qk_head_dim ** -0.5
        p = self.rope_params()
        if p["rope_type"] != "default" and p.get("mscale_all_dim"):
            factor = p.get("factor") or 1.0
            m = 1.0 if factor <= 1 else 0.1 * p["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= m * m
        return scale


def rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [L, H, R] with rotary pairs (x0, x1), (x2, x3)...; cos/sin [L, R]. Returns the rotated
    pairs de-interleaved (evens then odds), as transformers' apply_rotary_pos_emb_interleave:
    queries and keys get the same permutation, so their dot products are unchanged."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def causal_mask(pos0: int, L: int, N: int) -> np.ndarray:
    """[L, N]: query i (at position pos0 + i) sees keys 0 .. pos0 + i."""
    return np.arange(N)[None, :] <= (pos0 + np.arange(L))[:, None]


class MLAttention:
    def __init__(self, args: MLAArgs, w, prefix: str, rope: Rope | None, interleave: bool):
        self.h, self.r, self.rope_dim = args.num_attention_heads, args.kv_lora_rank, args.qk_rope_head_dim
        self.dn, self.dv = args.qk_nope_head_dim, args.v_head_dim
        self.interleave, self.rope = interleave, rope
        self.scale = np.float32(args.softmax_scale())

        def opt(name):
            return w.tensor(name) if w.has(name) else None

        if args.q_lora_rank:
            self.q_a, self.q_a_bias = w.tensor(f"{prefix}.q_a_proj.weight"), opt(f"{prefix}.q_a_proj.bias")
            self.q_a_norm, self.q_b = w.tensor(f"{prefix}.q_a_layernorm.weight"), w.tensor(f"{prefix}.q_b_proj.weight")
        else:
            self.q_a, self.q_b = None, w.tensor(f"{prefix}.q_proj.weight")
        self.kv_a = w.tensor(f"{prefix}.kv_a_proj_with_mqa.weight")          # [r+R, D]
        self.kv_a_bias = opt(f"{prefix}.kv_a_proj_with_mqa.bias")
        self.kv_a_norm = w.tensor(f"{prefix}.kv_a_layernorm.weight")
        self.kv_b = w.tensor(f"{prefix}.kv_b_proj.weight")                  # [H*(Dn+Dv), r]
        self.o_proj, self.o_bias = w.tensor(f"{prefix}.o_proj.weight"), opt(f"{prefix}.o_proj.bias")
        # Decode's absorbed form multiplies by W_uk^T and W_uv per head, which the row-major
        # kernels cannot do on packed rows: keep kv_b dequantized once (the values the
        # quantized weight stands for, so --bits 4 stays exact against its reference).
        w_kv = dequantize(self.kv_b).reshape(self.h, self.dn + self.dv, self.r)  # [H, Dn+Dv, r]
        self.w_uk = np.ascontiguousarray(w_kv[:, : self.dn])                 # [H, Dn, r]
        self.w_uv_t = np.ascontiguousarray(w_kv[:, self.dn :].transpose(0, 2, 1))  # [H, r, Dv]

    def _rotate(self, x: np.ndarray, cos, sin) -> np.ndarray:
        if self.rope is None:  # NoPE (Kimi Linear's MLA): the "rope" dims are used as they are
            return x
        if self.interleave:
            return rope_interleaved(x, cos, sin)
        return apply_rope(x, cos, sin, self.rope_dim)

    # q_a_layernorm and kv_a_layernorm use RMSNorm's default eps (1e-6) in transformers, not
    # rms_norm_eps.
    def query(self, x: np.ndarray, cos, sin):
        """-> (q_resid [L, q_lora_rank] or None, q_nope [L, H, Dn], q_rope [L, H, R])."""
        L = x.shape[0]
        q_resid = None
        if self.q_a is not None:
            q_resid = rms_norm(linear(x, self.q_a, self.q_a_bias), self.q_a_norm, 1e-6)
            q = linear(q_resid, self.q_b)
        else:
            q = linear(x, self.q_b)
        q = q.reshape(L, self.h, self.dn + self.rope_dim)
        return q_resid, q[..., : self.dn], self._rotate(q[..., self.dn :], cos, sin)

    def store_latent(self, x: np.ndarray, cache: MLACache, layer: int, pos0: int, cos, sin) -> None:
        L = x.shape[0]
        ckv = linear(x, self.kv_a, self.kv_a_bias)                          # [L, r+R]
        cache.latent(layer)[pos0 : pos0 + L] = rms_norm(ckv[:, : self.r], self.kv_a_norm, 1e-6)
        k_rope = self._rotate(ckv[:, None, self.r :], cos, sin)[:, 0]        # [L, R]
        cache.k_rope(layer)[pos0 : pos0 + L] = k_rope

    def __call__(self, x, cache: MLACache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        _, q_nope, q_rope = self.query(x, cos, sin)
        self.store_latent(x, cache, layer, pos0, cos, sin)
        return self.attend(q_nope, q_rope, cache, layer, pos0, causal_mask(pos0, x.shape[0], pos0 + x.shape[0]))

    def attend(self, q_nope, q_rope, cache: MLACache, layer: int, pos0: int, visible: np.ndarray) -> np.ndarray:
        """Attention of L queries over the N = pos0 + L cached positions where `visible` [L, N],
        over the keys in blocks with an online softmax (kernels/attention.py): memory stays
        O(L x block) per head at any context length."""
        L = q_nope.shape[0]
        N = pos0 + L
        c = cache.latent(layer)[:N]                                          # [N, r]
        k_rope = cache.k_rope(layer)[:N]                                      # [N, R]
        if L == 1:  # decode over a sparse choice (DSA): only the chosen rows are read
            visible, c, k_rope = seen_rows(visible, c, k_rope)
        q_rope = np.ascontiguousarray(q_rope.transpose(1, 0, 2)) * self.scale  # [H, L, R]
        if 2 * L < self.dn + self.dv:
            out = self._absorbed(q_nope, q_rope, c, k_rope, visible)
        else:
            out = self._expanded(q_nope, q_rope, c, k_rope, visible)
        return linear(np.ascontiguousarray(out), self.o_proj, self.o_bias)

    def _absorbed(self, q_nope, q_rope, c, k_rope, visible) -> np.ndarray:
        """Scores and outputs in latent space; the cache is never expanded (decode)."""
        L, N = q_nope.shape[0], c.shape[0]
        q_lat = np.matmul(q_nope.transpose(1, 0, 2), self.w_uk) * self.scale  # [H, L, r]
        groups = head_groups(self.h, L * N)
        b = key_block(L * (groups[0][1] - groups[0][0]))
        o_lat = np.empty((self.h, L, self.r), np.float32)

        def task(heads):
            h0, h1 = heads
            acc = OnlineSoftmax((h1 - h0, L), self.r)
            for n0 in range(0, N, b):
                n1 = min(N, n0 + b)
                # every head scores the same latent rows: [P L, r] @ [r, b], one GEMM reading
                # them once, where a head at a time is P matrix-vector products at decode
                rows = (h1 - h0) * L
                s = (q_lat[h0:h1].reshape(rows, self.r) @ c[n0:n1].T
                     + q_rope[h0:h1].reshape(rows, q_rope.shape[-1]) @ k_rope[n0:n1].T).reshape(h1 - h0, L, n1 - n0)
                acc.update(mask(s, visible[:, n0:n1]), c[n0:n1])
            o_lat[h0:h1] = acc.result()

        run_tasks(task, groups)
        out = np.matmul(o_lat, self.w_uv_t)                                   # [H, L, Dv]
        return out.transpose(1, 0, 2).reshape(L, self.h * self.dv)

    def _expanded(self, q_nope, q_rope, c, k_rope, visible) -> np.ndarray:
        """Expand the cached latents to per-head k_nope and v a block at a time, as transformers
        does for the whole cache (long prefill: cheaper than absorbing when 2L >= Dn + Dv)."""
        L, N = q_nope.shape[0], c.shape[0]
        q_nope = np.ascontiguousarray(q_nope.transpose(1, 0, 2)) * self.scale  # [H, L, Dn]
        groups = head_groups(self.h, L * N)
        accs = [OnlineSoftmax((h1 - h0, L), self.dv) for h0, h1 in groups]
        b = key_block(L * self.h)
        for n0 in range(0, N, b):
            n1 = min(N, n0 + b)
            kv = linear(np.ascontiguousarray(c[n0:n1]), self.kv_b).reshape(n1 - n0, self.h, self.dn + self.dv)
            k_nope = kv[..., : self.dn].transpose(1, 2, 0)                    # [H, Dn, b]
            v = kv[..., self.dn :].transpose(1, 0, 2)                         # [H, b, Dv]
            vis = visible[:, n0:n1]

            def task(g, n0=n0, n1=n1, k_nope=k_nope, v=v, vis=vis):
                h0, h1 = groups[g]
                s = q_nope[h0:h1] @ k_nope[h0:h1] + q_rope[h0:h1] @ k_rope[n0:n1].T   # [P, L, b]
                accs[g].update(mask(s, vis), v[h0:h1])

            run_tasks(task, list(range(len(groups))))
        out = np.concatenate([a.result() for a in accs], axis=0)            # [H, L, Dv]
        return out.transpose(1, 0, 2).reshape(L, self.h * self.dv)


HEAD_GROUP = 8  # heads per attention task


def head_groups(h: int, work: int) -> list[tuple[int, int]]:
    """Heads in groups of HEAD_GROUP (run_tasks spreads them over the threads) when there is
    enough work to pay for handing it out. Never sized by the thread count, which follows the
    machine's load: the grouping must not be able to change a result's last bits."""
    return split(h, math.ceil(h / HEAD_GROUP)) if work >= 4096 else [(0, h)]


def mask(s: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """s [P, L, b] with -inf where visible [L, b] is False (in place; skipped when all are)."""
    if not visible.all():
        s[:, ~visible] = -np.inf
    return s


class MLAModel(DecoderModel):
    """DecoderModel whose cache is the compressed MLACache (index_dim > 0 adds DSA indexer keys)."""

    def __init__(self, args: MLAArgs, w, layers: list, rope: Rope, index_dim: int = 0):
        super().__init__(args, w, layers, rope)
        self.index_dim = index_dim

    def new_cache(self, max_tokens: int) -> MLACache:
        a = self.args
        return MLACache(len(self.layers), a.kv_lora_rank, a.qk_rope_head_dim, max_tokens, self.index_dim)
