"""gpt-oss (OpenAI's gpt-oss-20b / -120b): grouped-query attention with q/k/v/o biases, learned
attention sinks and sliding-window layers alternating with full ones (config layer_types,
sliding_window); routed experts with biases, a router with a bias (softmax over the top-k
logits) and the clamped SwiGLU ((up + 1) * gate * sigmoid(alpha * gate), gate and up clamped
to `swiglu_limit`); after transformers' models/gpt_oss/modeling_gpt_oss.py.

The experts' checkpoint layout (stacked, gate/up interleaved, MXFP4 in the released files) is
unpacked by colibri/io/gpt_oss_experts.py at convert time; here an expert is the usual
gate_proj / up_proj / down_proj matrices plus its rows of the dense bias tensors.

Shape letters: L tokens, N keys, D hidden, H query heads, KV key/value heads, G = H / KV,
Dh head dim, E experts, K top-k, I expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import dequantize
from colibri.kernels import ops
from colibri.kernels.moe import ExpertActivation
from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.attention import Attention
from colibri.models.cache import KVCache
from colibri.models.decoder import DecoderModel, build_decoder
from colibri.models.layers import linear
from colibri.models.moe import RoutedMoE, layer_index
from colibri.models.rope import apply_rope
from colibri.profile import PHASES, clock

LAYER_TYPES = ("sliding_attention", "full_attention")
QUERY_BLOCK = 256  # queries whose scores are held at once, at most
SCORE_ELEMENTS = 1 << 22  # ... and at most this many scores [KV, G, queries, keys] (16 MiB of float32)


@dataclass
class ModelArgs(BaseModelArgs):
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: list | None = None
    swiglu_alpha: float = 1.702  # transformers' constant, before it became a config field
    swiglu_limit: float = 7.0
    attention_bias: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:  # GptOssConfig's default: sliding first, then alternating
            self.layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                for i in range(self.num_hidden_layers)]
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad or len(self.layer_types) < self.num_hidden_layers:
            raise ColibriError(f"config field layer_types={self.layer_types!r} is not implemented (one of "
                               f"{', '.join(LAYER_TYPES)} per layer)")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ColibriError(f"config field sliding_window={self.sliding_window!r} must be a positive number "
                               "of keys for the sliding_attention layers")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ColibriError(f"config field num_experts_per_tok={self.num_experts_per_tok} must be between 1 "
                               f"and num_local_experts={self.num_local_experts}")

    def mlp_kind(self, layer: int) -> str:
        return "moe"

    def window(self, layer: int) -> int | None:
        """Keys a query of layer `layer` sees, itself included; None: every earlier one."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None


