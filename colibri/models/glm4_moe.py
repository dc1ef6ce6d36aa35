"""GLM-4.5 / 4.6 / 4.7 MoE: grouped-query attention with partial rotary (half the head by
default), optional per-head q/k RMSNorm and q/k/v biases; dense first layers; grouped sigmoid
routing with e_score_correction_bias plus shared experts; after transformers'
models/glm4_moe/modeling_glm4_moe.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models import common, mtp
from colibri.models.routing import GroupedMoEArgs, build_mlp


@dataclass
class ModelArgs(GroupedMoEArgs):
    n_group: int | None = 1
    topk_group: int | None = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int | None = 1
    use_qk_norm: bool = False
    partial_rotary_factor: float = 0.5  # Glm4MoeConfig's default when the config omits it

    def __post_init__(self):
        super().__post_init__()
        window = self.extra.get("sliding_window")
        if window is not None or self.extra.get("use_sliding_window"):
            raise ColibriError(f"config field sliding_window={window!r} is not implemented for glm4_moe")
        kinds = set(self.extra.get("layer_types") or []) - {"full_attention"}
        if kinds:
            raise ColibriError(f"config field layer_types has {min(kinds)!r}: only full attention "
                               "is implemented for glm4_moe")


def build(config: dict, weights, experts) -> common.DecoderModel:
    args = ModelArgs.from_dict(config)
    rope = common.build_rope(args)

    def layer(i: int) -> common.DecoderLayer:
        p = f"model.layers.{i}"
        attn = common.Attention(args, weights, f"{p}.self_attn", rope, qk_norm="head" if args.use_qk_norm else None)
        return common.DecoderLayer(args, attn, build_mlp(args, weights, experts, i), p, weights)

    model = common.DecoderModel(args, weights, [layer(i) for i in range(args.num_hidden_layers)], rope)
    # The first MTP layer after the decoder layers, as a drafter (models/mtp.py), when present.
    mtp.attach(model, args, weights, layer,
               lambda n: common.KVCache(1, args.num_key_value_heads, args.head_dim, n))
    return model
