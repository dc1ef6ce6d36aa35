"""Kimi Linear (`kimi_linear`): Kimi Delta Attention (KDA) linear attention in most layers, MLA
without rotary embeddings (NoPE) in the others, DeepSeek-style MoE (sigmoid routing with
`e_score_correction_bias`, optional groups, a shared expert, dense first layers); after
transformers' models/kimi_linear/modeling_kimi_linear.py.

A KDA layer is a Gated DeltaNet whose decay is a vector per head and token (one log decay per
key channel) instead of a scalar: q, k, v projections, each through the short causal
convolution with SiLU; the decay g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias) (low-rank,
per channel); beta = sigmoid(b_proj(x)); the delta rule (kernels/delta_rule.py kda_step /
kda_chunked); the output normalized per head and gated by sigmoid(g_b(g_a(x))), then o_proj.
Its state lives in a RecurrentCache (models/recurrent.py) whose attention part holds the MLA
layers' compressed latent (`LatentRecurrentCache`), so slots, snapshots, prefix reuse and row
rollback work as for the other hybrids (HybridModel).

The checkpoint keeps the original names (`block_sparse_moe`, experts' w1 / w3 / w2, the
q/k/v convolutions apart, the gate's f_a / f_b / A_log / dt_bias beside the projections);
`sanitize` maps the MoE onto the shared decoder's names with the rules in
colibri/model_types.py that `colibri convert` applies.

Shape letters: L tokens, D hidden, H linear heads, Dk their head dim, C = 3 H Dk conv channels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.kernels import delta_rule
from colibri.model_types import checkpoint_name
from colibri.models import mla
from colibri.models.decoder import build_decoder
from colibri.models.layers import fuse_rows, linear
from colibri.models.linear_attention import HybridModel, sigmoid, values
from colibri.models.moe import grouped_moe
from colibri.models.recurrent import MAX_SNAPSHOTS, RecurrentCache

LAYER_TYPES = ("linear_attention", "full_attention")

# config.json's names (the original checkpoint's, and what transformers' KimiLinearConfig saves
# through its attribute_map) -> the fields of the grouped-MoE / MLA args.
ALIASES = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
           "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
           "moe_renormalize": "norm_topk_prob", "num_shared_experts": "n_shared_experts",
           "model_max_length": "max_position_embeddings"}
# linear_attn_config's keys transformers reads (anything else there would change the layer)
LINEAR_ATTN_KEYS = {"head_dim": "linear_head_dim", "num_heads": "linear_num_heads",
                    "short_conv_kernel_size": "linear_conv_kernel_dim", "full_attn_layers": None, "kda_layers": None}
# Fields of Kimi checkpoints that transformers' KimiLinear does not run: each must be off.
NOT_IMPLEMENTED = ("mla_use_output_gate", "attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm",
                   "swiglu_limit", "use_kda_lora", "use_qk_norm")


@dataclass
class ModelArgs(mla.MLAArgs):
    """KimiLinearConfig's fields (its defaults where the MLA / grouped-MoE args differ)."""

    rms_norm_eps: float = 1e-5
    q_lora_rank: int | None = None
    n_routed_experts: int | None = 256
    n_shared_experts: int | None = 1
    moe_intermediate_size: int = 1024
    n_group: int | None = 1
    topk_group: int | None = 1
    routed_scaling_factor: float = 2.446
    first_k_dense_replace: int | None = 1  # transformers' default when mlp_layer_types is absent
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    layer_types: list | None = None
    linear_attn_config: dict | None = None

    @classmethod
    def from_dict(cls, cfg: dict):
        renamed = {ALIASES.get(k, k): v for k, v in cfg.items() if k not in ALIASES}
        renamed.update({ALIASES[k]: v for k, v in cfg.items() if k in ALIASES})  # the stored names win
        return super().from_dict(renamed)

    def __post_init__(self):
        super().__post_init__()
        x = self.extra
        sub = dict(self.linear_attn_config or {})
        unknown = sorted(set(sub) - set(LINEAR_ATTN_KEYS))
        if unknown:
            raise ColibriError(f"config field linear_attn_config.{unknown[0]}={sub[unknown[0]]!r} is not implemented "
                               "for kimi_linear")
        for key, name in LINEAR_ATTN_KEYS.items():
            if name is not None and sub.get(key) is not None:
                setattr(self, name, int(sub[key]))
        n = self.num_hidden_layers
        if self.layer_types is None:
            if sub.get("full_attn_layers") is not None and sub.get("kda_layers") is not None:
                types = [None] * n
                for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
                    for i in sub[key]:  # 1-indexed in the checkpoint's config
                        if not 1 <= i <= n:
                            raise ColibriError(f"config field linear_attn_config names layer {i}, the model has {n}")
                        types[i - 1] = kind
                self.layer_types = types
            else:  # KimiLinearConfig's default: full attention in every fourth layer from the fifth
                self.layer_types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
        types = list(self.layer_types[:n])
        if len(types) < n or set(types) - set(LAYER_TYPES):
            raise ColibriError(f"config field layer_types={self.layer_types!r} is not implemented "
                               f"(one of {', '.join(LAYER_TYPES)} per layer)")
        self.layer_types = types
        if x.get("mla_use_nope") is False:
            raise ColibriError("config field mla_use_nope=false is not implemented for kimi_linear (its MLA layers "
                               "run without rotary embeddings, as transformers' KimiLinearAttention)")
        if x.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            raise ColibriError(f"config field moe_router_activation_func={x['moe_router_activation_func']!r} is not "
                               "implemented for kimi_linear (only 'sigmoid')")
        if x.get("use_grouped_topk") is False and (self.n_group or 1) > 1:
            raise ColibriError(f"config field use_grouped_topk=false is not implemented with num_expert_group="
                               f"{self.n_group} (transformers routes by groups)")
        for key in NOT_IMPLEMENTED:
            if x.get(key):
                raise ColibriError(f"config field {key}={x[key]!r} is not implemented for kimi_linear")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ColibriError(f"config field num_key_value_heads={self.num_key_value_heads} is not implemented for "
                               f"kimi_linear: MLA expands one key and value per head "
                               f"(num_attention_heads={self.num_attention_heads})")
        if any(self.mlp_kind(i) == "moe" for i in range(n)):
            if not self.n_routed_experts:
                raise ColibriError("config field num_experts is missing: the config has sparse (MoE) layers")
            if (self.n_shared_experts or 0) < 1:
                raise ColibriError(f"config field num_shared_experts={self.n_shared_experts} is not implemented "
                                   "for kimi_linear (at least one shared expert)")

    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5  # KimiLinearAttention's scaling: no rope, so no YaRN mscale

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]


