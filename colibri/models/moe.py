"""Mixture-of-experts blocks: routing (softmax top-k; DeepSeek-V3's grouped sigmoid top-k with
`e_score_correction_bias`), the routed SwiGLU experts over an expert source, shared experts.
Every tier hands back each expert's output and the sum runs in ascending expert id, so where
an expert lives never changes the tokens (docs/design.md section 7).

Shape letters: L tokens, D hidden, E experts, K top-k, G groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from numba import get_num_threads

from colibri.errors import ColibriError
from colibri.kernels import decode, idot, ops
from colibri.kernels import moe as moe_kernels
from colibri.kernels.moe import PLAIN, ExpertActivation
from colibri.kernels.cpu import int4_weight
from colibri.formats.qtensor import QTensor
from colibri.models.args import ModelArgs
from colibri.models.layers import MLP, linear, rms_norm
from colibri.profile import PHASES, clock


def swiglu_expert(x: np.ndarray, e: dict[str, QTensor]) -> np.ndarray:
    if x.shape[0] == 1:  # decode: one compiled call when the weights are int4 (same math)
        ws = [int4_weight(e[p]) for p in ("gate_proj", "up_proj", "down_proj")]
        if all(w is not None for w in ws):
            return decode.swiglu(x[0], *ws, get_num_threads(), idot.marker(idot.current()))[None, :]
    return linear(ops.silu_gate(linear(x, e["gate_proj"]), linear(x, e["up_proj"])), e["down_proj"])


def softmax_topk(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [L, E] -> (weights [L, K], expert ids [L, K]), highest probability first
    (colibri.kernels.ops.softmax_topk)."""
    return ops.softmax_topk(np.ascontiguousarray(logits, dtype=np.float32), k, normalize)


class RoutedMoE:
    """What every MoE block shares: route, run the routed experts, add the shared expert(s).
    Subclasses set router-specific fields and define `route(x) -> (weights [L, K], ids [L, K])`
    and `shared_out(x)` (None: no shared expert). A family whose experts are not the plain
    SwiGLU sets `activation` (what the fused decode kernel runs) and defines
    `expert(x_rows, e, matrices)` (the same over the matrix kernels), and calls over_matrices."""

    experts: object
    prefix: str
    layer: int
    activation: ExpertActivation = PLAIN

    def shared_out(self, x: np.ndarray) -> np.ndarray | None:
        return None

    def wants_prefetch(self) -> bool:
        """False once the source has nothing left to read (resident experts, all loaded)."""
        return not getattr(self.experts, "complete", False)

    def prefetch_for(self, x: np.ndarray, norm: np.ndarray, eps: float) -> None:
        """Before this layer's attention runs, guess its experts by routing the residual stream
        as it enters the layer (attention changes it a little), and start reading them."""
        _, ids = self.route(rms_norm(x, norm, eps))
        self.experts.prefetch(self.prefix, np.unique(ids).tolist())

    def __call__(self, x: np.ndarray) -> np.ndarray:
        t0 = clock() if PHASES.on else 0.0
        weights, ids = self.route(x)  # [L, K], [L, K]
        if t0:
            PHASES.add("router", self.layer, t0)
            t0 = clock()
        begin = getattr(self.experts, "begin", None)
        if begin is not None:  # experts computed elsewhere (colibri/cluster): the shared expert meanwhile
            collect = begin(self.prefix, x, weights, ids, one_token_rows=x.shape[0] == 1)
            try:
                shared = self.shared_out(x)
            finally:
                out = collect()
            if t0:
                PHASES.add("routed_experts", self.layer, t0)
            return out if shared is None else out + shared
        return self._plus_shared(x, run_experts(x, weights, ids, self.experts, self.prefix), t0)

    def over_matrices(self, x: np.ndarray, routes: tuple[np.ndarray, np.ndarray], t0: float) -> np.ndarray:
        """The block for a family whose experts are not the plain SwiGLU (a clipped SwiGLU:
        DeepSeek V4, GLM-5.3-Flash; biases and a clamp: gpt-oss): its routes (weights [L, K],
        ids [L, K]), made since t0 (the phase clock's start, 0.0 when off); one token through
        the fused kernel with `self.activation` where the experts' format has one, else
        `self.expert(x_rows, e, matrices)` over the matrix kernels; plus shared_out; each phase
        timed."""
        weights, ids = routes
        if t0:
            PHASES.add("router", self.layer, t0)
            t0 = clock()
        kernel = self.experts.fused(self.prefix) if x.shape[0] == 1 else None
        if kernel is not None:
            routed = _decode_fused(x, weights[0], ids[0], self.experts, self.prefix, kernel, self.activation)
        else:
            routed = sum_experts(x, weights, ids, self.experts, self.prefix, self.expert)
        return self._plus_shared(x, routed, t0)

    def _plus_shared(self, x: np.ndarray, routed: np.ndarray, t0: float) -> np.ndarray:
        """The routed experts' sum (computed since t0) plus shared_out(x), each phase timed."""
        if t0:
            PHASES.add("routed_experts", self.layer, t0)
            t0 = clock()
        shared = self.shared_out(x)
        if shared is not None:
            routed += shared
            if t0:
                PHASES.add("shared_experts", self.layer, t0)
        return routed

    def rows(self, hs: list[np.ndarray]) -> list[np.ndarray]:
        """self(h) for each one-token row h [1, D], the same bits, with each expert the rows
        route to read once for all of them (DecoderModel.forward_rows)."""
        t0 = clock() if PHASES.on else 0.0
        routes = [self.route(h) for h in hs]
        if t0:
            PHASES.add("router", self.layer, t0)
            t0 = clock()
        outs = run_experts_rows(hs, routes, self.experts, self.prefix, self.activation,
                                getattr(self, "expert", None))
        if t0:
            PHASES.add("routed_experts", self.layer, t0)
            t0 = clock()
        for h, out in zip(hs, outs):
            shared = self.shared_out(h)
            if shared is not None:
                out += shared
        if t0:
            PHASES.add("shared_experts", self.layer, t0)
        return outs


