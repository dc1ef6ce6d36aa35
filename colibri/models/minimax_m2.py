"""MiniMax-M2 / M2.1 / M2.5: grouped-query attention with q/k RMSNorm over all heads (one weight of
H * Dh, applied before the heads split) and partial rotary (`rotary_dim` of each head); every layer
routed SwiGLU experts chosen by sigmoid scores plus `e_score_correction_bias` (the bias picks,
the plain scores weigh, always renormalised; no groups, no shared expert); after transformers'
models/minimax_m2/modeling_minimax_m2.py. The checkpoint keeps Mixtral's `block_sparse_moe` /
w1 w3 w2 names; `sanitize` maps them onto the shared decoder's with the rules in
colibri/model_types.py that `colibri convert` applies."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.model_types import checkpoint_name
from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.attention import Attention
from colibri.models.decoder import DecoderModel, build_decoder
from colibri.models.moe import GroupedMoE, check_routing_config


@dataclass
class ModelArgs(BaseModelArgs):
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    rotary_dim: int | None = None  # the checkpoint's name for the rotated width (transformers: partial_rotary_factor)

    def __post_init__(self):
        super().__post_init__()
        if self.rotary_dim is not None and "partial_rotary_factor" not in (self.rope_parameters or {}):
            self.partial_rotary_factor = self.rotary_dim / self.head_dim
        check_routing_config(self.extra, self.num_local_experts, None, None, self.num_experts_per_tok)
        x = self.extra
        # What transformers' MiniMaxM2 does not run either: lightning attention layers (MiniMax-01's
        # attn_type 0), a shared expert, sliding windows, q/k norms per head or none.
        if any(t != 1 for t in x.get("attn_type_list") or []):
            raise ColibriError("config field attn_type_list asks for lightning attention layers (type 0), "
                               "which are not implemented for minimax_m2 (only full attention, type 1)")
        for key, off in (("shared_intermediate_size", 0), ("sliding_window", None)):
            if x.get(key) not in (off, None):
                raise ColibriError(f"config field {key}={x[key]!r} is not implemented for minimax_m2")
        if x.get("qk_norm_type", "per_layer") != "per_layer" or x.get("use_qk_norm") is False:
            field = "qk_norm_type" if "qk_norm_type" in x and x["qk_norm_type"] != "per_layer" else "use_qk_norm"
            raise ColibriError(f"config field {field}={x[field]!r} is not implemented for minimax_m2 "
                               "(only q/k RMSNorm over all heads, 'per_layer')")

    def mlp_kind(self, layer: int) -> str:
        return "moe"


def sanitize(weights: dict) -> dict:
    """Checkpoint tensor names -> the shared decoder's (model_types.CHECKPOINT_NAMES["minimax_m2"])."""
    return {checkpoint_name("minimax_m2", name): t for name, t in weights.items()}


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    return build_decoder(
        args, weights, lambda i, p, rope: Attention(args, weights, p, rope, qk_norm="full"),
        lambda i, p: GroupedMoE(weights, experts, f"{p}.mlp", args.num_local_experts, args.num_experts_per_tok,
                                n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0))
