"""Mixtral (softmax top-k routed SwiGLU experts, always renormalized), after transformers'
models/mixtral/modeling_mixtral.py. The checkpoint names its experts w1 (gate), w3 (up), w2 (down):
`sanitize` maps them onto the shared decoder's gate_proj / up_proj / down_proj, with the rules
in colibri/model_types.py that `colibri convert` applies (the converter imports no model code)."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.model_types import checkpoint_name
from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.attention import Attention
from colibri.models.decoder import DecoderModel, build_decoder
from colibri.models.moe import SparseMoE


@dataclass
class ModelArgs(BaseModelArgs):
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    sliding_window: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window:
            raise ColibriError(f"config field sliding_window={self.sliding_window} is not implemented for mixtral")

    def mlp_kind(self, layer: int) -> str:
        return "moe"


def sanitize(weights: dict) -> dict:
    """Checkpoint tensor names -> the shared decoder's (model_types.CHECKPOINT_NAMES["mixtral"])."""
    return {checkpoint_name("mixtral", name): t for name, t in weights.items()}


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    return build_decoder(
        args, weights, lambda i, p, rope: Attention(args, weights, p, rope),
        lambda i, p: SparseMoE(args, weights, experts, f"{p}.block_sparse_moe", top_k=args.num_experts_per_tok,
                               norm_topk_prob=True))
