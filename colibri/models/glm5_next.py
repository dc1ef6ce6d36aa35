"""GLM-5.3-Flash (`glm5_next`; its language model, `glm5_next_text`): a hybrid of Kimi Delta
Attention and GLM-5's sparse MLA, on DeepSeek V4's hyper-connections; after transformers'
models/glm5_next/modeling_glm5_next.py.

Where each part comes from, and what is new here:

- Three layers in four are KDA linear attention (models/kimi_linear.KimiDeltaAttention: short
  convolutions, the delta rule with a decay per key channel, the sigmoid-gated output norm), with
  one change, the "safe" forget gate: the log decay is `linear_lower_bound * sigmoid(exp(A_log) *
  f)` (in (lower_bound, 0)) instead of -exp(A_log) softplus(f), unless the bound is null.
- The others are MLA without rotary embeddings (NoPE: qk_rope_head_dim is 0) whose queries see
  only the keys a DSA indexer picks (`PooledIndexer`). Unlike GLM-5's indexer it scores pools of
  `index_kpool` consecutive tokens, each pool's key a softmax-gated mix of its tokens' indexer
  keys (a learned gate projection plus a per-offset bias); a query keeps its index_topk /
  index_kpool best complete pools, and always the tokens of its own incomplete pool. Layers
  marked "shared" in `indexer_types` reuse the previous layer's choice.
- The residual is `hc_mult` streams mixed around each block (models/hyper_connections.py); the
  last layer's streams are averaged (not mixed, as DeepSeek V4 does) before the final norm.
- Every SwiGLU is clipped at `swiglu_limit` (the dense first layers, the routed and the shared
  experts); routing is DeepSeek-V3's grouped sigmoid top-k with its correction bias.

A sequence's cache (LatentRecurrentCache) holds the KDA layers' states and, per MLA layer and
position, the latent plus the indexer's key and gate row, so slots, snapshots, prefix reuse and
draft rollback work as for the other hybrids (models/recurrent.py). Rows of a batch or of a
draft run one at a time through the whole model (the streams do not fit the shared decoder's
layer-by-layer row pass); each row is the same bits as decoding it alone.

The multimodal checkpoint (Glm5NextForConditionalGeneration) is converted to its language model:
the vision tower is skipped, saying so (model_types.WRAPPERS).

Shape letters: L tokens, N cached positions, S streams, D hidden, H linear heads, Dk their
head dim, Hi / Di indexer heads and head dim, P pool size, r kv_lora_rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor
from colibri.kernels import embedding, ops
from colibri.kernels.moe import ExpertActivation
from colibri.model_types import checkpoint_name
from colibri.models import mla
from colibri.models.decoder import in_activation_mode
from colibri.models.glm_moe_dsa import index_scores, layer_norm
from colibri.models.hyper_connections import HyperConnection, merge
from colibri.models.kimi_linear import KimiDeltaAttention, LatentRecurrentCache
from colibri.models.layers import clipped_swiglu, fuse_rows, linear, rms_norm, sigmoid
from colibri.models.linear_attention import HybridModel, values
from colibri.models.moe import GroupedMoE
from colibri.plan.shapes import default_indexer_types
from colibri.profile import PHASES, clock

LINEAR, INDEXED = "linear_attention", "indexed_attention"
# linear_attn_config's keys Glm5NextTextConfig reads, and the fields they set
LINEAR_ATTN_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                    "short_conv_kernel_size": "linear_conv_kernel_dim", "gate_lower_bound": "linear_lower_bound",
                    "safe_gate": None}


@dataclass
class ModelArgs(mla.MLAArgs):
    """Glm5NextTextConfig's fields (its defaults where the MLA / grouped-MoE args differ)."""

    rms_norm_eps: float = 1e-5
    n_routed_experts: int = 288
    n_group: int | None = 1
    topk_group: int | None = 1
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 256
    v_head_dim: int = 256
    layer_types: list | None = None
    indexer_types: list | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    linear_attn_config: dict | None = None
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:  # Glm5NextTextConfig's default: three dense layers first
            self.mlp_layer_types = ["dense"] * min(3, n) + ["sparse"] * (n - min(3, n))
        super().__post_init__()
        sub = dict(self.linear_attn_config or {})
        unknown = sorted(set(sub) - set(LINEAR_ATTN_KEYS))
        if unknown:
            raise ColibriError(f"config field linear_attn_config.{unknown[0]}={sub[unknown[0]]!r} is not implemented "
                               "for glm5_next")
        for key, name in LINEAR_ATTN_KEYS.items():
            if name is not None and key in sub:
                setattr(self, name, sub[key])
        if self.linear_attn_config is not None and sub.get("safe_gate", True) and self.linear_lower_bound is None:
            self.linear_lower_bound = -5.0  # as Glm5NextTextConfig: a safe gate without a bound gets -5
        if self.layer_types is None:  # the default: every fourth layer is MLA
            self.layer_types = [INDEXED if i % 4 == 3 else LINEAR for i in range(n)]
        types = [INDEXED if t == "full_attention" else t for t in self.layer_types[:n]]
        if len(types) < n or set(types) - {LINEAR, INDEXED}:
            raise ColibriError(f"config field layer_types={self.layer_types!r} is not implemented "
                               f"(one of {LINEAR!r}, {INDEXED!r} per layer)")
        self.layer_types = types
        if self.indexer_types is None:
            self.indexer_types = default_indexer_types(self.extra, n)
        self._check(n)

    def _check(self, n: int) -> None:
        def bad(field: str, why: str):
            raise ColibriError(f"config field {field}={getattr(self, field, self.extra.get(field))!r} is not "
                               f"implemented for glm5_next: {why}")

        kinds = self.indexer_types[:n]
        if len(kinds) < n or set(kinds) - {"full", "shared"}:
            bad("indexer_types", "one 'full' or 'shared' per layer")
        for i in self.layers_of(INDEXED):
            # transformers hands a layer's choice only to the layer right after it
            if kinds[i] == "shared" and (i == 0 or self.layer_types[i - 1] != INDEXED or kinds[i - 1] != "full"):
                bad("indexer_types", f"layer {i} shares the choice of a layer that makes none (the layer before a "
                                     "'shared' MLA layer must be a 'full' MLA layer)")
        if self.qk_rope_head_dim:
            bad("qk_rope_head_dim", "its MLA layers run without rotary embeddings (0)")
        if not self.q_lora_rank:
            bad("q_lora_rank", "the indexer reads the low-rank query")
        if self.num_key_value_heads != self.num_attention_heads:
            bad("num_key_value_heads", f"MLA expands one key and value per head ({self.num_attention_heads})")
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            bad("index_topk", f"a multiple of index_kpool={self.index_kpool} is needed")
        if not self.index_kpool_always_select_tail:
            bad("index_kpool_always_select_tail", "a query always sees its own incomplete pool")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            bad("hc_mult", "at least one stream and one Sinkhorn iteration")
        if any(self.mlp_kind(i) == "moe" for i in range(n)) and (self.n_shared_experts or 0) != 1:
            bad("n_shared_experts", "one shared expert")
        for field in ("mlp_bias", "use_sliding_window"):
            if self.extra.get(field):
                bad(field, "off")

    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5  # no rope, so no YaRN mscale

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @property
    def index_width(self) -> int:
        """Values per position an indexer keeps: its key and its pool-gate row."""
        return 2 * self.index_head_dim


