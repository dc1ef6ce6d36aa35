"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`, the text model `qwen3_5_moe_text`): Qwen3-Next's hybrid
of Gated DeltaNet and gated full attention (models/linear_attention.py) with the linear
layers' input projections stored apart (in_proj_qkv / z / b / a), every layer a MoE block with
normalized top-k weights and a gated shared expert; after transformers'
models/qwen3_5_moe/modeling_qwen3_5_moe.py.

The published checkpoints are Qwen3_5MoeForConditionalGeneration: a vision tower beside the
language model. `colibri convert` takes its text_config and the language model's tensors and
skips the vision tower, saying so (io/convert.py, model_types.MULTIMODAL). Text positions are
the same on the three multimodal rope axes, so the interleaved M-RoPE is plain partial rope.
"""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models.linear_attention import HybridArgs, HybridModel
from colibri.models.qwen3_next import build_hybrid


@dataclass
class ModelArgs(HybridArgs):
    num_experts: int = 256
    num_experts_per_tok: int = 8

    def __post_init__(self):
        super().__post_init__()
        self.norm_topk_prob = True  # Qwen3_5MoeTopKRouter always renormalizes the top-k weights
        if not self.num_experts:
            raise ColibriError("config field num_experts=0 is not implemented for qwen3_5_moe (every layer routes)")
        rope = self.rope_params()
        if rope.get("rope_type") not in ("default", None):
            raise ColibriError(f"config field rope_parameters.rope_type={rope['rope_type']!r} is not implemented "
                               "for qwen3_5_moe (only the default rope)")

    def mlp_kind(self, layer: int) -> str:
        return "moe"  # every decoder layer is a sparse MoE block


def build(config: dict, weights, experts) -> HybridModel:
    return build_hybrid(ModelArgs.from_dict(config), weights, experts, "split")
