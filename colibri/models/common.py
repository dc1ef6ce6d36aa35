"""Pieces shared by the decoder-only families (llama, mixtral, olmoe, qwen2_moe, qwen3_moe):
config parsing, RMSNorm, RoPE variants, GQA attention over a KV cache, SwiGLU MLP, softmax
top-k routed experts. Numerics follow the transformers implementations (float32 throughout)
so greedy tokens match; the heavy matrix work goes through colibri.kernels.

Shape letters: L tokens, D hidden, H query heads, KV key/value heads, G = H // KV, Dh head
dim, N cached positions, E experts, K top-k.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields

import numpy as np

from numba import get_num_threads
from numba.typed import List

from colibri.errors import ColibriError
from colibri.memory import WEIGHTS, huge_arrays
from colibri.kernels import decode, embedding, idot, matmul, matvec, moe, ops
from colibri.kernels.attention import causal_attention
from colibri.kernels.tasks import over_rows
from colibri.kernels.cpu import int4_weight, matvec_rows
from colibri.formats.qtensor import INT4_SCHEMES, QTensor
from colibri.profile import PHASES, clock

# ----------------------------------------------------------------------------- config

@dataclass
class ModelArgs:
    """The config.json fields the shared decoder reads; families subclass and add theirs."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    bos_token_id: int | list | None = None
    eos_token_id: int | list | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cfg: dict):
        names = {f.name for f in fields(cls)}
        known = {k: v for k, v in cfg.items() if k in names and k != "extra"}
        args = cls(**known, extra={k: v for k, v in cfg.items() if k not in names})
        return args

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise ColibriError(f"config field hidden_act={self.hidden_act!r} is not implemented (only 'silu')")

    # Family hooks -------------------------------------------------------------
    def mlp_kind(self, layer: int) -> str:
        """'dense' or 'moe' for decoder layer `layer`."""
        return "dense"

    def rope_params(self) -> dict:
        """transformers v5 keeps rope settings in `rope_parameters`; v4 in rope_theta/rope_scaling."""
        p = dict(self.rope_parameters or {})
        if self.rope_scaling:
            p = {**self.rope_scaling, **p}
        if "rope_theta" not in p:
            p["rope_theta"] = self.rope_theta if self.rope_theta is not None else 10000.0
        p.setdefault("rope_type", p.get("type", "default"))
        p.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        return p


# ----------------------------------------------------------------------------- elementwise

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] -> weight * x / sqrt(mean(x^2) + eps), as transformers' RMSNorm in float32."""
    shape = x.shape
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, shape[-1])
    w, eps = np.ascontiguousarray(weight, dtype=np.float32), np.float32(eps)
    out = np.empty_like(x2)
    over_rows(lambda a, b: ops.rms_norm_into(x2[a:b], w, eps, out[a:b]), x2.shape[0])
    return out.reshape(shape)


