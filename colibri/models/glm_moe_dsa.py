"""GLM-5 (`glm_moe_dsa`): Multi-head Latent Attention (interleaved rope) plus the DeepSeek
sparse-attention indexer, grouped sigmoid routing plus shared experts; after transformers'
models/glm_moe_dsa/modeling_glm_moe_dsa.py.

The indexer scores every past token for each query with its own small heads,
sum_h w_h * relu(q_h . k_t), and the query attends only to its `index_topk` best tokens; with
no more than `index_topk` tokens in the context that is all of them (dense attention), exactly
as transformers does. "shared" layers reuse the selection of the previous "full" layer. Indexer
keys are cached next to the MLA latent (MLACache index_dim).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.kernels.attention import key_block
from colibri.models import mla
from colibri.models.cache import MLACache
from colibri.models.decoder import build_decoder
from colibri.models.layers import linear
from colibri.models.moe import grouped_moe
from colibri.plan.shapes import default_indexer_types


@dataclass
class ModelArgs(mla.MLAArgs):
    n_group: int | None = 1
    topk_group: int | None = 1
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: list | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.indexer_types is None:
            self.indexer_types = default_indexer_types(self.extra, self.num_hidden_layers)
        types = self.indexer_types[: self.num_hidden_layers]
        if len(types) < self.num_hidden_layers or set(types) - {"full", "shared"} or types[0] != "full":
            raise ColibriError(f"config field indexer_types={self.indexer_types!r} is not implemented "
                               "(one 'full' or 'shared' per layer, the first 'full')")
        kinds = set(self.extra.get("layer_types") or []) - {"indexed_attention"}
        if kinds:
            raise ColibriError(f"config field layer_types has {min(kinds)!r}: only 'indexed_attention' "
                               "(MLA + DSA indexer) is implemented for glm_moe_dsa")
        if self.extra.get("mlp_bias"):
            raise ColibriError("config field mlp_bias=true is not implemented for glm_moe_dsa")
        if not self.q_lora_rank:
            raise ColibriError("config field q_lora_rank must be set for glm_moe_dsa (the indexer reads q_a)")
        if self.index_head_dim < self.qk_rope_head_dim or self.index_topk < 1:
            raise ColibriError(f"config fields index_head_dim={self.index_head_dim} / index_topk="
                               f"{self.index_topk} are not valid for qk_rope_head_dim={self.qk_rope_head_dim}")


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """torch.nn.LayerNorm over the last axis, float32."""
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    var = np.mean((x - mean) ** 2, axis=-1, keepdims=True, dtype=np.float32)
    return (x - mean) / np.sqrt(var + np.float32(eps)) * weight + bias


def index_scores(q: np.ndarray, keys: np.ndarray, weights: np.ndarray, scale: np.float32) -> np.ndarray:
    """The lightning indexer's score of each key for each query, sum_h w_h relu(q_h . k * scale):
    q [L * Hi, Di] (each query's heads in a row), keys [N, Di], weights [L, Hi] -> [L, N]. The
    per-head scores exist a block of keys at a time."""
    L, heads = weights.shape
    index = np.empty((L, keys.shape[0]), np.float32)
    b = key_block(L * heads)
    for n0 in range(0, keys.shape[0], b):
        n1 = min(keys.shape[0], n0 + b)
        scores = np.maximum((q @ keys[n0:n1].T) * scale, np.float32(0.0))                # [L*Hi, b]
        index[:, n0:n1] = np.matmul(weights[:, None, :], scores.reshape(L, heads, -1))[:, 0]
    return index


class Indexer:
    """The lightning indexer: which past tokens each query may attend to."""

    def __init__(self, args: ModelArgs, w, prefix: str):
        self.h, self.d, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.rope_dim = args.qk_rope_head_dim
        self.wq_b, self.wk = w.tensor(f"{prefix}.wq_b.weight"), w.tensor(f"{prefix}.wk.weight")
        self.k_norm_w, self.k_norm_b = w.tensor(f"{prefix}.k_norm.weight"), w.tensor(f"{prefix}.k_norm.bias")
        self.weights_proj = w.tensor(f"{prefix}.weights_proj.weight")      # [Hi, D]
        self.scale = np.float32(self.d ** -0.5)

    def _rotate(self, x, cos, sin):
        """Interleaved rope on the first R dims of each head (the indexer puts rope first)."""
        return np.concatenate([mla.rope_interleaved(x[..., : self.rope_dim], cos, sin), x[..., self.rope_dim :]], -1)

    def select(self, x, q_resid, cache: MLACache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        """-> visible [L, N]: causal and among the query's index_topk highest-scoring tokens."""
        L = x.shape[0]
        N = pos0 + L
        k = layer_norm(linear(x, self.wk), self.k_norm_w, self.k_norm_b, 1e-6)          # [L, Di]
        cache.index_keys(layer)[pos0:N] = self._rotate(k[:, None], cos, sin)[:, 0]
        causal = mla.causal_mask(pos0, L, N)
        if N <= self.topk:  # every past token is selected: dense attention
            return causal
        q = self._rotate(linear(q_resid, self.wq_b).reshape(L, self.h, self.d), cos, sin)  # [L, Hi, Di]
        q = np.ascontiguousarray(q).reshape(L * self.h, self.d)
        keys = cache.index_keys(layer)[:N]                                              # [N, Di]
        weights = linear(x, self.weights_proj) * np.float32(self.h ** -0.5)              # [L, Hi]
        index = np.where(causal, index_scores(q, keys, weights, self.scale), np.float32(-np.inf))  # [L, N]
        top = np.argpartition(-index, self.topk - 1, axis=-1)[:, : self.topk]            # [L, topk]
        chosen = np.zeros((L, N), bool)
        np.put_along_axis(chosen, top, True, axis=-1)
        return chosen & causal


class DSAttention(mla.MLAttention):
    def __init__(self, args: ModelArgs, w, prefix: str, rope, indexer: Indexer | None):
        super().__init__(args, w, prefix, rope, interleave=True)
        self.indexer = indexer  # None: a "shared" layer, reusing the last "full" layer's selection

    def __call__(self, x, cache: MLACache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        q_resid, q_nope, q_rope = self.query(x, cos, sin)
        self.store_latent(x, cache, layer, pos0, cos, sin)
        # The selection is kept on the sequence's cache, by the position of the rows it is for:
        # DecoderModel.forward_rows runs a layer for several rows (several sequences, or drafted
        # positions of one) before the next layer, so "the last full layer's" selection must be
        # the one made for these rows. Older positions' selections are dropped here.
        chosen = cache.selections
        if self.indexer is not None:
            for p in [p for p in chosen if p < cache.length]:
                del chosen[p]
            chosen[pos0] = self.indexer.select(x, q_resid, cache, layer, pos0, cos, sin)
        return self.attend(q_nope, q_rope, cache, layer, pos0, chosen[pos0])


def build(config: dict, weights, experts) -> mla.MLAModel:
    args = ModelArgs.from_dict(config)
    index_dim = args.index_head_dim

    def attention(i, p, rope):
        indexer = Indexer(args, weights, f"{p}.indexer") if args.indexer_types[i] == "full" else None
        return DSAttention(args, weights, p, rope, indexer)

    # The first MTP layer after the decoder layers, as a drafter (models/mtp.py), when present.
    return build_decoder(
        args, weights, attention, lambda i, p: grouped_moe(args, weights, experts, f"{p}.mlp"),
        rope_head_dim=args.qk_rope_head_dim, model=mla.MLAModel, index_dim=index_dim,
        mtp_cache=lambda n: MLACache(1, args.kv_lora_rank, args.qk_rope_head_dim, n, index_dim))
