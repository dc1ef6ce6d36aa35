"""Llama (dense decoder), after transformers' models/llama/modeling_llama.py."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.attention import Attention
from colibri.models.decoder import DecoderModel, build_decoder


@dataclass
class ModelArgs(BaseModelArgs):
    mlp_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.mlp_bias:
            raise ColibriError("config field mlp_bias=true is not implemented for llama")


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    return build_decoder(args, weights, lambda i, p, rope: Attention(args, weights, p, rope))