def silu_mul(gu: np.ndarray, n: int) -> np.ndarray:
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n] (ops.silu_mul, rows over the threads)."""
    out = np.empty((gu.shape[0], n), np.float32)
    over_rows(lambda a, b: ops.silu_mul_into(gu[a:b], n, out[a:b]), gu.shape[0])
    return out


def fuse_rows(*ts: QTensor) -> QTensor | None:
    """Stack matrices that read the same input into one (q/k/v, gate/up): one kernel call
    instead of several per token. Rows are computed independently, so the outputs are the
    same numbers. None when the schemes or input widths differ."""
    if len({t.scheme for t in ts}) != 1 or len({t.shape[1] for t in ts}) != 1 or len({t.interleave for t in ts}) != 1:
        return None

    def cat(arrays):  # into the huge-page slab, where the container puts the weights it reads
        if arrays[0] is None:
            return None
        out = WEIGHTS.empty((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
        return np.concatenate(arrays, axis=0, out=out)

    # (interleaved blocks never straddle two matrices: stacked, they stay whole)
    return QTensor(ts[0].scheme, (sum(t.shape[0] for t in ts), ts[0].shape[1]), cat([t.q for t in ts]),
                   cat([t.scales for t in ts]), cat([t.mins for t in ts]), ts[0].interleave)


def linear(x: np.ndarray, w: QTensor, bias: np.ndarray | None = None) -> np.ndarray:
    """x [L, in] -> [L, out]. Decode (L == 1) takes the matvec kernel, prefill the matmul one;
    int4 weights under `--activations int8` take the integer-dot kernels (kernels/idot.py)."""
    if w.scheme in INT4_SCHEMES and idot.current() == "int8":
        y = idot.matvec_q(w, x[0])[None, :] if x.shape[0] == 1 else idot.matmul_q(w, x)
    elif x.shape[0] == 1:
        y = matvec(w, x[0])[None, :]
    else:
        y = matmul(w, x)
    if bias is not None:
        y += bias
    return y


def linear_rows(x: np.ndarray, w: QTensor) -> np.ndarray:
    """linear(x[r:r+1], w) for each row of x [B, in] -> [B, out], the same bits, with the
    weights read once for all rows (several tokens decoded in one pass)."""
    if x.shape[0] == 1:  # the one-row kernels' 8-row blocks beat a tile of one token
        return linear(x, w)
    if w.scheme in INT4_SCHEMES and idot.current() == "int8":
        return idot.matmul_q(w, x)
    return matvec_rows(w, x)


# ----------------------------------------------------------------------------- RoPE

ROPE_BLOCK = 256  # positions whose angles Rope.cos_sin_at computes at once
ROPE_BLOCKS_KEPT = 8  # blocks kept: a batch's sequences sit at different positions


@dataclass
class Rope:
    inv_freq: np.ndarray       # [R/2] float32
    attention_scaling: float   # multiplies cos and sin (YaRN's mscale)
    rotary_dim: int            # R: rotated leading dims of each head (partial rotary)
    # first position -> (cos, sin) of the blocks of ROPE_BLOCK positions cos_sin_at computed
    _blocks: dict = field(default_factory=dict, repr=False, compare=False)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # [L, R/2]
        emb = np.concatenate([freqs, freqs], axis=-1)                          # [L, R]
        s = np.float32(self.attention_scaling)
        return np.cos(emb) * s, np.sin(emb) * s

    def cos_sin_at(self, pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos_sin(np.arange(pos, pos + 1)) for a decode token: [1, R] rows of a table computed
        for ROPE_BLOCK positions at a time. Seven numpy calls a token, made right after the
        token before had streamed the weights through the caches, took ~70 us (10 us warm).
        The rows are the same numbers: numpy's cos and sin are elementwise
        (tests/models/test_rope.py checks the rows against one-position calls)."""
        start = pos - pos % ROPE_BLOCK
        block = self._blocks.get(start)
        if block is None:
            block = self.cos_sin(np.arange(start, start + ROPE_BLOCK))
            if len(self._blocks) >= ROPE_BLOCKS_KEPT:  # the oldest goes (list(): one step under the GIL)
                for oldest in list(self._blocks)[:1]:
                    self._blocks.pop(oldest, None)
            self._blocks[start] = block
        i = pos - start
        return block[0][i:i + 1], block[1][i:i + 1]


def build_rope(args: ModelArgs, head_dim: int | None = None) -> Rope:
    """inv_freq for the rope variants these configs use, as transformers' modeling_rope_utils."""
    p = args.rope_params()
    head_dim = head_dim or args.head_dim
    dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    base = float(p["rope_theta"])
    rope_type = p["rope_type"]
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
    scaling = 1.0
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / np.float32(p["factor"])
    elif rope_type == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / lo, old_ctx / hi
        wavelen = 2 * math.pi / inv_freq
        inv_l = np.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv_freq = np.where(medium, smoothed, inv_l).astype(np.float32)
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn(p, dim, base, args.max_position_embeddings)
    else:
        raise ColibriError(f"config field rope_scaling.rope_type={rope_type!r} is not implemented "
                           "(supported: default, linear, llama3, yarn)")
    return Rope(inv_freq.astype(np.float32), float(scaling), dim)


def _yarn(p: dict, dim: int, base: float, max_pos: int) -> tuple[np.ndarray, float]:
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings") or max_pos
    if factor is None:
        factor = max_pos / orig

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = get_mscale(factor, ms) / get_mscale(factor, ms_all) if ms and ms_all else get_mscale(factor)
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrap = np.float32(1.0) / pos_freqs
    interp = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    extrap_factor = 1 - ramp
    inv_freq = interp * (1 - extrap_factor) + extrap * extrap_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
    """x [L, H, Dh]; cos/sin [L, R]. transformers' rotate_half convention on the first R dims.
    Returns a new array (x is left as it was)."""
    out = np.array(x, dtype=np.float32, order="C")
    cos, sin = np.ascontiguousarray(cos, dtype=np.float32), np.ascontiguousarray(sin, dtype=np.float32)
    over_rows(lambda a, b: ops.rope(out[a:b], cos[a:b], sin[a:b], rotary_dim), out.shape[0])
    return out


