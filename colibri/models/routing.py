"""Grouped sigmoid routing of DeepSeek-V3, Kimi-K2 and the GLM MoE families ("noaux_tc"):
sigmoid scores, a per-expert `e_score_correction_bias` that steers the choice but not the
weights, group-limited top-k (`n_group`, `topk_group`), optional renormalisation and
`routed_scaling_factor`; after transformers' DeepseekV3TopkRouter and DeepseekV3MoE.

Shape letters: L tokens, D hidden, E experts, K top-k, G groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.models import common
from colibri.models.common import MLP, layer_index, linear

SCORING_FUNCS = ("sigmoid",)
TOPK_METHODS = ("noaux_tc",)


def check_routing_config(cfg: dict, num_experts: int, n_group: int | None, topk_group: int | None,
                         top_k: int) -> None:
    """Reject routing settings this router does not implement, naming the config field.

    transformers ignores `scoring_func` / `topk_method` and always runs sigmoid + noaux_tc; a
    checkpoint that asks for something else would silently give wrong output there, so here
    it is an error."""
    scoring = cfg.get("scoring_func")
    if scoring is not None and scoring not in SCORING_FUNCS:
        raise ColibriError(f"config field scoring_func={scoring!r} is not implemented (only 'sigmoid')")
    method = cfg.get("topk_method")
    if method is not None and method not in TOPK_METHODS:
        raise ColibriError(f"config field topk_method={method!r} is not implemented (only 'noaux_tc')")
    freq = cfg.get("moe_layer_freq")
    if freq not in (None, 1):
        raise ColibriError(f"config field moe_layer_freq={freq!r} is not implemented (only 1)")
    groups = n_group or 1
    if num_experts % groups or (groups > 1 and num_experts // groups < 2):
        raise ColibriError(f"config field n_group={n_group} does not divide n_routed_experts={num_experts} "
                           "into groups of at least 2 experts")
    if not 1 <= (topk_group or 1) <= groups:
        raise ColibriError(f"config field topk_group={topk_group} must be between 1 and n_group={groups}")
    if not 1 <= top_k <= num_experts:
        raise ColibriError(f"config field num_experts_per_tok={top_k} must be between 1 and {num_experts}")


def grouped_topk(logits: np.ndarray, bias: np.ndarray, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [L, E] -> (weights [L, K], expert ids [L, K]).

    The bias only picks experts; the weights are the plain sigmoid scores of the picked ones."""
    L, E = logits.shape
    scores = (np.float32(1.0) / (np.float32(1.0) + np.exp(-logits.astype(np.float32)))).astype(np.float32)
    choice = scores + bias                                               # [L, E]
    if n_group > 1:
        grouped = choice.reshape(L, n_group, E // n_group)               # [L, G, E/G]
        top2 = np.sort(grouped, axis=-1)[..., -2:]
        group_scores = top2[..., 1] + top2[..., 0]                        # [L, G]
        keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
        group_mask = np.zeros((L, n_group), bool)
        np.put_along_axis(group_mask, keep, True, axis=-1)
        choice = np.where(np.repeat(group_mask, E // n_group, axis=-1), choice, np.float32(-np.inf))
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]          # [L, K]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return (weights * np.float32(scaling)).astype(np.float32), ids


class GroupedMoE(common.RoutedMoE):
    """Routed SwiGLU experts chosen by grouped sigmoid routing, plus always-on shared experts."""

    def __init__(self, w, experts, prefix: str, num_experts: int, top_k: int, n_group: int | None,
                 topk_group: int | None, norm_topk_prob: bool, routed_scaling_factor: float):
        self.router = w.tensor(f"{prefix}.gate.weight")                   # [E, D] float32
        bias_name = f"{prefix}.gate.e_score_correction_bias"
        self.bias = w.tensor(bias_name) if w.has(bias_name) else np.zeros(num_experts, np.float32)
        self.experts, self.prefix = experts, prefix
        self.layer = layer_index(prefix)
        self.top_k, self.n_group, self.topk_group = top_k, n_group or 1, topk_group or 1
        self.norm_topk_prob, self.scaling = norm_topk_prob, routed_scaling_factor
        shared = f"{prefix}.shared_experts"
        self.shared = MLP.from_weights(w, shared) if w.has(f"{shared}.gate_proj.weight") else None

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return grouped_topk(linear(x, self.router), self.bias, self.top_k, self.n_group, self.topk_group,
                            self.norm_topk_prob, self.scaling)

    def shared_out(self, x: np.ndarray) -> np.ndarray | None:
        return None if self.shared is None else self.shared(x)


@dataclass
class GroupedMoEArgs(common.ModelArgs):
    """config.json fields of the grouped-routing MoE families (defaults: transformers' DeepseekV3Config)."""

    n_routed_experts: int = 256
    n_shared_experts: int | None = 1
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int | None = 8
    n_group: int | None = 8
    topk_group: int | None = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool | None = True
    first_k_dense_replace: int | None = 3
    mlp_layer_types: list | None = None
    num_nextn_predict_layers: int | None = 0  # MTP layers: kept by convert, skipped here

    def __post_init__(self):
        super().__post_init__()
        check_routing_config(self.extra, self.n_routed_experts, self.n_group, self.topk_group,
                             self.num_experts_per_tok or 0)
        bad = [t for t in self.mlp_layer_types or [] if t not in ("dense", "sparse")]
        if bad or (self.mlp_layer_types and len(self.mlp_layer_types) < self.num_hidden_layers):
            raise ColibriError(f"config field mlp_layer_types={self.mlp_layer_types!r} is not implemented "
                               "(one 'dense' or 'sparse' per layer)")

    def mlp_kind(self, layer: int) -> str:
        if self.mlp_layer_types:
            return "moe" if self.mlp_layer_types[layer] == "sparse" else "dense"
        return "moe" if layer >= (self.first_k_dense_replace or 0) else "dense"


def build_mlp(args: GroupedMoEArgs, w, experts, layer: int):
    """Layer `layer`'s feed-forward: a dense SwiGLU MLP or the grouped-routing MoE."""
    prefix = f"model.layers.{layer}.mlp"
    if args.mlp_kind(layer) == "dense":
        return MLP.from_weights(w, prefix)
    return GroupedMoE(w, experts, prefix, args.n_routed_experts, args.num_experts_per_tok, args.n_group,
                      args.topk_group, bool(args.norm_topk_prob), args.routed_scaling_factor)