# ----------------------------------------------------------------------------- linear attention
class SafeGateDeltaAttention(KimiDeltaAttention):
    """KDA with GLM-5.3-Flash's forget gate (Glm5NextTextForgetGate)."""

    def __init__(self, args: ModelArgs, w, prefix: str):
        super().__init__(args, w, prefix)
        self.lower_bound = args.linear_lower_bound
        self.rate = np.exp(values(w.tensor(f"{prefix}.A_log")).reshape(self.h))[None, :, None]  # [1, H, 1]

    def decay(self, f: np.ndarray) -> np.ndarray:
        if self.lower_bound is None:
            return super().decay(f)
        return np.float32(self.lower_bound) * sigmoid(self.rate * f.reshape(f.shape[0], self.h, self.dk))


# ----------------------------------------------------------------------------- sparse MLA
def _project(x: np.ndarray, w) -> np.ndarray:
    """x @ w.T for a matrix kept quantized (a QTensor) or as float32 values."""
    return linear(x, w) if isinstance(w, QTensor) else x @ values(w).T


class PooledIndexer:
    """Which cached tokens each query attends to (Glm5NextTextIndexer). Each position keeps its
    indexer key k_t = LayerNorm(wk x_t) [Di] and gate row g_t = G x_t [Di]; a complete pool j
    (tokens jP .. jP + P - 1) has the key sum_t softmax_t(g_t + ape[t - jP]) * k_t (the softmax
    over the pool's tokens, per channel). A query scores pool j as sum_h w_h relu(q_h . key_j /
    sqrt(Di)) and keeps its best index_topk / P pools among those that end at or before it, plus
    its own pool's tokens so far."""

    def __init__(self, args: ModelArgs, w, prefix: str):
        self.h, self.d, self.pool = args.index_n_heads, args.index_head_dim, args.index_kpool
        self.pools = args.index_topk // args.index_kpool
        self.wq_b, self.wk = w.tensor(f"{prefix}.wq_b.weight"), w.tensor(f"{prefix}.wk.weight")
        self.k_norm_w, self.k_norm_b = w.tensor(f"{prefix}.k_norm.weight"), w.tensor(f"{prefix}.k_norm.bias")
        self.weights_proj = w.tensor(f"{prefix}.weights_proj.weight")                  # [Hi, D]
        self.ape = values(w.tensor(f"{prefix}.index_kpool_compress_ape")).reshape(self.pool, self.d)  # [P, Di]
        self.gate = w.tensor(f"{prefix}.index_kpool_compress_gate")                    # [Di, D]
        self.scale = np.float32(self.d ** -0.5)

    def store(self, x: np.ndarray, rows: np.ndarray, pos0: int) -> None:
        """Keep the key and gate row of positions pos0 .. pos0 + L in `rows` [capacity, 2 Di]."""
        k = layer_norm(linear(x, self.wk), self.k_norm_w, self.k_norm_b, 1e-6)
        rows[pos0:pos0 + x.shape[0]] = np.concatenate([k, _project(x, self.gate)], axis=1)

    def pool_keys(self, rows: np.ndarray, n_pools: int) -> np.ndarray:
        """The first n_pools complete pools' keys [n_pools, Di]."""
        grouped = rows[: n_pools * self.pool].reshape(n_pools, self.pool, 2 * self.d)
        logits = grouped[..., self.d:] + self.ape                                        # [n, P, Di]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return np.sum(e / e.sum(axis=1, keepdims=True) * grouped[..., :self.d], axis=1, dtype=np.float32)

    def kept_pool_keys(self, rows: np.ndarray, n_pools: int, pos0: int, kept: list) -> np.ndarray:
        """pool_keys(rows, n_pools), computing only the pools `kept` = [keys, positions they
        cover] does not hold (the cache's pool_keys entry, which this updates): a pool's key
        depends on its own rows only, so a decode step adds the one pool that just completed
        instead of recomputing every pool (at 32k tokens, 2048 pools: ~48 ms a layer). Rows from
        pos0 on were just written, so keys reaching there are recomputed whatever `kept` says."""
        keys, covered = kept
        done = min(covered, pos0) // self.pool
        if keys.shape[0] < n_pools:
            grown = np.empty((max(n_pools, 2 * keys.shape[0]), self.d), np.float32)
            grown[:done] = keys[:done]
            keys = grown
        if done < n_pools:
            keys[done:n_pools] = self.pool_keys(rows[done * self.pool:], n_pools - done)
        kept[:] = [keys, n_pools * self.pool]
        return keys[:n_pools]

    def select(self, x: np.ndarray, q_resid: np.ndarray, rows: np.ndarray, pos0: int,
               kept: list | None = None) -> np.ndarray:
        """-> visible [L, N]: the chosen pools' tokens and the query's own pool up to itself
        (kept: the cache's pool keys for this layer, kept_pool_keys)."""
        L, P = x.shape[0], self.pool
        N = pos0 + L
        causal = mla.causal_mask(pos0, L, N)
        if N // P <= self.pools:  # every complete pool is chosen: all of the past is visible
            return causal
        n_pools = N // P
        keys = (self.pool_keys(rows, n_pools) if kept is None                             # [n, Di]
                else self.kept_pool_keys(rows, n_pools, pos0, kept))
        q = np.ascontiguousarray(linear(q_resid, self.wq_b)).reshape(L * self.h, self.d)
        weights = linear(x, self.weights_proj) * np.float32(self.h ** -0.5)               # [L, Hi]
        index = index_scores(q, keys, weights, self.scale)                               # [L, n]
        positions = pos0 + np.arange(L)
        ends = np.arange(n_pools) * P + P - 1
        candidate = ends[None, :] <= positions[:, None]                                 # [L, n]
        index = np.where(candidate, index, np.float32(-np.inf))
        # the best pools first; among equal scores the earlier pool (a stable sort)
        best = np.argsort(-index, axis=-1, kind="stable")[:, : self.pools]
        chosen = np.zeros((L, n_pools), bool)
        np.put_along_axis(chosen, best, True, axis=-1)
        chosen &= candidate
        visible = np.zeros((L, N), bool)
        visible[:, : n_pools * P] = np.repeat(chosen, P, axis=1)
        own = positions + 1 - (positions + 1) % P  # the start of the query's incomplete pool (itself: none)
        visible |= (np.arange(N)[None, :] >= own[:, None]) & causal
        return visible


