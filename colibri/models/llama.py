"""Llama (dense decoder), after transformers' models/llama/modeling_llama.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models import common


@dataclass
class ModelArgs(common.ModelArgs):
    mlp_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_bias:
            raise ColibriError("config field mlp_bias=true is not implemented for llama")


def build(config: dict, weights, experts) -> common.DecoderModel:
    args = ModelArgs.from_dict(config)
    rope = common.build_rope(args)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = common.Attention(args, weights, f"{p}.self_attn", rope)
        layers.append(common.DecoderLayer(args, attn, common.MLP.from_weights(weights, f"{p}.mlp"), p, weights))
    return common.DecoderModel(args, weights, layers, rope)
