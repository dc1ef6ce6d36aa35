"""Qwen3-MoE (per-head q/k RMSNorm, softmax top-k experts, dense layers via mlp_only_layers /
decoder_sparse_step), after transformers' models/qwen3_moe/modeling_qwen3_moe.py."""
from __future__ import annotations

from dataclasses import dataclass, field

from colibri.errors import ColibriError
from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.attention import Attention
from colibri.models.decoder import DecoderModel, build_decoder
from colibri.models.moe import SparseMoE


@dataclass
class ModelArgs(BaseModelArgs):
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    moe_intermediate_size: int = 768
    use_sliding_window: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.use_sliding_window:
            raise ColibriError("config field use_sliding_window=true is not implemented")

    def mlp_kind(self, layer: int) -> str:
        sparse = self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        return "moe" if sparse and layer not in self.mlp_only_layers else "dense"


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    return build_decoder(
        args, weights, lambda i, p, rope: Attention(args, weights, p, rope, qk_norm="head"),
        lambda i, p: SparseMoE(args, weights, experts, f"{p}.mlp", top_k=args.num_experts_per_tok,
                               norm_topk_prob=args.norm_topk_prob))
