"""OLMoE (q/k RMSNorm over all heads, optional clip_qkv, softmax top-k experts), after
transformers' models/olmoe/modeling_olmoe.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.models import common


@dataclass
class ModelArgs(common.ModelArgs):
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: float | None = None

    def mlp_kind(self, layer: int) -> str:
        return "moe"


def build(config: dict, weights, experts) -> common.DecoderModel:
    args = ModelArgs.from_dict(config)
    rope = common.build_rope(args)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = common.Attention(args, weights, f"{p}.self_attn", rope, qk_norm="full", clip_qkv=args.clip_qkv)
        moe = common.SparseMoE(args, weights, experts, f"{p}.mlp",
                               top_k=args.num_experts_per_tok, norm_topk_prob=args.norm_topk_prob)
        layers.append(common.DecoderLayer(args, attn, moe, p, weights))
    return common.DecoderModel(args, weights, layers, rope)
