"""OLMoE (q/k RMSNorm over all heads, optional clip_qkv, softmax top-k experts), after
transformers' models/olmoe/modeling_olmoe.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.attention import Attention
from colibri.models.decoder import DecoderModel, build_decoder
from colibri.models.moe import SparseMoE


@dataclass
class ModelArgs(BaseModelArgs):
    num_experts: int = 64
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    clip_qkv: float | None = None

    def mlp_kind(self, layer: int) -> str:
        return "moe"


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    return build_decoder(
        args, weights, lambda i, p, rope: Attention(args, weights, p, rope, qk_norm="full", clip_qkv=args.clip_qkv),
        lambda i, p: SparseMoE(args, weights, experts, f"{p}.mlp", top_k=args.num_experts_per_tok,
                               norm_topk_prob=args.norm_topk_prob))
