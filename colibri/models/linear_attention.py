"""Hybrid linear-attention decoders (Qwen3-Next, Qwen3.5 / 3.6 MoE): most layers are Gated
DeltaNet linear attention with a recurrent state, one in `full_attention_interval` keeps
full attention with an output gate; after transformers' models/qwen3_next and
models/qwen3_5_moe.

The pieces: `GatedDeltaNet` (projections, short causal convolution, the gated delta rule of
kernels/delta_rule.py, gated RMSNorm, output projection), `GatedAttention` (grouped-query
attention whose q projection also yields a sigmoid gate on the output), `HybridModel` (the
shared decoder with a RecurrentCache per sequence, models/recurrent.py), `HybridArgs` (the
config fields both families share) and `UnitOffsetNorms` (their RMSNorm weights are stored as
offsets from 1).

Shape letters: L tokens, D hidden, Hk / Hv linear key / value heads, Dk / Dv their dims,
C = 2 Hk Dk + Hv Dv conv channels, H / KV attention heads, Dh attention head dim.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from numba import get_num_threads

from colibri.errors import ColibriError
from colibri.formats.qtensor import QTensor, dequantize
from colibri.kernels import delta_rule, ops
from colibri.kernels.attention import causal_attention
from colibri.models.args import ModelArgs
from colibri.models.attention import Attention
from colibri.models.decoder import DecoderModel
from colibri.models.layers import fuse_rows, linear, rms_norm
from colibri.models.recurrent import MAX_SNAPSHOTS, RecurrentCache
from colibri.models.rope import apply_rope

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class HybridArgs(ModelArgs):
    """The config fields of the Gated DeltaNet hybrids (Qwen3NextConfig, Qwen3_5MoeTextConfig)."""

    head_dim: int | None = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: list | None = None
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512

    partial_rotary_factor: float = 0.25  # the configs' default (rope_parameters may say otherwise)

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            interval = int(self.extra.get("full_attention_interval", 4))
            self.layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        types = list(self.layer_types[: self.num_hidden_layers])
        if len(types) < self.num_hidden_layers or set(types) - set(LAYER_TYPES):
            raise ColibriError(f"config field layer_types={self.layer_types!r} is not implemented "
                               f"(one of {', '.join(LAYER_TYPES)} per layer)")
        self.layer_types = types
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ColibriError(f"config fields linear_num_value_heads={self.linear_num_value_heads} / "
                               f"linear_num_key_heads={self.linear_num_key_heads}: value heads must be a "
                               "multiple of key heads")
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []

    def mlp_kind(self, layer: int) -> str:
        if layer >= self.num_hidden_layers:  # MTP layer k (mtp.layers.k): vLLM gives it the rule of layer k
            layer -= self.num_hidden_layers
        sparse = self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        return "moe" if sparse and layer not in self.mlp_only_layers else "dense"

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]


class UnitOffsetNorms:
    """The checkpoint's weights, with each zero-centred RMSNorm weight read as 1 + w:
    Qwen3NextRMSNorm computes x / rms(x) * (1 + w). That includes the MTP block's input and final
    norms (models/mtp.py; its final `norm` converted to model.layers.N.norm). The gated norm of
    the linear layers (`linear_attn.norm`) is a plain weight, as are the other tensors."""

    OFFSET = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_embedding"
                        r"|pre_fc_norm_hidden)\.weight$|^model\.norm\.weight$|^model\.layers\.\d+\.norm\.weight$")

    def __init__(self, weights):
        self.weights = weights

    def tensor(self, name: str):
        t = self.weights.tensor(name)
        return (np.float32(1.0) + t).astype(np.float32) if self.OFFSET.search(name) else t

    def __getattr__(self, name):
        return getattr(self.weights, name)


def values(t) -> np.ndarray:
    """A float tensor of the container as a contiguous float32 array (the container hands
    tensors of more than one dimension back as f32 QTensors)."""
    if isinstance(t, QTensor):
        t = dequantize(t)
    return np.ascontiguousarray(t, np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.softplus (beta 1, linear above 20), float32."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return (np.float32(1.0) / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


class GatedDeltaNet:
    """A Gated DeltaNet layer. `layout` is how the checkpoint holds the input projections:
    "qkvz" (Qwen3-Next: in_proj_qkvz and in_proj_ba, rows grouped by key head) or "split"
    (Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Both are computed as two fused
    matrices, [q | k | v | z] and [b | a] (Qwen3-Next's grouped outputs are put in that order
    by one gather)."""

    def __init__(self, args: HybridArgs, w, prefix: str, layout: str):
        self.hk, self.hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.eps = args.rms_norm_eps
        if layout == "qkvz":
            self.qkvz, self.ba = w.tensor(f"{prefix}.in_proj_qkvz.weight"), w.tensor(f"{prefix}.in_proj_ba.weight")
            self.qkvz_order, self.ba_order = self._grouped_order()
        elif layout == "split":
            t = {p: w.tensor(f"{prefix}.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")}
            self.qkvz = _fused(t["qkv"], t["z"])
            self.ba = _fused(t["b"], t["a"])
            self.qkvz_order = self.ba_order = None
        else:
            raise ValueError(layout)
        conv = values(w.tensor(f"{prefix}.conv1d.weight"))                     # [C, 1, K]
        self.conv_w = np.ascontiguousarray(conv.reshape(self.conv_dim, -1))      # [C, K]
        self.kernel = self.conv_w.shape[1]
        if self.kernel != args.linear_conv_kernel_dim:
            raise ColibriError(f"{prefix}.conv1d.weight has kernel width {self.kernel}, config field "
                               f"linear_conv_kernel_dim={args.linear_conv_kernel_dim}")
        self.neg_a = -np.exp(values(w.tensor(f"{prefix}.A_log")))               # [Hv]
        self.dt_bias = values(w.tensor(f"{prefix}.dt_bias"))
        self.norm = values(w.tensor(f"{prefix}.norm.weight"))                     # [Dv]
        self.out_proj = w.tensor(f"{prefix}.out_proj.weight")

    def _grouped_order(self) -> tuple[np.ndarray, np.ndarray]:
        """Qwen3-Next's in_proj_qkvz rows come per key head g as [q_g | k_g | v_g | z_g] (v and z
        for the Hv/Hk value heads of g), in_proj_ba's as [b_g | a_g]: the output columns that
        give [q | k | v | z] and [b | a] (transformers' fix_query_key_value_ordering)."""
        r = self.hv // self.hk
        dk, vz = self.dk, r * self.dv
        width = 2 * dk + 2 * vz
        base = np.arange(self.hk)[:, None] * width
        parts = [base + np.arange(dk), base + dk + np.arange(dk), base + 2 * dk + np.arange(vz),
                 base + 2 * dk + vz + np.arange(vz)]
        ba = np.arange(self.hk)[:, None] * 2 * r
        return (np.concatenate([p.reshape(-1) for p in parts]),
                np.concatenate([(ba + np.arange(r)).reshape(-1), (ba + r + np.arange(r)).reshape(-1)]))

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [K-1, C], delta-rule state [Hv, Dk, Dv]) of one sequence."""
        return (self.kernel - 1, self.conv_dim), (self.hv, self.dk, self.dv)

    def __call__(self, x: np.ndarray, cache: RecurrentCache, layer: int, pos0: int, cos=None, sin=None) -> np.ndarray:
        L = x.shape[0]
        qkvz, ba = _project(x, self.qkvz), _project(x, self.ba)
        if self.qkvz_order is not None:
            qkvz, ba = qkvz[:, self.qkvz_order], ba[:, self.ba_order]
        c = self.conv_dim
        mixed = delta_rule.causal_conv(np.ascontiguousarray(qkvz[:, :c]), cache.conv[layer], self.conv_w)
        kd = self.key_dim
        q = mixed[:, :kd].reshape(L, self.hk, self.dk)
        k = mixed[:, kd:2 * kd].reshape(L, self.hk, self.dk)
        v = mixed[:, 2 * kd:].reshape(L, self.hv, self.dv)
        beta = sigmoid(ba[:, : self.hv])
        g = (self.neg_a * softplus(ba[:, self.hv:] + self.dt_bias)).astype(np.float32)
        state = cache.state[layer]
        if L == 1:
            o = delta_rule.delta_step(state, np.ascontiguousarray(q[0]), np.ascontiguousarray(k[0]),
                                      np.ascontiguousarray(v[0]), np.ascontiguousarray(g[0]),
                                      np.ascontiguousarray(beta[0]))[None]
            cache.keep_row(layer, pos0 + 1)
        else:
            o = delta_rule.delta_chunked(state, np.ascontiguousarray(q), np.ascontiguousarray(k),
                                         np.ascontiguousarray(v), np.ascontiguousarray(g),
                                         np.ascontiguousarray(beta))
        z = np.ascontiguousarray(qkvz[:, c:]).reshape(L * self.hv, self.dv)
        o = delta_rule.gated_rms_norm(o.reshape(L * self.hv, self.dv), z, self.norm, np.float32(self.eps))
        return linear(o.reshape(L, self.value_dim), self.out_proj)


def _fused(*ts):
    """Matrices that read the same input, as one (fuse_rows) or, when their schemes differ, a
    tuple _project runs one by one."""
    return fuse_rows(*ts) or ts


def _project(x: np.ndarray, w) -> np.ndarray:
    if isinstance(w, tuple):
        return np.concatenate([linear(x, t) for t in w], axis=1)
    return linear(x, w)


class GatedAttention(Attention):
    """Full attention of the hybrids: q_proj yields, per head, the query and a gate; the output
    is attention * sigmoid(gate) before o_proj. Per-head q/k RMSNorm, partial rotary. Its K and
    V live in the RecurrentCache's KV arrays (cache.kv_layer)."""

    def __init__(self, args: HybridArgs, w, prefix: str, rope):
        super().__init__(args, w, prefix, rope, qk_norm="head")

    def __call__(self, x: np.ndarray, cache: RecurrentCache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        L, H, Dh = x.shape[0], self.h, self.dh
        j = cache.kv_layer[layer]
        if self.qkv is not None:
            qkv = linear(x, self.qkv, self.qkv_bias)
            nq, nk = 2 * H * Dh, self.kv * Dh
            qg, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            qg = linear(x, self.q_proj, self.q_bias)
            k, v = linear(x, self.k_proj, self.k_bias), linear(x, self.v_proj, self.v_bias)
        qg = qg.reshape(L, H, 2 * Dh)
        q, gate = rms_norm(qg[..., :Dh], self.q_norm, self.eps), qg[..., Dh:].reshape(L, H * Dh)
        k = rms_norm(k.reshape(L, self.kv, Dh), self.k_norm, self.eps)
        q = apply_rope(q, cos, sin, self.rope.rotary_dim)
        k = apply_rope(k, cos, sin, self.rope.rotary_dim)
        cache.write_rows(j, pos0, k.transpose(1, 0, 2), v.reshape(L, self.kv, Dh).transpose(1, 0, 2))
        if L == 1:
            out = ops.attend_one(q[0], cache.k[j], cache.v[j], pos0 + 1, self.scale)[None, :]
        else:
            out = causal_attention(q, cache.keys(j, pos0 + L), cache.values(j, pos0 + L), pos0, self.scale,
                                   get_num_threads())
        return linear(out * sigmoid(gate), self.o_proj, self.o_bias)


class HybridModel(DecoderModel):
    """The shared decoder over linear and full attention layers, one RecurrentCache per
    sequence. A prefill chunk leaves a snapshot of the recurrent state (prefix reuse); a pass
    with several rows of one sequence keeps each row's state (rolling back rejected drafts)."""

    max_snapshots = MAX_SNAPSHOTS

    def new_cache(self, max_tokens: int) -> RecurrentCache:
        a = self.args
        linear_layers = a.layers_of("linear_attention")
        conv, state = self.layers[linear_layers[0]].attn.state_shapes() if linear_layers else ((0, 0), (0, 0, 0))
        return RecurrentCache(a.layers_of("full_attention"), linear_layers, a.num_key_value_heads, a.head_dim,
                              max_tokens, conv, state, dtype=self.kv_cache, max_snapshots=self.max_snapshots)

    def forward(self, ids, cache: RecurrentCache, all_logits: bool = False) -> np.ndarray:
        try:
            logits = self._logits(ids, cache, all_logits)
        except BaseException:  # the layers before the failure consumed the tokens: back to a kept state
            cache.recover()
            raise
        if len(ids) > 1:
            cache.snapshot()
        else:
            cache.decoded()
        return logits

    def forward_rows(self, ids, caches: list) -> np.ndarray:
        several = {id(c): c for c in caches if sum(c is d for d in caches) > 1}.values()
        for c in several:
            c.rows(True)
        try:
            logits = self._rows_logits(ids, caches)
        except BaseException:
            for c in {id(c): c for c in caches}.values():
                c.recover()
            raise
        else:
            for c in {id(c): c for c in caches}.values():
                c.decoded()
            return logits
        finally:
            for c in several:
                c.rows(False)

    def _logits(self, ids, cache: RecurrentCache, all_logits: bool) -> np.ndarray:
        """The pass itself (forward wraps it in the state's bookkeeping): the shared decoder's."""
        return DecoderModel.forward(self, ids, cache, all_logits)

    def _rows_logits(self, ids, caches: list) -> np.ndarray:
        """The rows' pass itself (forward_rows wraps it): the shared decoder's, layer by layer."""
        return DecoderModel.forward_rows(self, ids, caches)

    def _kv_lists(self, caches: list) -> list:
        return [None] * len(self.layers)  # no fused multi-row attention here: rows go one by one
