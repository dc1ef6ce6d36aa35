"""Qwen3-Next (`qwen3_next`): Gated DeltaNet linear attention in three layers of four, gated
full attention in the fourth, softmax top-k experts plus a shared expert behind a sigmoid gate;
after transformers' models/qwen3_next/modeling_qwen3_next.py. The pieces are shared with
Qwen3.5 / 3.6 MoE (models/linear_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.models import mtp
from colibri.models.decoder import build_decoder
from colibri.models.layers import MLP
from colibri.models.linear_attention import GatedAttention, GatedDeltaNet, HybridArgs, HybridModel, UnitOffsetNorms
from colibri.models.moe import SparseMoE
from colibri.models.recurrent import RecurrentCache


@dataclass
class ModelArgs(HybridArgs):
    def __post_init__(self):
        super().__post_init__()
        if self.extra.get("use_sliding_window"):
            raise ColibriError("config field use_sliding_window=true is not implemented")


def build_hybrid(args: HybridArgs, weights, experts, layout: str) -> HybridModel:
    """The hybrid decoder of `args` over `weights` (norms read as 1 + w); `layout`: how the
    linear layers' input projections are stored (GatedDeltaNet). Where the container holds the
    checkpoint's MTP block, it drafts (models/mtp.py, QWEN3_NEXT): its layer, past the decoder
    layers, is gated full attention, with a one-layer cache of its own."""
    w = UnitOffsetNorms(weights)

    def attention(i: int, p: str, rope):
        if i >= args.num_hidden_layers or args.layer_types[i] == "full_attention":
            return GatedAttention(args, w, p, rope)
        return GatedDeltaNet(args, w, p.replace(".self_attn", ".linear_attn"), layout)

    def moe(i: int, p: str) -> SparseMoE:
        return SparseMoE(args, w, experts, f"{p}.mlp", top_k=args.num_experts_per_tok,
                         norm_topk_prob=args.norm_topk_prob, shared=MLP.from_weights(w, f"{p}.mlp.shared_expert"),
                         shared_gate=w.tensor(f"{p}.mlp.shared_expert_gate.weight"))

    return build_decoder(args, w, attention, moe, model=HybridModel, mtp_layout=mtp.QWEN3_NEXT,
                         mtp_cache=lambda n: RecurrentCache([0], [], args.num_key_value_heads, args.head_dim, n,
                                                            (0, 0), (0, 0, 0)))


def build(config: dict, weights, experts) -> HybridModel:
    return build_hybrid(ModelArgs.from_dict(config), weights, experts, "qkvz")