class SparseMLA(mla.MLAttention):
    """NoPE MLA over the tokens the indexer picks (Glm5NextTextAttention); a layer without its own
    indexer ("shared") is handed the previous layer's choice."""

    def __init__(self, args: ModelArgs, w, prefix: str, indexer: PooledIndexer | None):
        super().__init__(args, w, prefix, None, False)
        self.indexer = indexer

    def __call__(self, x: np.ndarray, cache: LatentRecurrentCache, layer: int, pos0: int,
                 shared: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """-> (the layer's output [L, D], the visible tokens [L, N] it used)."""
        q_resid, q_nope, q_rope = self.query(x, None, None)
        self.store_latent(x, cache, layer, pos0, None, None)
        if self.indexer is None:
            visible = shared
        else:
            rows = cache.index_rows(layer)
            self.indexer.store(x, rows, pos0)
            kept = cache.pool_keys.setdefault(layer, [np.empty((0, self.indexer.d), np.float32), 0])
            visible = self.indexer.select(x, q_resid, rows, pos0, kept)
        return self.attend(q_nope, q_rope, cache, layer, pos0, visible), visible


# ----------------------------------------------------------------------------- feed-forward
class ClippedMLP:
    """down(clipped_swiglu(gate(x), up(x))): the dense layers' MLP and the shared expert."""

    def __init__(self, w, prefix: str, limit: float):
        self.gate, self.up, self.down = (w.tensor(f"{prefix}.{p}.weight")
                                         for p in ("gate_proj", "up_proj", "down_proj"))
        self.gate_up = fuse_rows(self.gate, self.up)
        self.limit = limit

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up is None:
            gate, up = linear(x, self.gate), linear(x, self.up)
        else:
            gate, up = np.split(linear(x, self.gate_up), [self.gate.shape[0]], axis=1)
        return linear(clipped_swiglu(gate, up, self.limit), self.down)


class ClippedGroupedMoE(GroupedMoE):
    """Grouped sigmoid routing (GroupedMoE) over clipped-SwiGLU experts plus a clipped shared
    expert (Glm5NextTextMoE). The experts come from the expert source as any family's (RAM,
    disk, prefetch); a decode token's run in the fused MoE kernel with the clip (`activation`),
    several tokens' over the matrix kernels (`expert`)."""

    def __init__(self, args: ModelArgs, w, experts, prefix: str):
        if getattr(experts, "compute", None) is not None:
            raise ColibriError("glm5_next: experts computed on other machines (colibri/cluster) run the unclipped "
                               "SwiGLU; its clipped experts are not implemented there yet")
        super().__init__(w, experts, prefix, args.n_routed_experts, args.num_experts_per_tok, args.n_group,
                         args.topk_group, bool(args.norm_topk_prob), args.routed_scaling_factor)
        self.limit = args.swiglu_limit
        self.activation = ExpertActivation(ops.CLIPPED_SILU, limit=self.limit)
        self.shared = ClippedMLP(w, f"{prefix}.shared_experts", self.limit)

    def expert(self, x: np.ndarray, e: int, ew: dict) -> np.ndarray:
        return linear(clipped_swiglu(linear(x, ew["gate_proj"]), linear(x, ew["up_proj"]), self.limit),
                      ew["down_proj"])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        t0 = clock() if PHASES.on else 0.0
        return self.over_matrices(x, self.route(x), t0)


# ----------------------------------------------------------------------------- layers and model
class Glm5Layer:
    """mHC around attention (KDA or sparse MLA), then mHC around the MLP (Glm5NextTextDecoderLayer)."""

    def __init__(self, args: ModelArgs, w, experts, layer: int):
        p = f"model.layers.{layer}"
        self.linear = args.layer_types[layer] == LINEAR
        if self.linear:
            self.attn = SafeGateDeltaAttention(args, w, f"{p}.self_attn")
        else:
            full = args.indexer_types[layer] == "full"
            self.attn = SparseMLA(args, w, f"{p}.self_attn",
                                  PooledIndexer(args, w, f"{p}.self_attn.indexer") if full else None)
        if args.mlp_kind(layer) == "moe":
            self.mlp = ClippedGroupedMoE(args, w, experts, f"{p}.mlp")
        else:
            self.mlp = ClippedMLP(w, f"{p}.mlp", args.swiglu_limit)
        self.input_norm = w.tensor(f"{p}.input_layernorm.weight")
        self.post_norm = w.tensor(f"{p}.post_attention_layernorm.weight")
        self.attn_hc, self.ffn_hc = HyperConnection(args, w, f"{p}.attn_hc"), HyperConnection(args, w, f"{p}.ffn_hc")
        self.eps, self.index = args.rms_norm_eps, layer

    def __call__(self, streams: np.ndarray, cache: LatentRecurrentCache, pos0: int,
                 before: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """streams [L, S, D] -> (the streams after this layer, the indexer choice a next "shared"
        layer may reuse: this layer's own, if it made one). `before`: the previous layer's."""
        t0 = clock() if PHASES.on else 0.0
        post, comb, x = self.attn_hc(streams)
        x = rms_norm(x, self.input_norm, self.eps)
        chosen = None
        if self.linear:
            out = self.attn(x, cache, self.index, pos0)
        else:
            out, chosen = self.attn(x, cache, self.index, pos0, before)
            chosen = chosen if self.attn.indexer is not None else None
        streams = merge(streams, out, post, comb)
        if t0:
            PHASES.add("attention", self.index, t0)
            t0 = clock()
        post, comb, x = self.ffn_hc(streams)
        streams = merge(streams, self.mlp(rms_norm(x, self.post_norm, self.eps)), post, comb)
        if t0:
            PHASES.add("ffn", self.index, t0)
        return streams, chosen


class Glm5Model(HybridModel):
    """Embedding -> hc_mult streams -> layers -> streams averaged -> norm -> lm_head, over one
    LatentRecurrentCache per sequence (HybridModel keeps its snapshots and rollbacks)."""

    def __init__(self, args: ModelArgs, w, experts):
        super().__init__(args, w, [Glm5Layer(args, w, experts, i) for i in range(args.num_hidden_layers)], None)

    def new_cache(self, max_tokens: int) -> LatentRecurrentCache:
        a = self.args
        linear_layers = a.layers_of(LINEAR)
        conv, state = self.layers[linear_layers[0]].attn.state_shapes() if linear_layers else ((0, 0), (0, 0, 0))
        return LatentRecurrentCache(a.layers_of(INDEXED), linear_layers, a.kv_lora_rank, 0, max_tokens, conv, state,
                                    max_snapshots=self.max_snapshots, index_dim=a.index_width)

    def hidden(self, ids: np.ndarray, cache: LatentRecurrentCache, all_logits: bool = False) -> np.ndarray:
        """The final hidden states (streams averaged, normed) [L or 1, D] of tokens `ids` after
        the cache's contents."""
        ids = np.asarray(ids, dtype=np.int64)
        L, pos0 = ids.shape[0], cache.length
        cache.reserve(pos0 + L)
        t0 = clock() if PHASES.on else 0.0
        x = embedding(self.embed, ids)                                                   # [L, D]
        streams = np.ascontiguousarray(np.broadcast_to(x[:, None, :], (L, self.args.hc_mult, x.shape[1])))
        if t0:
            PHASES.add("embed", -1, t0)
        chosen = None
        for layer in self.layers:
            streams, chosen = layer(streams, cache, pos0, chosen)
        cache.length = pos0 + L
        if not all_logits:
            streams = streams[-1:]
        return rms_norm(np.mean(streams, axis=1, dtype=np.float32), self.norm, self.args.rms_norm_eps)

    @in_activation_mode
    def _logits(self, ids, cache: LatentRecurrentCache, all_logits: bool) -> np.ndarray:
        h = self.hidden(ids, cache, all_logits)
        t0 = clock() if PHASES.on else 0.0
        logits = linear(h, self.lm_head)
        if t0:
            PHASES.add("head", -1, t0)
        return logits

    @in_activation_mode
    def _rows_logits(self, ids, caches: list) -> np.ndarray:
        """Each row decoded alone, in row order (rows of one cache are its next positions): the
        same bits as decoding them one by one, which is what batching and drafts promise."""
        self.rows_hidden = h = np.concatenate([self.hidden(np.asarray([t]), c) for t, c in zip(ids, caches)])
        return np.concatenate([linear(h[r:r + 1], self.lm_head) for r in range(h.shape[0])])


def sanitize(weights: dict) -> dict:
    """Checkpoint tensor names -> the decoder's (model_types.CHECKPOINT_NAMES["glm5_next"])."""
    return {checkpoint_name("glm5_next", name): t for name, t in weights.items()}


def build(config: dict, weights, experts) -> Glm5Model:
    return Glm5Model(ModelArgs.from_dict(config), weights, experts)

