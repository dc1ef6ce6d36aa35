"""The dense decoder on a CUDA device (EngineConfig.device): the weights and the KV cache live
in device memory, a forward pass sends token ids' embedding rows in and takes logits out, and
every step in between is a colibri.kernels.cuda kernel. Same math and order as
models/decoder.py's DecoderModel.forward (which stays the CPU path): RMSNorm, fused q/k/v, RoPE,
the cache, causal GQA attention, o_proj, SwiGLU MLP, final norm, lm_head.

Covered: models whose layers are models/attention.py's Attention (GQA with fused q/k/v, optional
q/k/v/o biases and q/k norms) and either the SwiGLU MLP with fused gate/up (the llama family) or
a RoutedMoE block (models/moe.py), softmax or grouped routing, with or without a (gated) shared expert
(Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5); and MLA models without the DSA indexer
(DeepSeek-V3, Kimi-K2): their compressed latent cache on the device, attention in the absorbed
form (scores and outputs in latent space, the cache never expanded), also for prefill. GLM-5's
sparse attention stays on the CPU: place() says so ("cuda") or keeps the CPU model ("auto").

MoE layers: the router runs on the host with the CPU model's own code (one row of D floats per
token comes back for it: the routing decisions are the CPU path's), the chosen experts on the
device from the VRAM tier (vram_experts.py: pinned hot set + LRU, misses copied up from the
RAM tier), and their weighted outputs are added in expert-id order, so the VRAM budget
never changes the tokens.
"""
from __future__ import annotations

import threading

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.ggml_blocks import BLOCK_TYPES
from colibri.kernels import embedding
from colibri.models import mla
from colibri.models.attention import Attention
from colibri.models.cache import KVCache, MLACache
from colibri.models.decoder import DecoderLayer, DecoderModel, in_activation_mode
from colibri.models.layers import MLP, linear, rms_norm
from colibri.models.moe import RoutedMoE
from colibri.placement.vram_experts import vram_budget

DEVICES = ("cpu", "cuda", "auto")


def unsupported(model) -> str | None:
    """Why `model` cannot run on the device, or None when it can."""
    if type(model) is mla.MLAModel:
        if model.index_dim:
            return "DeepSeek sparse attention (GLM-5's indexer)"
    elif type(model) is not DecoderModel:
        return f"{type(model).__name__} models"
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        if type(a) is mla.MLAttention:
            pass
        elif type(a) is not Attention or a.qkv is None or a.clip_qkv is not None:
            return "attention other than grouped-query attention with fused q/k/v"
        if isinstance(m, RoutedMoE):
            shared = getattr(m, "shared", None)
            if shared is not None and (type(shared) is not MLP or shared.gate_up is None):
                return "shared experts other than a SwiGLU MLP with fused gate/up"
        elif type(m) is not MLP or m.gate_up is None:
            return "feed-forward blocks other than a dense SwiGLU MLP with fused gate/up or routed experts"
    if any(getattr(p, "scheme", None) in BLOCK_TYPES for p in _device_weights(model)):
        return "GGUF block-quantized weights (Q4_K, Q6_K, IQ4_XS, ...)"
    return None


def _device_weights(model):
    """The matrices DeviceModel would upload: every layer's dense weights and the head (routed
    experts are checked where their blobs are uploaded: cuda.upload)."""
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        if type(a) is mla.MLAttention:
            yield from (a.q_a, a.q_b, a.kv_a, a.o_proj)
        else:
            yield from (a.qkv, a.o_proj)
        dense = getattr(m, "shared", None) if isinstance(m, RoutedMoE) else m
        if dense is not None:
            yield from (dense.gate_up, dense.down)
    yield model.lm_head