def sink_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: np.float32,
                   sinks: np.ndarray, window: int | None) -> np.ndarray:
    """Causal attention of queries q [L, H, Dh] at positions pos0.. over k, v [KV, N, Dh]
    (N = pos0 + L) with a learned sink logit per head in the softmax's denominator and, for
    a sliding layer, only the last `window` keys visible. Returns [L, H * Dh].

    As transformers' eager_attention_forward: the sink joins the scores as one more column,
    the softmax runs over all of them and the sink's column is dropped."""
    L, H, Dh = q.shape
    KV = k.shape[0]
    G = H // KV
    out = np.empty((L, H, Dh), np.float32)
    sink = sinks.astype(np.float32).reshape(KV, G, 1, 1)
    keys = pos0 + L if window is None else min(pos0 + L, window + QUERY_BLOCK)
    step = max(1, min(QUERY_BLOCK, SCORE_ELEMENTS // (H * keys)))
    for a in range(0, L, step):
        b = min(L, a + step)
        qpos = np.arange(pos0 + a, pos0 + b)                           # [l]
        first = 0 if window is None else max(0, pos0 + a - window + 1)  # first key any of them sees
        kpos = np.arange(first, pos0 + b)                               # [n]
        visible = kpos[None, :] <= qpos[:, None]
        if window is not None:
            visible &= kpos[None, :] > qpos[:, None] - window
        qb = q[a:b].reshape(b - a, KV, G, Dh).transpose(1, 2, 0, 3)     # [KV, G, l, Dh]
        s = np.matmul(qb, k[:, None, first:pos0 + b].transpose(0, 1, 3, 2)) * scale  # [KV, G, l, n]
        s = np.where(visible, s, np.float32(-np.inf))
        m = np.maximum(s.max(axis=-1, keepdims=True), sink)
        p = np.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True) + np.exp(sink - m)
        o = np.matmul(p / denom, v[:, None, first:pos0 + b])            # [KV, G, l, Dh]
        out[a:b] = o.transpose(2, 0, 1, 3).reshape(b - a, H, Dh)
    return out.reshape(L, H * Dh)


class SinkAttention(Attention):
    """Attention (q/k/v/o biases, fused q/k/v) with per-head sinks and an optional window. Not
    the fused decode kernel's Attention (decoder._build_fused takes that type only): decode
    runs this step-by-step path."""

    def __init__(self, args: ModelArgs, w, prefix: str, rope, window: int | None):
        super().__init__(args, w, prefix, rope)
        self.sinks = w.tensor(f"{prefix}.sinks")  # [H] float32
        self.window = window

    def __call__(self, x: np.ndarray, cache: KVCache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        L = x.shape[0]
        nq, nk = self.h * self.dh, self.kv * self.dh
        if self.qkv is not None:
            qkv = linear(x, self.qkv, self.qkv_bias)  # [L, (H + 2 KV) * Dh]
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q, k, v = (linear(x, t, b) for t, b in ((self.q_proj, self.q_bias), (self.k_proj, self.k_bias),
                                                    (self.v_proj, self.v_bias)))
        q = apply_rope(q.reshape(L, self.h, self.dh), cos, sin, self.rope.rotary_dim)
        k = apply_rope(k.reshape(L, self.kv, self.dh), cos, sin, self.rope.rotary_dim)
        cache.write_rows(layer, pos0, k.transpose(1, 0, 2), v.reshape(L, self.kv, self.dh).transpose(1, 0, 2))
        n = pos0 + L
        out = sink_attention(q, cache.keys(layer, n), cache.values(layer, n), pos0, self.scale, self.sinks,
                             self.window)
        return linear(out, self.o_proj, self.o_bias)


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """gpt-oss's expert activation (GptOssExperts._apply_gate): the gate clamped from above,
    up on both sides, then (up + 1) * gate * sigmoid(alpha * gate); the fused decode kernel's
    own code (ops.expert_glu_into)."""
    return ops.expert_glu(gate, up, ops.GPT_OSS, alpha, limit)


def topk_softmax(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [L, E] -> (weights [L, K], ids [L, K]): the k largest logits, highest
    first, and a softmax over those k only (GptOssTopKRouter)."""
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, axis=-1)
    e = np.exp(top - top.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(np.float32), ids


class GptOssMoE(RoutedMoE):
    """Routed experts with biases and the clamped SwiGLU, from the expert source as any
    family's (RAM, disk, prefetch): one token through the fused MoE kernel with the biases and
    the clamp (`activation`), several over the matrix kernels (`expert`)."""

    def __init__(self, args: ModelArgs, w, experts, prefix: str):
        if getattr(experts, "compute", None) is not None:
            raise ColibriError("gpt_oss: experts computed on other machines (colibri/cluster) run the plain "
                               "SwiGLU; gpt-oss's biased, clamped experts are not implemented there yet")
        self.router = w.tensor(f"{prefix}.router.weight")           # [E, D] float32
        self.router_bias = w.tensor(f"{prefix}.router.bias")        # [E]
        self.biases = {p: dequantize(w.tensor(f"{prefix}.experts.{p}.bias"))  # [E, I] / [E, D] float32
                       for p in ("gate_proj", "up_proj", "down_proj")}
        self.experts, self.prefix = experts, prefix
        self.layer = layer_index(prefix)
        self.top_k, self.alpha, self.limit = args.num_experts_per_tok, args.swiglu_alpha, args.swiglu_limit
        self.activation = ExpertActivation(ops.GPT_OSS, self.alpha, self.limit,
                                           tuple(self.biases[p] for p in ("gate_proj", "up_proj", "down_proj")))

    def route(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return topk_softmax(linear(x, self.router, self.router_bias), self.top_k)

    def expert(self, x: np.ndarray, e: int, ew: dict) -> np.ndarray:
        """Expert e's output for tokens x [L, D] -> [L, D]."""
        b = self.biases
        gate = linear(x, ew["gate_proj"], b["gate_proj"][e])       # [L, I]
        up = linear(x, ew["up_proj"], b["up_proj"][e])
        return linear(clamped_swiglu(gate, up, self.alpha, self.limit), ew["down_proj"], b["down_proj"][e])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        t0 = clock() if PHASES.on else 0.0
        return self.over_matrices(x, self.route(x), t0)


def build(config: dict, weights, experts) -> DecoderModel:
    args = ModelArgs.from_dict(config)
    return build_decoder(
        args, weights, lambda i, p, rope: SinkAttention(args, weights, p, rope, args.window(i)),
        lambda i, p: GptOssMoE(args, weights, experts, f"{p}.mlp"))
