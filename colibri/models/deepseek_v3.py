"""DeepSeek-V3 (and Kimi-K2, which shares its architecture): Multi-head Latent Attention with a
compressed-latent cache, YaRN rope with mscale, dense first layers, grouped sigmoid routing
plus shared experts; after transformers' models/deepseek_v3/modeling_deepseek_v3.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models import mla
from colibri.models.cache import MLACache
from colibri.models.decoder import build_decoder
from colibri.models.moe import grouped_moe


@dataclass
class ModelArgs(mla.MLAArgs):
    def __post_init__(self):
        super().__post_init__()
        sparse = [k for k in ("index_topk", "index_n_heads", "index_head_dim") if self.extra.get(k) is not None]
        if sparse:
            raise ColibriError(f"config field {sparse[0]} asks for DeepSeek sparse attention, which is not "
                               "implemented for model_type deepseek_v3 (glm_moe_dsa implements it)")
        kinds = set(self.extra.get("layer_types") or []) - {"full_attention"}
        if kinds:
            raise ColibriError(f"config field layer_types has {min(kinds)!r}: only full MLA attention "
                               "is implemented for deepseek_v3")


def build(config: dict, weights, experts) -> mla.MLAModel:
    args = ModelArgs.from_dict(config)
    interleave = args.rope_interleave is not False
    # The first MTP layer after the decoder layers, as a drafter (models/mtp.py), when present.
    return build_decoder(
        args, weights, lambda i, p, rope: mla.MLAttention(args, weights, p, rope, interleave),
        lambda i, p: grouped_moe(args, weights, experts, f"{p}.mlp"),
        rope_head_dim=args.qk_rope_head_dim, model=mla.MLAModel,
        mtp_cache=lambda n: MLACache(1, args.kv_lora_rank, args.qk_rope_head_dim, n))