class LatentRecurrentCache(RecurrentCache):
    """A RecurrentCache whose attention layers keep MLA's compressed latent, laid out as
    MLACache's (one "head": K rows the latent c [r], V rows the rope key [R], then `index_dim`
    values per position that a sparse-attention indexer keeps: GLM-5.3-Flash's)."""

    def __init__(self, attention_layers: list[int], linear_layers: list[int], kv_lora_rank: int, rope_dim: int,
                 max_tokens: int, conv_shape, state_shape, max_snapshots: int = MAX_SNAPSHOTS, index_dim: int = 0):
        super().__init__(attention_layers, linear_layers, 1, kv_lora_rank, max_tokens, conv_shape, state_shape,
                         max_snapshots=max_snapshots, v_dim=rope_dim + index_dim)
        self.rope_dim = rope_dim
        # indexer layer -> [its complete pools' keys, the positions they cover]: derived from
        # index_rows and kept between steps (glm5_next.PooledIndexer.kept_pool_keys); never saved
        self.pool_keys: dict[int, list] = {}

    def _cut(self, n: int) -> int:
        n = super()._cut(n)
        for kept in self.pool_keys.values():  # the rows past n are gone: so are their pools' keys
            kept[1] = min(kept[1], n)
        return n

    def latent(self, layer: int) -> np.ndarray:
        return self.k[self.kv_layer[layer]][0]                       # [capacity, r]

    def k_rope(self, layer: int) -> np.ndarray:
        return self.v[self.kv_layer[layer]][0, :, : self.rope_dim]   # [capacity, R]

    def index_rows(self, layer: int) -> np.ndarray:
        return self.v[self.kv_layer[layer]][0, :, self.rope_dim :]   # [capacity, index_dim]