def check(device: str) -> None:
    """Fail early (before any weight is read) on a bad --device, or on cuda without a GPU."""
    if device not in DEVICES:
        raise ColibriError(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device == "cuda":
        from colibri.kernels import cuda

        cuda.require()


def layers_that_fit(model, budget: int) -> int:
    """How many leading layers' dense weights fit `budget` bytes of device memory, with the head
    (lm_head) counted against it too when every layer fits."""
    total = 0
    for i, layer in enumerate(model.layers):
        total += dense_bytes(layer)
        if total > budget:
            return i
    return len(model.layers) if total + model.lm_head.nbytes <= budget else len(model.layers) - 1


def dense_bytes(layer) -> int:
    """The bytes a decoder layer's dense weights take on the device (_DeviceLayer uploads them)."""
    a, m = layer.attn, layer.mlp
    if type(a) is mla.MLAttention:
        parts = [a.q_a, a.q_b, a.kv_a, a.o_proj, a.w_uk, a.w_uv_t]
    else:
        parts = [a.qkv, a.o_proj]
    dense = getattr(m, "shared", None) if isinstance(m, RoutedMoE) else m
    if dense is not None:
        parts += [dense.gate_up, dense.down]
    parts.append(getattr(m, "shared_gate", None))
    return sum(p.nbytes for p in parts if p is not None)


def place(model, device: str, container=None, experts=None, vram_bytes: int | None = None,
          history: dict | None = None, gpu_layers: int | None = None):
    """The model to run for EngineConfig.device: `model` itself on the CPU, or a DeviceModel
    wrapping it. "auto" picks a real GPU when one is present and covers the model. For a MoE
    model, `experts` (the host expert source, over `container`) feeds the VRAM tier of
    `vram_bytes` (None: what the device has free beside the dense weights), whose hot set
    follows the routing `history`. `gpu_layers`: how many leading layers run on the device (the
    rest, and the head, on the CPU); None: as many as its free memory holds."""
    check(device)
    if device == "cpu":
        return model
    from colibri.kernels import cuda

    if device == "auto" and (cuda.simulated() or not cuda.available() or unsupported(model) is not None):
        return model
    why = unsupported(model)
    if why is not None:
        raise ColibriError(f"--device cuda does not run {why} yet; use --device cpu")
    return DeviceModel(model, container, experts, vram_bytes, history, gpu_layers)


class DeviceKVCache:
    """KVCache's interface with K and V per layer in device memory, [KV, capacity, Dh] and
    [KV, capacity, Dv], grown by doubling up to max_tokens (the CPU cache's policy). MLA's
    compressed cache is one "head" of the latent (K, Dh = kv_lora_rank) and of the rope key
    (V, Dv = qk_rope_head_dim), as MLACache lays it out on the CPU."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 v_dim: int | None = None, host=None):
        from colibri.kernels import cuda

        self._cuda = cuda
        self.max_tokens = max_tokens
        self._length = 0
        # The CPU cache of the layers that run on the CPU (those after the device's; see
        # DeviceModel's gpu_layers), kept at the same length; None when every layer is here.
        self.host = host
        v_dim = head_dim if v_dim is None else v_dim
        self._dims = (num_kv_heads, head_dim, v_dim)
        cap = min(max_tokens, 256)
        self.k_dev = [cuda.empty((num_kv_heads, cap, head_dim)) for _ in range(num_layers)]
        self.v_dev = [cuda.empty((num_kv_heads, cap, v_dim)) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = n
        if self.host is not None:
            self.host.length = n

    @property
    def capacity(self) -> int:
        return self.k_dev[0].shape[1] if self.k_dev else self.max_tokens

    def reserve(self, n: int) -> None:
        if n > self.max_tokens:
            raise ColibriError(f"context full: {n} tokens needed, the context holds {self.max_tokens}")
        if self.host is not None:
            self.host.reserve(n)
        if n <= self.capacity:
            return
        cap = min(self.max_tokens, max(n, 2 * self.capacity))
        kvh, dk, dv = self._dims
        for store, d in ((self.k_dev, dk), (self.v_dev, dv)):
            for i, a in enumerate(store):
                grown = self._cuda.empty((kvh, cap, d))
                self._cuda.copy_positions(grown, a, self.length)
                store[i] = grown

    def truncate(self, n: int) -> None:
        self.length = min(self.length, n)

    def rewind(self, n: int) -> int:
        """Prefix reuse keeps any number of positions of a KV cache (models/cache.py KVCache.rewind)."""
        self.truncate(n)
        return self.length

    @property
    def bytes_per_token(self) -> int:
        kvh, dk, dv = self._dims
        return len(self.k_dev) * kvh * (dk + dv) * 4 + (self.host.bytes_per_token if self.host is not None else 0)

    @property
    def k(self):
        raise ColibriError("saving or loading a KV slot is not supported with --device cuda yet")

    v = k


class _DeviceLayer:
    """One decoder layer's weights on the device (a MoE layer's experts: the VRAM tier's)."""

    def __init__(self, layer: DecoderLayer):
        from colibri.kernels import cuda

        a, m = layer.attn, layer.mlp
        self.input_norm = cuda.upload_vector(layer.input_norm)
        self.post_norm = cuda.upload_vector(layer.post_norm)
        self.o_proj = cuda.upload(a.o_proj)
        self.o_bias = cuda.upload_vector(a.o_bias)
        self.mla = type(a) is mla.MLAttention
        if self.mla:
            self._mla(a, cuda)
        else:
            self.qkv = cuda.upload(a.qkv)
            self.qkv_bias = cuda.upload_vector(a.qkv_bias)
            self.q_norm = cuda.upload_vector(getattr(a, "q_norm", None))
            self.k_norm = cuda.upload_vector(getattr(a, "k_norm", None))
        self.moe = isinstance(m, RoutedMoE)
        dense = getattr(m, "shared", None) if self.moe else m  # a MoE block's shared expert, or the MLP
        self.gate_up = self.down = self.shared_gate = None
        if dense is not None:
            self.gate_up = cuda.upload(dense.gate_up)
            self.down = cuda.upload(dense.down)
            self.inter = dense.gate.shape[0]
        if getattr(m, "shared_gate", None) is not None:  # Qwen2-MoE: sigmoid(x W) scales the shared expert
            self.shared_gate = cuda.upload(m.shared_gate)
        self.nbytes = dense_bytes(layer)  # what was uploaded: the layer's dense weights

    def _mla(self, a: mla.MLAttention, cuda) -> None:
        """MLA's projections, norms and the per-head W_uk / W_uv^T (float32, as the CPU's
        absorbed form keeps them dequantized)."""
        self.q_a = cuda.upload(a.q_a) if a.q_a is not None else None
        self.q_a_bias = cuda.upload_vector(a.q_a_bias) if a.q_a is not None else None
        self.q_a_norm = cuda.upload_vector(a.q_a_norm) if a.q_a is not None else None
        self.q_b = cuda.upload(a.q_b)
        self.kv_a = cuda.upload(a.kv_a)
        self.kv_a_bias = cuda.upload_vector(a.kv_a_bias)
        self.kv_a_norm = cuda.upload_vector(a.kv_a_norm)
        self.w_uk = cuda.to_device(a.w_uk)      # [H, Dn, r]
        self.w_uv_t = cuda.to_device(a.w_uv_t)  # [H, r, Dv]


class DeviceModel:
    """DecoderModel's forward on the device. Other attributes (args, layers, rope,
    embed...) are the CPU model's: the engine and the bench read them as before."""

    def __init__(self, model: DecoderModel, container=None, experts=None, vram_bytes: int | None = None,
                 history: dict | None = None, gpu_layers: int | None = None):
        from colibri.kernels import cuda

        self._cuda = cuda
        self.cpu_model = model
        n = len(model.layers)
        if gpu_layers is None:  # as many leading layers as the device's free memory holds
            gpu_layers = layers_that_fit(model, vram_budget(cuda.free_bytes()))
        elif not 0 <= gpu_layers:
            raise ColibriError(f"--gpu-layers must be >= 0, not {gpu_layers}")
        self.gpu_layers = min(n, gpu_layers)
        self.device_layers = [_DeviceLayer(layer) for layer in model.layers[:self.gpu_layers]]
        # The head (final norm, lm_head) runs where the last layer does.
        self.lm_head = cuda.upload(model.lm_head) if self.gpu_layers == n else None
        self.final_norm = cuda.upload_vector(model.norm) if self.gpu_layers == n else None
        self.device_bytes = sum(d.nbytes for d in self.device_layers) + (self.lm_head.nbytes if self.lm_head else 0)
        self.activations = model.activations
        self.vram = None  # the VRAM tier of the routed experts (MoE models)
        if any(d.moe for d in self.device_layers):
            from colibri.placement.vram_experts import VramExperts

            if container is None or experts is None:
                raise ColibriError("a MoE model on the device needs its container and expert source")
            if vram_bytes is None:  # what the device has free beside the dense weights, less headroom
                vram_bytes = vram_budget(cuda.free_bytes())
            self.vram = VramExperts(container, experts, max(0, vram_bytes), history)
        self._buffers = {}
        self._lock = threading.Lock()  # one forward at a time: they share the scratch buffers

    def _buffer(self, name: str, shape: tuple):
        """A device scratch array reused by every layer and step while its shape holds: the
        kernels run in order on one stream, so a layer's use of it ends before the next one's
        begins, and the layers of a decode step allocate nothing."""
        b = self._buffers.get(name)
        if b is None or b.shape != shape:
            b = self._buffers[name] = self._cuda.empty(shape)
        return b

    def __getattr__(self, name):  # only reached for attributes DeviceModel does not have
        if name == "cpu_model":  # not set yet: __init__ failed part way
            raise AttributeError(name)
        return getattr(self.cpu_model, name)

    def new_cache(self, max_tokens: int) -> DeviceKVCache:
        """The KV cache where each layer runs: the device's layers in device memory, the rest
        (gpu_layers below the model's depth) in a CPU cache of their own."""
        a, k, rest = self.args, self.gpu_layers, len(self.layers) - self.gpu_layers
        if isinstance(self.cpu_model, mla.MLAModel):  # the compressed cache: latent + rope key
            host = MLACache(rest, a.kv_lora_rank, a.qk_rope_head_dim, max_tokens) if rest else None
            return DeviceKVCache(k, 1, a.kv_lora_rank, max_tokens, v_dim=a.qk_rope_head_dim, host=host)
        host = KVCache(rest, a.num_key_value_heads, a.head_dim, max_tokens) if rest else None
        return DeviceKVCache(k, a.num_key_value_heads, a.head_dim, max_tokens, host=host)

    def forward(self, ids: np.ndarray, cache: DeviceKVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` [L] after the cache's contents; returns logits [L or 1, V] (host)."""
        with self._lock:
            return self._forward(ids, cache, all_logits)

    def _forward(self, ids, cache: DeviceKVCache, all_logits: bool) -> np.ndarray:
        cu = self._cuda
        m = self.cpu_model
        ids = np.asarray(ids, dtype=np.int64)
        L, pos0 = ids.shape[0], cache.length
        cache.reserve(pos0 + L)
        trig = [np.ascontiguousarray(t, np.float32) for t in m.rope.cos_sin(np.arange(pos0, pos0 + L))]
        cos, sin = (cu.to_device(t) for t in trig)
        x = cu.to_device(embedding(m.embed, ids))  # [L, D]
        scores = self._buffer("scores", (L, m.args.num_attention_heads, cache.capacity)) if self.device_layers else None
        for i, (layer, dl) in enumerate(zip(m.layers, self.device_layers)):
            if dl.mla:
                self._mla_attention(x, layer.attn, dl, cache, i, pos0, cos, sin, scores)
            else:
                self._attention(x, layer.attn, dl, cache, i, pos0, cos, sin, scores)
            if dl.moe:
                self._moe(x, layer, dl)
            else:
                self._mlp(x, layer, dl)
        if self.lm_head is None:  # the layers after the device's, and the head, on the CPU
            logits = self._host_rest(cu.to_host(x), cache.host, pos0, *trig, all_logits)
            cache.length = pos0 + L
            return logits
        cache.length = pos0 + L
        if not all_logits:
            x = x[L - 1:]
        h = cu.rms_norm(x, self.final_norm, m.args.rms_norm_eps)
        return cu.to_host(cu.linear(self.lm_head, h, activations=self.activations))

    @in_activation_mode
    def _host_rest(self, x: np.ndarray, host, pos0: int, cos, sin, all_logits: bool) -> np.ndarray:
        """Layers gpu_layers.. and the head on the CPU, as DecoderModel.forward runs them; their
        cache is `host`, whose layer 0 is model layer gpu_layers."""
        m, k = self.cpu_model, self.gpu_layers
        for i, layer in enumerate(m.layers[k:]):
            x = layer(x, host, i, pos0, cos, sin)
        if not all_logits:
            x = x[-1:]
        return linear(rms_norm(x, m.norm, m.args.rms_norm_eps), m.lm_head)

    def _attention(self, x, attn: Attention, dl: _DeviceLayer, cache, i, pos0, cos, sin, scores) -> None:
        """x += o_proj(attention(rms_norm(x))), the new keys and values into the cache."""
        cu = self._cuda
        L = x.shape[0]
        h = cu.rms_norm(x, dl.input_norm, attn.eps, out=self._buffer("h", x.shape))
        qkv = cu.linear(dl.qkv, h, out=self._buffer("qkv", (L, dl.qkv.shape[0])), bias=dl.qkv_bias,
                        activations=self.activations)  # [L, (H + 2 KV) * Dh]
        nq, nk = attn.h * attn.dh, attn.kv * attn.dh
        if attn.qk_norm == "head":  # each head over its Dh (Qwen3)
            cu.head_norm(qkv, 0, attn.h, attn.dh, dl.q_norm, attn.eps)
            cu.head_norm(qkv, nq, attn.kv, attn.dh, dl.k_norm, attn.eps)
        elif attn.qk_norm == "full":  # q and k each over all their heads (OLMoE)
            cu.head_norm(qkv, 0, 1, nq, dl.q_norm, attn.eps)
            cu.head_norm(qkv, nq, 1, nk, dl.k_norm, attn.eps)
        rot = attn.rope.rotary_dim
        cu.rope(qkv, 0, attn.h, attn.dh, cos, sin, rot)
        cu.rope(qkv, nq, attn.kv, attn.dh, cos, sin, rot)
        cu.kv_store(cache.k_dev[i], qkv, nq, pos0)
        cu.kv_store(cache.v_dev[i], qkv, nq + nk, pos0)
        out = cu.attend(qkv, attn.h, cache.k_dev[i], cache.v_dev[i], pos0, attn.scale, scores,
                        out=self._buffer("attn", (L, nq)))  # [L, H * Dh]
        cu.add_into(x, cu.linear(dl.o_proj, out, out=self._buffer("o", x.shape), bias=dl.o_bias,
                                 activations=self.activations))

    def _mla_attention(self, x, attn: mla.MLAttention, dl: _DeviceLayer, cache, i, pos0, cos, sin, scores) -> None:
        """x += o_proj(MLA(rms_norm(x))) in the absorbed form, as MLAttention._absorbed: the
        latent and rope key of the new positions into the cache, q_nope taken into latent space
        through W_uk, attention over the latents (kernels.mla_attend), W_uv, o_proj."""
        cu = self._cuda
        L = x.shape[0]
        H, r, R, dn = attn.h, attn.r, attn.rope_dim, attn.dn
        act = self.activations
        h = cu.rms_norm(x, dl.input_norm, self.cpu_model.layers[i].eps, out=self._buffer("h", x.shape))
        if dl.q_a is not None:  # q_a_layernorm: RMSNorm's default eps, as in transformers
            qa = cu.linear(dl.q_a, h, bias=dl.q_a_bias, activations=act)
            q = cu.linear(dl.q_b, cu.rms_norm(qa, dl.q_a_norm, 1e-6), activations=act)
        else:
            q = cu.linear(dl.q_b, h, activations=act)  # [L, H * (Dn + R)]
        q_rope = cu.rope_copy(q, dn, H, dn + R, cos, sin, R, attn.interleave, attn.scale)  # [L, H, R]
        q_lat = cu.head_matmul(q, 0, dn + R, dl.w_uk, attn.scale)                       # [L, H, r]
        ckv = cu.linear(dl.kv_a, h, bias=dl.kv_a_bias, activations=act)                  # [L, r + R]
        cu.head_norm(ckv, 0, 1, r, dl.kv_a_norm, 1e-6)  # the latent part, in place
        cu.kv_store(cache.k_dev[i], ckv, 0, pos0)
        k_rope = cu.rope_copy(ckv, r, 1, 0, cos, sin, R, attn.interleave)               # [L, 1, R]
        cu.kv_store(cache.v_dev[i], k_rope.reshape(L, R), 0, pos0)
        o_lat = cu.mla_attend(q_lat, q_rope, cache.k_dev[i][0], cache.v_dev[i][0], pos0, scores)  # [L, H, r]
        out = cu.head_matmul(o_lat.reshape(L, H * r), 0, r, dl.w_uv_t)                  # [L, H, Dv]
        cu.add_into(x, cu.linear(dl.o_proj, out.reshape(L, H * attn.dv), out=self._buffer("o", x.shape),
                                 bias=dl.o_bias, activations=act))

    def _mlp(self, x, layer: DecoderLayer, dl: _DeviceLayer) -> None:
        """x += down(silu(gate(h)) * up(h)), h = rms_norm(x)."""
        h = self._cuda.rms_norm(x, dl.post_norm, layer.eps, out=self._buffer("h", x.shape))
        self._cuda.add_into(x, self._swiglu(h, dl))

    def _swiglu(self, h, dl: _DeviceLayer):
        """down(silu(gate(h)) * up(h)) with the layer's dense MLP or shared expert -> [L, D]."""
        cu = self._cuda
        L = h.shape[0]
        gu = cu.linear(dl.gate_up, h, out=self._buffer("gu", (L, 2 * dl.inter)),
                       activations=self.activations)  # [L, 2I]
        act = cu.silu_mul(gu, dl.inter, out=self._buffer("act", (L, dl.inter)))
        return cu.linear(dl.down, act, out=self._buffer("o", h.shape), activations=self.activations)

    def _moe(self, x, layer: DecoderLayer, dl: _DeviceLayer) -> None:
        """x += the routed experts' weighted sum for h = rms_norm(x) (+ the shared expert): routed
        on the host (the CPU model's router), each chosen expert applied on the device to the
        rows that chose it, in the order the VRAM tier has them (hits first), added in
        expert-id order, then the shared expert added, as RoutedMoE.__call__ does."""
        cu = self._cuda
        mlp = layer.mlp
        L, D = x.shape
        h = cu.rms_norm(x, dl.post_norm, layer.eps, out=self._buffer("h", x.shape))
        weights, ids = mlp.route(cu.to_host(h))  # [L, K] each
        parts = {}
        for e, expert in self.vram.experts(mlp.prefix, np.unique(ids).tolist()):
            tok, slot = np.nonzero(ids == e)
            rows = cu.to_device(tok.astype(np.int64))
            xe = cu.gather_rows(h, rows)
            act = cu.silu_mul(cu.linear(expert.gate_up, xe, activations=self.activations), expert.inter)
            parts[e] = (rows, cu.to_device(weights[tok, slot].astype(np.float32)),
                        cu.linear(expert.down, act, activations=self.activations))
        out = cu.zeros((L, D), out=self._buffer("moe", (L, D)))
        for e in sorted(parts):
            rows, scales, y = parts[e]
            cu.scatter_add_scaled(out, y, rows, scales)
        if dl.gate_up is not None:
            shared = self._swiglu(h, dl)
            if dl.shared_gate is not None:
                gate = cu.linear(dl.shared_gate, h, out=self._buffer("shared_gate", (L, 1)),
                                 activations=self.activations)
                cu.sigmoid_scale_rows(shared, gate)
            cu.add_into(out, shared)
        cu.add_into(x, out)

    def forward_rows(self, ids, caches: list) -> np.ndarray:
        """One token per row, row r continuing caches[r] (rows sharing a cache are its next
        positions, in row order): each row is decoded alone, in order, so its logits are the
        ones forward([ids[r]]) gives."""
        return np.concatenate([self.forward(np.array([t], dtype=np.int64), c) for t, c in zip(ids, caches)])