class SparseMoE(RoutedMoE):
    """Routed SwiGLU experts (softmax top-k), optionally plus a shared expert with a sigmoid gate."""

    def __init__(self, args, w, experts, prefix: str, top_k: int, norm_topk_prob: bool,
                 shared: MLP | None = None, shared_gate: QTensor | None = None):
        self.router = w.tensor(f"{prefix}.gate.weight")  # [E, D] float32
        self.experts = experts
        self.prefix = prefix
        self.layer = layer_index(prefix)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.shared, self.shared_gate = shared, shared_gate

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return softmax_topk(linear(x, self.router), self.top_k, self.norm_topk_prob)

    def shared_out(self, x: np.ndarray) -> np.ndarray | None:
        if self.shared is None:
            return None
        gate = linear(x, self.shared_gate)                      # [L, 1]
        return (np.float32(1.0) / (np.float32(1.0) + np.exp(-gate))) * self.shared(x)


def layer_index(prefix: str) -> int:
    """"model.layers.7.mlp" -> 7 (the layer a block reports its time under)."""
    return int(prefix.split("layers.")[1].split(".")[0])


def run_experts(x: np.ndarray, weights: np.ndarray, ids: np.ndarray, experts, prefix: str) -> np.ndarray:
    """Sum of routed expert outputs. Tokens are grouped by expert, so in prefill every selected
    expert is fetched once and applied to all its tokens as one matrix x matrix product."""
    compute = getattr(experts, "compute", None)
    if compute is not None:  # experts computed elsewhere (colibri/cluster): the layer's work in one call
        return compute(prefix, x, weights, ids, one_token_rows=x.shape[0] == 1)
    if x.shape[0] == 1:
        kernel = experts.fused(prefix)
        if kernel is not None:
            return _decode_fused(x, weights[0], ids[0], experts, prefix, kernel)
    return sum_experts(x, weights, ids, experts, prefix, lambda xe, e, ew: swiglu_expert(xe, ew))


def sum_experts(x: np.ndarray, weights: np.ndarray, ids: np.ndarray, experts, prefix: str, expert) -> np.ndarray:
    """sum_k weights[:, k] * expert(x, ids[:, k]) [L, D]: every chosen expert run once on all its
    tokens (`expert(x_rows, e, its matrices)`). Experts arrive in the order the store has them
    ready (RAM hits first, disk reads as they land), so computing overlaps reading; the
    contributions are added in expert-id order afterwards, so the sum, and the tokens, do not
    depend on placement."""
    parts = {}
    for e, ew in experts.iter_experts(prefix, np.unique(ids).tolist()):
        tok, slot = np.nonzero(ids == e)
        parts[e] = (tok, expert(np.ascontiguousarray(x[tok]), e, ew) * weights[tok, slot][:, None])
    out = np.zeros_like(x)
    for e in sorted(parts):
        tok, y = parts[e]
        out[tok] += y
    return out