# ----------------------------------------------------------------------------- KV cache

KV_CACHE_TYPES = {"f32": np.float32, "f16": np.uint16}  # f16: float16 bits (numba has no float16)


class KVCache:
    """Per-layer K and V for one sequence, grown by doubling up to `max_tokens`.

    dtype "f32" keeps K and V as computed (the reference's function); "f16" rounds them to
    float16, half the bytes decode attention reads per token at long contexts (the kernels
    widen them on load; kernels/ops.py). Write and read through write_rows / keys / values,
    which convert; the arrays k[layer], v[layer] go to the kernels as they are."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, v_dim: int | None = None,
                 dtype: str = "f32"):
        if dtype not in KV_CACHE_TYPES:
            raise ColibriError(f"kv cache type must be one of {', '.join(KV_CACHE_TYPES)}, not {dtype!r}")
        self.max_tokens = max_tokens
        self.length = 0
        self.dtype = dtype
        self._np = KV_CACHE_TYPES[dtype]
        self._shape = (num_kv_heads, head_dim, v_dim or head_dim)
        self.k, self.v = self._arrays(num_layers, min(max_tokens, 256))
        self._lists = None  # typed_lists' memo

    def _arrays(self, num_layers: int, cap: int) -> tuple[list, list]:
        """Every layer's K and V arrays [KV, cap, D] for `cap` positions, zeroed, in one
        huge-page mapping: decode attention streams all of them every token."""
        kvh, dk, dv = self._shape
        arrays = huge_arrays([((kvh, cap, dk), self._np)] * num_layers + [((kvh, cap, dv), self._np)] * num_layers)
        return arrays[:num_layers], arrays[num_layers:]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def reserve(self, n: int) -> None:
        if n > self.max_tokens:
            raise ColibriError(f"context full: {n} tokens needed, the context holds {self.max_tokens}")
        if n <= self.capacity:
            return
        cap = min(self.max_tokens, max(n, 2 * self.capacity))
        k, v = self._arrays(len(self.k), cap)
        for old, new in zip(self.k + self.v, k + v):
            new[:, : self.length] = old[:, : self.length]
        self.k, self.v = k, v

    def typed_lists(self) -> tuple:
        """Every layer's K and V arrays as two numba typed lists of unmanaged views
        (decode.token_layers), kept while the cache holds the same arrays (growing replaces
        them; self.k and self.v keep the arrays the views point to)."""
        if self._lists is None or self._lists[0] is not self.k[0]:
            self._lists = (self.k[0], decode.unmanaged_arrays(tuple(self.k)), decode.unmanaged_arrays(tuple(self.v)))
        return self._lists[1], self._lists[2]

    def write_rows(self, layer: int, pos0: int, k: np.ndarray, v: np.ndarray) -> None:
        """K and V of positions pos0 .. pos0 + L, given as float32 [KV, L, D]."""
        L = k.shape[1]
        if self.dtype == "f16":
            k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
        self.k[layer][:, pos0:pos0 + L] = k
        self.v[layer][:, pos0:pos0 + L] = v

    def keys(self, layer: int, n: int) -> np.ndarray:
        """The first n positions' K as float32 [KV, n, Dk] (a view of a float32 cache)."""
        return self._float32(self.k[layer][:, :n])

    def values(self, layer: int, n: int) -> np.ndarray:
        return self._float32(self.v[layer][:, :n])

    def _float32(self, a: np.ndarray) -> np.ndarray:
        return a.view(np.float16).astype(np.float32) if self.dtype == "f16" else a

    def truncate(self, n: int) -> None:
        """Keep the first n positions (prefix reuse)."""
        self.length = min(self.length, n)

    @property
    def bytes_per_token(self) -> int:
        kvh, dk, dv = self._shape
        return len(self.k) * kvh * (dk + dv) * np.dtype(self._np).itemsize


# ----------------------------------------------------------------------------- blocks

