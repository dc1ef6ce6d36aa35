"""GLM-4.5 / 4.6 / 4.7 MoE: grouped-query attention with partial rotary (half the head by
default), optional per-head q/k RMSNorm and q/k/v biases; dense first layers; grouped sigmoid
routing with e_score_correction_bias plus shared experts; after transformers'
models/glm4_moe/modeling_glm4_moe.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models.attention import Attention
from colibri.models.cache import KVCache
from colibri.models.decoder import DecoderModel, build_decoder
from colibri.models.moe import GroupedMoEArgs, grouped_moe


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


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    qk_norm = "head" if args.use_qk_norm else None
    # The first MTP layer after the decoder layers, as a drafter (models/mtp.py), when present.
    return build_decoder(
        args, weights, lambda i, p, rope: Attention(args, weights, p, rope, qk_norm=qk_norm),
        lambda i, p: grouped_moe(args, weights, experts, f"{p}.mlp"),
        mtp_cache=lambda n: KVCache(1, args.num_key_value_heads, args.head_dim, n))