class KimiDeltaAttention:
    """A KDA layer (transformers' KimiLinearDeltaAttention). The six projections that read the
    layer's input, [q | k | v | f_a | g_a | b], are one fused matrix where their schemes agree."""

    def __init__(self, args: ModelArgs, w, prefix: str):
        self.h, self.dk = args.linear_num_heads, args.linear_head_dim
        self.width = self.h * self.dk
        self.eps = args.rms_norm_eps
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
        parts = [w.tensor(f"{prefix}.{p}.weight") for p in names]
        self.splits = np.cumsum([t.shape[0] for t in parts])[:-1]
        self.proj = fuse_rows(*parts) or tuple(parts)
        if w.has(f"{prefix}.conv1d.weight"):  # transformers' in-memory layout, q|k|v stacked
            conv = values(w.tensor(f"{prefix}.conv1d.weight"))
        else:
            conv = np.concatenate([values(w.tensor(f"{prefix}.{p}_conv1d.weight")) for p in "qkv"])
        self.conv_w = np.ascontiguousarray(conv.reshape(3 * self.width, -1))   # [C, K]
        self.kernel = self.conv_w.shape[1]
        if self.kernel != args.linear_conv_kernel_dim:
            raise ColibriError(f"{prefix}: convolution width {self.kernel}, config field "
                               f"linear_conv_kernel_dim={args.linear_conv_kernel_dim}")
        self.f_b, self.g_b = w.tensor(f"{prefix}.f_b_proj.weight"), w.tensor(f"{prefix}.g_b_proj.weight")
        self.neg_a = -np.exp(values(w.tensor(f"{prefix}.A_log")).reshape(self.h))[None, :, None]  # [1, H, 1]
        self.dt_bias = values(w.tensor(f"{prefix}.dt_bias")).reshape(self.width)
        self.o_norm = values(w.tensor(f"{prefix}.o_norm.weight"))               # [Dk]
        self.o_proj = w.tensor(f"{prefix}.o_proj.weight")

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [K-1, C], delta-rule state [H, Dk, Dk]) of one sequence."""
        return (self.kernel - 1, 3 * self.width), (self.h, self.dk, self.dk)

    def decay(self, f: np.ndarray) -> np.ndarray:
        """Log decay per key channel [L, H, Dk] from the forget gate's pre-activation f [L, H Dk]
        (f_b(f_a(x)) + dt_bias): -exp(A_log) softplus(f) (KimiLinearForgetGate)."""
        return self.neg_a * softplus(f).reshape(f.shape[0], self.h, self.dk)

    def _project(self, x: np.ndarray) -> list[np.ndarray]:
        if isinstance(self.proj, tuple):
            return [linear(x, t) for t in self.proj]
        return np.split(linear(x, self.proj), self.splits, axis=1)

    def __call__(self, x: np.ndarray, cache: RecurrentCache, layer: int, pos0: int, cos=None, sin=None) -> np.ndarray:
        L, H, Dk = x.shape[0], self.h, self.dk
        q, k, v, f_a, g_a, b = self._project(x)
        mixed = delta_rule.causal_conv(np.ascontiguousarray(np.concatenate([q, k, v], axis=1)), cache.conv[layer],
                                       self.conv_w)
        q, k, v = (np.ascontiguousarray(mixed[:, i * self.width:(i + 1) * self.width]).reshape(L, H, Dk)
                   for i in range(3))
        g = np.ascontiguousarray(self.decay(linear(np.ascontiguousarray(f_a), self.f_b) + self.dt_bias), np.float32)
        beta = np.ascontiguousarray(sigmoid(b))
        state = cache.state[layer]
        if L == 1:
            o = delta_rule.kda_step(state, q[0], k[0], v[0], g[0], beta[0])[None]
            cache.keep_row(layer, pos0 + 1)
        else:
            o = delta_rule.kda_chunked(state, q, k, v, g, beta)
        gate = linear(np.ascontiguousarray(g_a), self.g_b).reshape(L * H, Dk)
        o = delta_rule.sigmoid_gated_rms_norm(o.reshape(L * H, Dk), gate, self.o_norm, np.float32(self.eps))
        return linear(o.reshape(L, self.width), self.o_proj)


def softplus(x: np.ndarray) -> np.ndarray:
    """KimiLinearForgetGate's softplus: log(1 + exp(x)) (not log1p), x itself above 20, float32."""
    return np.where(x > 20.0, x, np.log(np.float32(1.0) + np.exp(np.minimum(x, np.float32(20.0))))).astype(np.float32)


class KimiLinearModel(HybridModel):
    """HybridModel over KDA and NoPE MLA layers; its cache keeps the MLA latent (LatentRecurrentCache)."""

    def new_cache(self, max_tokens: int) -> LatentRecurrentCache:
        a = self.args
        linear_layers = a.layers_of("linear_attention")
        conv, state = self.layers[linear_layers[0]].attn.state_shapes() if linear_layers else ((0, 0), (0, 0, 0))
        return LatentRecurrentCache(a.layers_of("full_attention"), linear_layers, a.kv_lora_rank, a.qk_rope_head_dim,
                                    max_tokens, conv, state, max_snapshots=self.max_snapshots)


def sanitize(weights: dict) -> dict:
    """Checkpoint tensor names -> the shared decoder's (model_types.CHECKPOINT_NAMES["kimi_linear"])."""
    return {checkpoint_name("kimi_linear", name): t for name, t in weights.items()}


def build(config: dict, weights, experts) -> KimiLinearModel:
    args = ModelArgs.from_dict(config)

    def attention(i: int, p: str, rope):
        if args.layer_types[i] == "full_attention":
            return mla.MLAttention(args, weights, p, None, False)  # NoPE: no rotation
        return KimiDeltaAttention(args, weights, p)

    return build_decoder(args, weights, attention, lambda i, p: grouped_moe(args, weights, experts, f"{p}.mlp"),
                         rope_head_dim=args.qk_rope_head_dim, model=KimiLinearModel)