def _decode_fused(x, weights, ids, experts, prefix: str, kernel,
                  activation: ExpertActivation = PLAIN) -> np.ndarray:
    """One token's routed experts through the fused kernel (colibri/kernels/moe.py): one call
    when every expert is in RAM in place, else one call per expert as its blob is ready, summed
    in expert-id order, which equals the single call bit for bit (placement never changes
    tokens)."""
    row = _sorted_row(x, weights, ids)
    xv, ids, w = row
    nthreads = get_num_threads()
    ready = experts.stacked(prefix, ids)
    if ready is not None:
        view, slots = ready
        return moe_kernels.stacked_experts(view, xv, slots, w, nthreads, idot.current(),
                                           activation.for_experts(ids))[None, :]
    return _expert_by_expert([row], experts, prefix, kernel, nthreads, activation)[0]


def run_experts_rows(hs: list[np.ndarray], routes: list, experts, prefix: str,
                     activation: ExpertActivation = PLAIN, expert=None) -> list[np.ndarray]:
    """run_experts(h, weights, ids) for each one-token row, the same bits, with each expert of
    the rows' union fetched once (_expert_by_expert, as _decode_fused's own fallback). Without
    the fused kernel (a blob format it does not cover), row by row; `activation` and `expert`
    as RoutedMoE.over_matrices takes them (expert None: the plain SwiGLU)."""
    compute = getattr(experts, "compute", None)
    if compute is not None and len(hs) > 1:  # colibri/cluster: all rows in one call, each its own token
        out = compute(prefix, np.concatenate(hs), np.concatenate([w for w, _ in routes]),
                      np.concatenate([ids for _, ids in routes]), one_token_rows=True)
        return [out[r:r + 1] for r in range(len(hs))]
    kernel = experts.fused(prefix)
    if kernel is None or compute is not None:
        if expert is None:
            return [run_experts(h, w, ids, experts, prefix) for h, (w, ids) in zip(hs, routes)]
        return [sum_experts(h, w, ids, experts, prefix, expert) for h, (w, ids) in zip(hs, routes)]
    if len(hs) == 1:
        (w, ids), = routes
        return [_decode_fused(hs[0], w[0], ids[0], experts, prefix, kernel, activation)]
    rows = [_sorted_row(h, w[0], ids[0]) for h, (w, ids) in zip(hs, routes)]
    return _expert_by_expert(rows, experts, prefix, kernel, get_num_threads(), activation)


def _sorted_row(x, weights, ids) -> tuple:
    """One token's (x [D] float32, its expert ids ascending, their weights in that order)."""
    order = np.argsort(ids, kind="stable")
    return (np.ascontiguousarray(x[0], dtype=np.float32), ids[order].tolist(),
            np.ascontiguousarray(weights[order], dtype=np.float32))


def _expert_by_expert(rows: list[tuple], experts, prefix: str, kernel, nthreads: int,
                      activation: ExpertActivation = PLAIN) -> list[np.ndarray]:
    """Rows from _sorted_row: each expert of their union fetched once, in the order the store
    has them ready, and applied to every row that routes to it (the fused kernel's one-expert
    call); each row's contributions then summed in expert-id order -> [1, D] per row."""
    weight_of = [dict(zip(ids, w)) for _, ids, w in rows]
    union = sorted({e for chosen in weight_of for e in chosen})
    parts: list[dict] = [{} for _ in rows]
    mode = idot.current()
    for e, blob in experts.iter_experts(prefix, union, blobs=True):
        glu = activation.for_experts([e])
        for (xv, _, _), chosen, part in zip(rows, weight_of, parts):
            if e in chosen:
                part[e] = moe_kernels.one_expert(kernel, xv, blob, chosen[e], nthreads, mode, glu)
    outs = []
    for (xv, _, _), part in zip(rows, parts):
        out = np.zeros(xv.shape[0], np.float32)
        for e in sorted(part):
            out += part[e]
        outs.append(out[None, :])
    return outs



# ----------------------------------------------------------------------------- grouped sigmoid routing
# DeepSeek-V3, Kimi-K2 and the GLM MoE families ("noaux_tc"): sigmoid scores, a per-expert
# `e_score_correction_bias` that steers the choice but not the weights, group-limited top-k
# (`n_group`, `topk_group`), optional renormalisation and `routed_scaling_factor`; after
# transformers' DeepseekV3TopkRouter and DeepseekV3MoE.

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


class GroupedMoE(RoutedMoE):
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
class GroupedMoEArgs(ModelArgs):
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


def grouped_moe(args: GroupedMoEArgs, w, experts, prefix: str) -> GroupedMoE:
    """The grouped-routing MoE block at `prefix` (the layer's "mlp"), as the config sets it."""
    return GroupedMoE(w, experts, prefix, args.n_routed_experts, args.num_experts_per_tok, args.n_group,
                      args.topk_group, bool(args.norm_topk_prob), args.routed_scaling_factor)