class Attention:
    """Grouped-query attention with optional q/k bias and q/k RMSNorm (per head or over all heads)."""

    def __init__(self, args: ModelArgs, w, prefix: str, rope: Rope, qk_norm: str | None = None,
                 clip_qkv: float | None = None):
        self.h, self.kv, self.dh = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.eps = args.rms_norm_eps
        self.rope = rope
        self.q_proj, self.k_proj = w.tensor(f"{prefix}.q_proj.weight"), w.tensor(f"{prefix}.k_proj.weight")
        self.v_proj, self.o_proj = w.tensor(f"{prefix}.v_proj.weight"), w.tensor(f"{prefix}.o_proj.weight")
        self.q_bias, self.k_bias, self.v_bias = (
            w.tensor(f"{prefix}.{p}.bias") if w.has(f"{prefix}.{p}.bias") else None
            for p in ("q_proj", "k_proj", "v_proj"))
        self.o_bias = w.tensor(f"{prefix}.o_proj.bias") if w.has(f"{prefix}.o_proj.bias") else None
        self.qk_norm = qk_norm  # None, "head" (qwen3: over Dh) or "full" (olmoe: over H*Dh)
        if qk_norm:
            self.q_norm, self.k_norm = w.tensor(f"{prefix}.q_norm.weight"), w.tensor(f"{prefix}.k_norm.weight")
        self.clip_qkv = clip_qkv
        self.scale = np.float32(self.dh ** -0.5)
        self.qkv = fuse_rows(self.q_proj, self.k_proj, self.v_proj)
        biases = (self.q_bias, self.k_bias, self.v_bias)
        self.qkv_bias = None if all(b is None for b in biases) else np.concatenate(
            [b if b is not None else np.zeros(t.shape[0], np.float32)
             for b, t in zip(biases, (self.q_proj, self.k_proj, self.v_proj))])

    def __call__(self, x: np.ndarray, cache: KVCache, layer: int, pos0: int, cos, sin) -> np.ndarray:
        L = x.shape[0]
        if self.qkv is not None:
            qkv = linear(x, self.qkv, self.qkv_bias)  # [L, (H + 2 KV) * Dh]
            nq, nk = self.h * self.dh, self.kv * self.dh
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q = linear(x, self.q_proj, self.q_bias)  # [L, H*Dh]
            k = linear(x, self.k_proj, self.k_bias)  # [L, KV*Dh]
            v = linear(x, self.v_proj, self.v_bias)  # [L, KV*Dh]
        if self.qk_norm == "full":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if self.clip_qkv is not None:  # after the norm, as transformers' olmoe does
            c = np.float32(self.clip_qkv)
            q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
        q = q.reshape(L, self.h, self.dh)
        k = k.reshape(L, self.kv, self.dh)
        if self.qk_norm == "head":
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = apply_rope(q, cos, sin, self.rope.rotary_dim)
        k = apply_rope(k, cos, sin, self.rope.rotary_dim)
        cache.write_rows(layer, pos0, k.transpose(1, 0, 2), v.reshape(L, self.kv, self.dh).transpose(1, 0, 2))
        if L == 1:  # decode: one fused kernel over the cache
            out = ops.attend_one(q[0], cache.k[layer], cache.v[layer], pos0 + 1, self.scale)[None, :]
        else:
            out = causal_attention(q, cache.keys(layer, pos0 + L), cache.values(layer, pos0 + L), pos0, self.scale,
                                   get_num_threads())  # [L, H*Dh]
        return linear(out, self.o_proj, self.o_bias)


class MLP:
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: QTensor, up: QTensor, down: QTensor):
        self.gate, self.up, self.down = gate, up, down
        self.gate_up = fuse_rows(gate, up)

    @classmethod
    def from_weights(cls, w, prefix: str) -> "MLP":
        return cls(*(w.tensor(f"{prefix}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up is None:
            return linear(ops.silu_gate(linear(x, self.gate), linear(x, self.up)), self.down)
        gu = linear(x, self.gate_up)  # [L, 2I]
        return linear(silu_mul(gu, self.gate.shape[0]), self.down)


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
    and `shared_out(x)` (None: no shared expert)."""

    experts: object
    prefix: str
    layer: int

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
        out = run_experts(x, weights, ids, self.experts, self.prefix)
        if t0:
            PHASES.add("routed_experts", self.layer, t0)
            t0 = clock()
        shared = self.shared_out(x)
        if shared is not None:
            out += shared
            if t0:
                PHASES.add("shared_experts", self.layer, t0)
        return out

    def rows(self, hs: list[np.ndarray]) -> list[np.ndarray]:
        """self(h) for each one-token row h [1, D], the same bits, with each expert the rows
        route to read once for all of them (DecoderModel.forward_rows)."""
        routes = [self.route(h) for h in hs]
        outs = run_experts_rows(hs, routes, self.experts, self.prefix)
        for h, out in zip(hs, outs):
            shared = self.shared_out(h)
            if shared is not None:
                out += shared
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
    # Experts arrive in the order the store has them ready (RAM hits first, disk reads as they
    # land), so computing overlaps reading; the contributions are added in expert-id order
    # afterwards, so the sum, and the tokens, do not depend on placement.
    parts = {}
    for e, ew in experts.iter_experts(prefix, np.unique(ids).tolist()):
        tok, slot = np.nonzero(ids == e)
        y = swiglu_expert(np.ascontiguousarray(x[tok]), ew)
        parts[e] = (tok, y * weights[tok, slot][:, None])
    out = np.zeros_like(x)
    for e in sorted(parts):
        tok, y = parts[e]
        out[tok] += y
    return out


def _decode_fused(x, weights, ids, experts, prefix: str, kernel) -> np.ndarray:
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
        return moe.stacked_experts(view, xv, slots, w, nthreads, idot.current())[None, :]
    return _expert_by_expert([row], experts, prefix, kernel, nthreads)[0]


def run_experts_rows(hs: list[np.ndarray], routes: list, experts, prefix: str) -> list[np.ndarray]:
    """run_experts(h, weights, ids) for each one-token row, the same bits, with each expert of
    the rows' union fetched once (_expert_by_expert, as _decode_fused's own fallback). Without
    the fused kernel (a blob format it does not cover), row by row."""
    compute = getattr(experts, "compute", None)
    if compute is not None and len(hs) > 1:  # colibri/cluster: all rows in one call, each its own token
        out = compute(prefix, np.concatenate(hs), np.concatenate([w for w, _ in routes]),
                      np.concatenate([ids for _, ids in routes]), one_token_rows=True)
        return [out[r:r + 1] for r in range(len(hs))]
    kernel = experts.fused(prefix)
    if kernel is None or len(hs) == 1:
        return [run_experts(h, w, ids, experts, prefix) for h, (w, ids) in zip(hs, routes)]
    rows = [_sorted_row(h, w[0], ids[0]) for h, (w, ids) in zip(hs, routes)]
    return _expert_by_expert(rows, experts, prefix, kernel, get_num_threads())


def _sorted_row(x, weights, ids) -> tuple:
    """One token's (x [D] float32, its expert ids ascending, their weights in that order)."""
    order = np.argsort(ids, kind="stable")
    return (np.ascontiguousarray(x[0], dtype=np.float32), ids[order].tolist(),
            np.ascontiguousarray(weights[order], dtype=np.float32))


def _expert_by_expert(rows: list[tuple], experts, prefix: str, kernel, nthreads: int) -> list[np.ndarray]:
    """Rows from _sorted_row: each expert of their union fetched once, in the order the store
    has them ready, and applied to every row that routes to it (the fused kernel's one-expert
    call); each row's contributions then summed in expert-id order -> [1, D] per row."""
    weight_of = [dict(zip(ids, w)) for _, ids, w in rows]
    union = sorted({e for chosen in weight_of for e in chosen})
    parts: list[dict] = [{} for _ in rows]
    mode = idot.current()
    for e, blob in experts.iter_experts(prefix, union, blobs=True):
        for (xv, _, _), chosen, part in zip(rows, weight_of, parts):
            if e in chosen:
                part[e] = moe.one_expert(kernel, xv, blob, chosen[e], nthreads, mode)
    outs = []
    for (xv, _, _), part in zip(rows, parts):
        out = np.zeros(xv.shape[0], np.float32)
        for e in sorted(part):
            out += part[e]
        outs.append(out[None, :])
    return outs


# ----------------------------------------------------------------------------- model

class DecoderLayer:
    def __init__(self, args: ModelArgs, attn: Attention, mlp, prefix: str, w):
        self.attn, self.mlp = attn, mlp
        self.eps = args.rms_norm_eps
        self.input_norm = w.tensor(f"{prefix}.input_layernorm.weight")
        self.post_norm = w.tensor(f"{prefix}.post_attention_layernorm.weight")

        self._fused = None  # (attention args, MLP args) for colibri.kernels.decode, built on first use

    def __call__(self, x, cache, layer, pos0, cos, sin):
        t0 = clock() if PHASES.on else 0.0
        if x.shape[0] == 1:
            x = self.attend_one(x, cache, layer, pos0, cos, sin)
        else:
            x = x + self.attn(rms_norm(x, self.input_norm, self.eps), cache, layer, pos0, cos, sin)
        if t0:
            PHASES.add("attention", layer, t0)
            t0 = clock()
        x = self.mlp_one(x) if x.shape[0] == 1 else x + self.mlp(rms_norm(x, self.post_norm, self.eps))
        if t0:
            PHASES.add("ffn", layer, t0)
        return x

    def attend_one(self, x, cache, layer, pos0, cos, sin):
        """One token's attention block: one compiled call where the fused kernel covers it."""
        attn_args, _ = self._fused if self._fused is not None else self._build_fused()
        if attn_args is not None:
            nthreads = get_num_threads()  # not free (a lock and a thread check): once per block
            eps, qkv, qkv_bias, o, o_bias, rot, h, kv, dh, scale, norms = attn_args
            x = decode.attention_block(x, self.input_norm, eps, qkv, qkv_bias, o, o_bias,
                                       np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32),
                                       rot, cache.k[layer], cache.v[layer], pos0, h, kv, dh, scale, nthreads,
                                       *norms, idot.marker(idot.current()))
        else:
            x = x + self.attn(rms_norm(x, self.input_norm, self.eps), cache, layer, pos0, cos, sin)
        return x

    def attend_rows(self, x, caches: list, layer: int, pos: np.ndarray, cos, sin, kv_lists) -> np.ndarray:
        """attend_one for each row of x [B, D] (row r at caches[r], position pos[r], rope
        cos[r]/sin[r]), the same bits. Rows of one cache are consecutive positions in row
        order, so each row sees the keys of the rows before it. Fused attention runs all rows
        in one compiled call (decode.attention_rows; kv_lists: the rows' K and V arrays of this
        layer as numba typed lists, DecoderModel._kv_lists)."""
        if x.shape[0] == 1:  # one token: the one-token path as it is (no copies around it)
            return self.attend_one(x, caches[0], layer, int(pos[0]), cos, sin)
        attn_args, _ = self._fused if self._fused is not None else self._build_fused()
        if attn_args is None:
            return np.concatenate([self.attend_one(x[r:r + 1], caches[r], layer, int(pos[r]), cos[r:r + 1],
                                                   sin[r:r + 1]) for r in range(x.shape[0])])
        eps, qkv, qkv_bias, o, o_bias, rot, h, kv, dh, scale, norms = attn_args
        kcs, vcs = kv_lists
        return decode.attention_rows(x, self.input_norm, eps, qkv, qkv_bias, o, o_bias, cos, sin, rot, kcs, vcs,
                                     pos, h, kv, dh, scale, get_num_threads(), *norms,
                                     idot.marker(idot.current()))

    def mlp_rows(self, x: np.ndarray) -> np.ndarray:
        """mlp_one for each one-token row of x [B, D], the same bits; a fused dense MLP runs
        all rows through the multi-row kernels, a MoE block runs the rows' experts expert by
        expert, each read once (RoutedMoE.rows)."""
        if x.shape[0] == 1:
            return self.mlp_one(x)
        if isinstance(self.mlp, RoutedMoE):
            outs = self.mlp.rows([rms_norm(x[r:r + 1], self.post_norm, self.eps) for r in range(x.shape[0])])
            return x + np.concatenate(outs)
        _, mlp_args = self._fused if self._fused is not None else self._build_fused()
        if mlp_args is not None:
            return decode.mlp_rows(x, self.post_norm, *mlp_args, get_num_threads(), idot.marker(idot.current()))
        return np.concatenate([self.mlp_one(x[r:r + 1]) for r in range(x.shape[0])])

    def mlp_one(self, x):
        """One token's feed-forward block: one compiled call for a fused dense MLP."""
        _, mlp_args = self._fused if self._fused is not None else self._build_fused()
        if mlp_args is not None:
            return decode.mlp_block(x, self.post_norm, *mlp_args, get_num_threads(), idot.marker(idot.current()))
        return x + self.mlp(rms_norm(x, self.post_norm, self.eps))

    def _build_fused(self):
        """Which halves of this layer the fused decode kernels cover: GQA attention with fused
        int4 q/k/v (optional q/k norms and clipping) and a SwiGLU MLP with fused int4 gate/up.
        Anything else keeps the step-by-step path, which computes the same math."""
        eps = np.float32(self.eps)
        attn, mlp = self.attn, self.mlp
        attn_args = mlp_args = None
        if type(attn) is Attention and attn.qkv is not None:
            qkv, o = int4_weight(attn.qkv), int4_weight(attn.o_proj)
            if qkv is not None and o is not None:
                def f32(a):
                    return np.zeros(0, np.float32) if a is None else np.ascontiguousarray(a, np.float32)
                norms = (decode.QK_NORM_CODES[attn.qk_norm], f32(getattr(attn, "q_norm", None)),
                         f32(getattr(attn, "k_norm", None)), np.float32(attn.eps),
                         np.float32(np.inf if attn.clip_qkv is None else attn.clip_qkv))
                attn_args = (eps, qkv, f32(attn.qkv_bias), o, f32(attn.o_bias), attn.rope.rotary_dim,
                             attn.h, attn.kv, attn.dh, attn.scale, norms)
        if type(mlp) is MLP and mlp.gate_up is not None:
            gate_up, down = int4_weight(mlp.gate_up), int4_weight(mlp.down)
            if gate_up is not None and down is not None:
                mlp_args = (eps, gate_up, mlp.gate.shape[0], down)
        self._fused = (attn_args, mlp_args)
        return self._fused


def _in_activation_mode(method):
    """Run a forward method with the model's activation mode set for every kernel under it
    (linear() and the fused blocks read it: colibri.kernels.idot.current())."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with idot.activations(self.activations):
            return method(self, *args, **kwargs)
    return run


class DecoderModel:
    """Embedding -> decoder layers -> final norm -> lm_head. Families build the layers."""

    activations = "f32"  # or "int8" (EngineConfig.activations): int4 matrices' activations
    kv_cache = "f32"     # or "f16" (EngineConfig.kv_cache): the KV cache's element type
    build_mtp = None     # () -> the first multi-token-prediction layer, where the family has one (models/mtp.py)
    rows_hidden = None   # forward_rows' final hidden states (after the final norm) [B, D]: MTP drafts read them

    def __init__(self, args: ModelArgs, w, layers: list, rope: Rope):
        self.args = args
        self.layers = layers
        self.rope = rope
        self.embed = w.tensor("model.embed_tokens.weight")
        self.norm = w.tensor("model.norm.weight")
        self.lm_head = w.tensor("lm_head.weight") if w.has("lm_head.weight") else self.embed
        self.prefetch = False  # set by the engine when experts stream from disk
        self._kv_memo = None   # (rows' caches, typed lists of their K/V arrays per layer): _kv_lists
        self._program = None   # decode.token_layers' arguments, False where it does not cover the model

    @property
    def has_mtp(self) -> bool:
        return self.build_mtp is not None

    @functools.cached_property
    def mtp(self):
        """The MTP layer (models/mtp.MTPHead), built on first use; None where there is none."""
        return self.build_mtp() if self.build_mtp is not None else None

    def new_cache(self, max_tokens: int) -> KVCache:
        a = self.args
        return KVCache(len(self.layers), a.num_key_value_heads, a.head_dim, max_tokens, dtype=self.kv_cache)

    @_in_activation_mode
    def forward(self, ids: np.ndarray, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` [L] after the cache's current contents; returns logits [L or 1, V]."""
        ids = np.asarray(ids, dtype=np.int64)
        L, pos0 = ids.shape[0], cache.length
        cache.reserve(pos0 + L)
        t0 = clock() if PHASES.on else 0.0
        cos, sin = self.rope.cos_sin_at(pos0) if L == 1 else self.rope.cos_sin(np.arange(pos0, pos0 + L))
        x = embedding(self.embed, ids)  # [L, D]
        if t0:
            PHASES.add("embed", -1, t0)
        program = self._token_program() if L == 1 and not PHASES.on else None
        if program is not None:  # every layer in one compiled call (the phase clock times them one by one)
            x = self._token_layers(program, x, cache, pos0, cos, sin)
        else:
            for i, layer in enumerate(self.layers):
                if self.prefetch and isinstance(layer.mlp, RoutedMoE) and layer.mlp.wants_prefetch():
                    layer.mlp.prefetch_for(x, layer.post_norm, self.args.rms_norm_eps)
                x = layer(x, cache, i, pos0, cos, sin)
        cache.length = pos0 + L
        if not all_logits:
            x = x[-1:]
        t0 = clock() if PHASES.on else 0.0
        logits = linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head)
        if t0:
            PHASES.add("head", -1, t0)
        return logits

    def _token_program(self):
        """(a typed list of every layer's fused-block arguments, the arguments all layers share)
        when decode.token_layers covers the whole model: every layer a plain DecoderLayer whose
        attention and MLP the fused blocks cover, with the same shapes. None otherwise (MoE
        layers, MLA, non-int4 weights): the layers then run one by one. Built once."""
        if self._program is None:
            self._program = self._build_token_program() or False
        return self._program or None

    def _build_token_program(self):
        plain = all(type(layer).__call__ is DecoderLayer.__call__ and type(layer).attend_one is DecoderLayer.attend_one
                    and type(layer).mlp_one is DecoderLayer.mlp_one for layer in self.layers)
        if not plain or not self.layers:
            return None
        layers, shared = [], set()
        for layer in self.layers:
            attn_args, mlp_args = layer._fused if layer._fused is not None else layer._build_fused()
            if attn_args is None or mlp_args is None:
                return None
            eps, qkv, qkv_bias, o, o_bias, rot, h, kv, dh, scale, norms = attn_args
            code, q_norm, k_norm, norm_eps, clip = norms
            _, gate_up, n_inter, down = mlp_args
            shared.add((eps, rot, h, kv, dh, scale, code, norm_eps, clip, n_inter))
            layers.append((layer.input_norm, qkv, qkv_bias, o, o_bias, layer.post_norm, gate_up, down, q_norm, k_norm))
        if len(shared) != 1:
            return None
        unmanaged = decode.unmanaged_layer_list(layers[0])
        for layer in layers[1:]:
            decode.add_unmanaged_layer(unmanaged, layer)
        return unmanaged, shared.pop(), layers  # `layers` keeps the arrays the unmanaged list points to

    def _token_layers(self, program, x, cache, pos: int, cos, sin) -> np.ndarray:
        layers, (eps, rot, h, kv, dh, scale, code, norm_eps, clip, n_inter), _ = program
        kcs, vcs = cache.typed_lists()
        return decode.token_layers(x, layers, kcs, vcs, pos, np.ascontiguousarray(cos, np.float32),
                                   np.ascontiguousarray(sin, np.float32), rot, h, kv, dh, scale, eps, code, norm_eps,
                                   clip, n_inter, get_num_threads(), idot.marker(idot.current()))

    def _kv_lists(self, caches: list) -> list[tuple]:
        """Per layer, the K and V arrays of each row's cache as numba typed lists, for the fused
        attention of several rows; kept while the rows hold the same caches with the same arrays
        (a cache that grows replaces them): building them costs ~1 us per array, a step's worth
        ~0.3 ms on SmolLM2 at 4 rows."""
        key = [(c, c.k[0]) for c in caches]
        memo = self._kv_memo
        if memo is None or len(memo[0]) != len(key) or any(
                a is not b or ka is not kb for (a, ka), (b, kb) in zip(memo[0], key)):
            lists = []
            for i in range(len(self.layers)):
                ks, vs = List(), List()
                for c in caches:
                    ks.append(c.k[i])
                    vs.append(c.v[i])
                lists.append((ks, vs))
            self._kv_memo = memo = (key, lists)
        return memo[1]

    @_in_activation_mode
    def forward_rows(self, ids, caches: list) -> np.ndarray:
        """One token per row, row r continuing caches[r]; returns logits [B, V]. Rows may share
        a cache: they are then consecutive positions of one sequence, in row order (drafted
        tokens being verified). Different caches are different sequences (a batch).

        Layer by layer, each row goes through the operations forward([ids[r]], caches[r]) runs,
        in the same order (the multi-row kernels compute each row as the one-row kernels do), so
        its logits are the same bits as decoding that token alone: batching and speculation
        never change a token (tests/models/harness.py). What the rows share is the weights: the fused
        dense blocks and the head run all rows through the multi-row kernels, which unpack each
        int4 or int8 weight once for all of them (kernels/cpu.py, _tile_codegen), and a MoE
        layer's routed experts are read once for all rows (RoutedMoE.rows)."""
        pos, end = [], {}
        for c in caches:
            p = end.get(id(c), c.length)
            pos.append(p)
            end[id(c)] = p + 1
        for c in caches:
            c.reserve(end[id(c)])
        # Each row's angles as decoding it alone computes them.
        trig = [self.rope.cos_sin_at(p) for p in pos]
        cos = np.ascontiguousarray(np.concatenate([c for c, _ in trig]), np.float32)
        sin = np.ascontiguousarray(np.concatenate([s for _, s in trig]), np.float32)
        pos = np.asarray(pos, dtype=np.int64)
        x = embedding(self.embed, np.asarray(ids, dtype=np.int64))  # [B, D]
        program = self._token_program() if len(ids) == 1 and not PHASES.on else None
        if program is not None:  # one row: forward's one-call token, the same bits as the layers below
            x = self._token_layers(program, x, caches[0], int(pos[0]), cos, sin)
        else:
            kv_lists = self._kv_lists(caches) if len(ids) > 1 else None
            for i, layer in enumerate(self.layers):
                x = layer.attend_rows(x, caches, i, pos, cos, sin, kv_lists and kv_lists[i])
                x = layer.mlp_rows(x)
        for c in caches:
            c.length = end[id(c)]
        self.rows_hidden = h = rms_norm(x, self.norm, self.args.rms_norm_eps)
        return linear_rows(h, self.lm_head)
