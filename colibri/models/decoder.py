"""The decoder: a layer (attention block, feed-forward block, their norms) and the model
(embedding -> layers -> final norm -> lm_head), with the fused one-call decode paths, and
`build_decoder`, which every family calls with its pieces (docs/design.md section 5).

Shape letters: L tokens, D hidden, B rows, V vocabulary.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from numba import get_num_threads

from colibri.kernels import decode, embedding, idot
from colibri.kernels.cpu import int4_weight
from colibri.models import mtp
from colibri.models.args import ModelArgs
from colibri.models.attention import Attention
from colibri.models.cache import KVCache
from colibri.models.layers import MLP, linear, linear_rows, rms_norm
from colibri.models.moe import RoutedMoE
from colibri.models.rope import Rope, build_rope
from colibri.profile import PHASES, clock


class QKNorms(NamedTuple):
    """The q/k norms and clipping of a fused attention block (decode.attention_block's last
    arguments)."""

    code: int                # decode.QK_NORM_CODES[Attention.qk_norm]
    q_norm: np.ndarray       # float32, empty when there is none
    k_norm: np.ndarray
    eps: np.float32
    clip: np.float32         # inf: no clipping


class FusedAttention(NamedTuple):
    """A layer's attention block as decode.attention_block / attention_rows take it."""

    eps: np.float32          # the input norm's
    qkv: object              # fused int4 q/k/v (kernels.cpu.int4_weight)
    qkv_bias: np.ndarray     # float32, empty when there is none
    o: object                # int4 o_proj
    o_bias: np.ndarray
    rotary_dim: int
    h: int
    kv: int
    dh: int
    scale: np.float32
    norms: QKNorms


class FusedMLP(NamedTuple):
    """A layer's dense SwiGLU MLP as decode.mlp_block / mlp_rows take it."""

    eps: np.float32          # the post-attention norm's
    gate_up: object          # fused int4 gate/up
    inter: int               # intermediate size
    down: object


class TokenShapes(NamedTuple):
    """What every layer of a token program shares (decode.token_layers' scalar arguments)."""

    eps: np.float32
    rotary_dim: int
    h: int
    kv: int
    dh: int
    scale: np.float32
    qk_norm_code: int
    qk_norm_eps: np.float32
    clip: np.float32
    inter: int


class TokenProgram(NamedTuple):
    """decode.token_layers' arguments for a whole model, built once (DecoderModel._token_program)."""

    layers: object           # numba typed list of every layer's arrays (decode.unmanaged_layer_list)
    shapes: TokenShapes
    arrays: list             # the per-layer tuples the unmanaged list points into, kept alive


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
                norms = QKNorms(decode.QK_NORM_CODES[attn.qk_norm], f32(getattr(attn, "q_norm", None)),
                                f32(getattr(attn, "k_norm", None)), np.float32(attn.eps),
                                np.float32(np.inf if attn.clip_qkv is None else attn.clip_qkv))
                attn_args = FusedAttention(eps, qkv, f32(attn.qkv_bias), o, f32(attn.o_bias), attn.rope.rotary_dim,
                                           attn.h, attn.kv, attn.dh, attn.scale, tuple(norms))
        if type(mlp) is MLP and mlp.gate_up is not None:
            gate_up, down = int4_weight(mlp.gate_up), int4_weight(mlp.down)
            if gate_up is not None and down is not None:
                mlp_args = FusedMLP(eps, gate_up, mlp.gate.shape[0], down)
        # Kept as plain tuples, in the fields' order: the per-token calls above unpack them, and a
        # NamedTuple (a tuple subclass) unpacks on CPython's generic path, ~3x slower.
        self._fused = (attn_args and tuple(attn_args), mlp_args and tuple(mlp_args))
        return self._fused


def in_activation_mode(method):
    """Run a forward method with the model's activation mode set for every kernel under it
    (linear() and the fused blocks read it: colibri.kernels.idot.current())."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with idot.activations(self.activations):
            return method(self, *args, **kwargs)
    return run


class DecoderModel:
    """Embedding -> decoder layers -> final norm -> lm_head. Families build the layers."""

    activations = "f32"  # or "int8" (EngineConfig.activations): the quantized matrices' activations
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
        # Guess layer i + prefetch_depth's experts (and refresh layer i's) as layer i starts:
        # set by the engine (EngineConfig.prefetch_depth); 0 guesses each layer only at its start.
        self.prefetch_depth = 1
        self._kv_memo = None   # (rows' caches, typed lists of their K/V arrays per layer): _kv_lists
        self._program = None   # decode.token_layers' arguments, False where it does not cover the model
        self._parts = None     # (layers' fused-block tuples, shapes) of _token_parts, False: not covered
        # A threading.Event while token_layers' kernels are being compiled elsewhere (a first
        # start, colibri.warmup): until it is set, a token runs decode.token_steps (the same bits).
        self.program_wait = None

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

    @in_activation_mode
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
        one = self._one_token(x, cache, pos0, cos, sin) if L == 1 and not PHASES.on else None
        if one is not None:  # every layer in one compiled call (the phase clock times them one by one)
            x = one
        else:
            for i, layer in enumerate(self.layers):
                if self.prefetch:
                    self._guess_experts(i, x)
                x = layer(x, cache, i, pos0, cos, sin)
        cache.length = pos0 + L
        if not all_logits:
            x = x[-1:]
        t0 = clock() if PHASES.on else 0.0
        logits = linear(rms_norm(x, self.norm, self.args.rms_norm_eps), self.lm_head)
        if t0:
            PHASES.add("head", -1, t0)
        return logits

    def _guess_experts(self, i: int, x: np.ndarray) -> None:
        """As layer i starts on x: guess the experts of MoE layer i + prefetch_depth, and of
        layer i itself (a second, closer guess), by routing x with their routers, so the store
        reads them while the layers between compute (a wrong guess costs a read, never a token:
        the layer routes on its own input when it runs). The first layer also guesses every
        layer up to the depth."""
        depth = self.prefetch_depth
        for j in sorted({i, i + depth} if i else set(range(depth + 1))):
            mlp = self.layers[j].mlp if j < len(self.layers) else None
            if isinstance(mlp, RoutedMoE) and mlp.wants_prefetch():
                mlp.prefetch_for(x, self.layers[j].post_norm, self.args.rms_norm_eps)

    def _one_token(self, x, cache, pos: int, cos, sin):
        """x [1, D] through every layer in one compiled call (decode.token_layers), or, while
        its kernels are being compiled elsewhere (program_wait), through decode.token_steps;
        None where neither covers the model."""
        program = self._token_program()
        if program is not None:
            return self._token_layers(program, x, cache, pos, cos, sin)
        parts = self._token_parts()
        if parts is None:
            return None
        layers, (eps, rot, h, kv, dh, scale, code, norm_eps, clip, n_inter) = parts
        return decode.token_steps(x, layers, cache.k, cache.v, pos, np.ascontiguousarray(cos, np.float32),
                                  np.ascontiguousarray(sin, np.float32), rot, h, kv, dh, scale, eps, code, norm_eps,
                                  clip, n_inter, idot.marker(idot.current()))

    def _token_program(self):
        """A TokenProgram (as a plain tuple: every layer's fused-block arrays as a typed list, the
        arguments all layers share) when decode.token_layers covers the whole model: every layer a plain DecoderLayer whose
        attention and MLP the fused blocks cover, with the same shapes. None otherwise (MoE
        layers, MLA, non-int4 weights): the layers then run one by one. Built once; None too
        while program_wait is not set (its kernels are still being compiled elsewhere)."""
        if self.program_wait is not None and not self.program_wait.is_set():
            return None
        if self._program is None:
            self._program = self._build_token_program() or False
        return self._program or None

    def _token_parts(self):
        """(every layer's fused-block arrays as plain tuples, the shapes all layers share: a
        TokenShapes tuple) when decode.token_layers covers the whole model, else None. Built
        once, without compiling anything."""
        if self._parts is None:
            self._parts = self._build_token_parts() or False
        return self._parts or None

    def _build_token_parts(self):
        plain = all(type(layer).__call__ is DecoderLayer.__call__ and type(layer).attend_one is DecoderLayer.attend_one
                    and type(layer).mlp_one is DecoderLayer.mlp_one for layer in self.layers)
        if not plain or not self.layers:
            return None
        layers, shared = [], set()
        for layer in self.layers:
            a, m = layer._fused if layer._fused is not None else layer._build_fused()
            if a is None or m is None:
                return None
            a, m = FusedAttention._make(a), FusedMLP._make(m)
            n = QKNorms._make(a.norms)
            shared.add(TokenShapes(a.eps, a.rotary_dim, a.h, a.kv, a.dh, a.scale, n.code, n.eps, n.clip, m.inter))
            layers.append((layer.input_norm, a.qkv, a.qkv_bias, a.o, a.o_bias, layer.post_norm, m.gate_up, m.down,
                           n.q_norm, n.k_norm))
        if len(shared) != 1:
            return None
        return layers, tuple(shared.pop())  # plain tuples: see _build_fused

    def _build_token_program(self):
        parts = self._token_parts()
        if parts is None:
            return None
        layers, shapes = parts
        unmanaged = decode.unmanaged_layer_list(layers[0])
        for layer in layers[1:]:
            decode.add_unmanaged_layer(unmanaged, layer)
        return tuple(TokenProgram(unmanaged, shapes, layers))  # plain tuples: see _build_fused

    def token_plans(self, cache, nthreads: int) -> tuple[list, list] | None:
        """For a one-token forward at `cache`'s end: ([(kernel, arguments)] of decode.token_steps,
        [(kernel, numba signature)] of decode.token_layers), what each compiles, found without
        compiling or running anything (colibri.warmup compiles them in a process of its own);
        None where neither covers the model."""
        parts = self._token_parts()
        if parts is None:
            return None
        layers, (eps, rot, h, kv, dh, scale, code, norm_eps, clip, n_inter) = parts
        pos = cache.length
        cache.reserve(pos + 1)
        cos, sin = (np.ascontiguousarray(a, np.float32) for a in self.rope.cos_sin_at(pos))
        x = np.zeros((1, self.args.hidden_size), np.float32)
        act = idot.marker(self.activations)
        calls = []
        decode.token_steps(x, layers[:1], cache.k, cache.v, pos, cos, sin, rot, h, kv, dh, scale, eps, code,
                           norm_eps, clip, n_inter, act, call=lambda kernel, *args: calls.append((kernel, args)))
        return calls, decode.token_layers_signatures(x, layers, cache.k, cache.v, pos, cos, sin, rot, h, kv, dh,
                                                     scale, eps, code, norm_eps, clip, n_inter, nthreads, act)

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
                ks, vs = decode.array_list(caches[0].k[i]), decode.array_list(caches[0].v[i])
                for c in caches[1:]:
                    decode.add_array(ks, c.k[i])
                    decode.add_array(vs, c.v[i])
                lists.append((ks, vs))
            self._kv_memo = memo = (key, lists)
        return memo[1]

    @in_activation_mode
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
        one = self._one_token(x, caches[0], int(pos[0]), cos, sin) if len(ids) == 1 and not PHASES.on else None
        if one is not None:  # one row: forward's one-call token, the same bits as the layers below
            x = one
        else:
            kv_lists = self._kv_lists(caches) if len(ids) > 1 else None
            for i, layer in enumerate(self.layers):
                t0 = clock() if PHASES.on else 0.0
                x = layer.attend_rows(x, caches, i, pos, cos, sin, kv_lists and kv_lists[i])
                if t0:
                    PHASES.add("attention", i, t0)
                    t0 = clock()
                x = layer.mlp_rows(x)
                if t0:
                    PHASES.add("ffn", i, t0)
        for c in caches:
            c.length = end[id(c)]
        t0 = clock() if PHASES.on else 0.0
        self.rows_hidden = h = rms_norm(x, self.norm, self.args.rms_norm_eps)
        logits = linear_rows(h, self.lm_head)
        if t0:
            PHASES.add("head", -1, t0)
        return logits


def build_decoder(args: ModelArgs, weights, attention, moe=None, *, rope_head_dim: int | None = None,
                  model=DecoderModel, mtp_cache=None, mtp_layout: mtp.MTPLayout = mtp.DEEPSEEK,
                  **model_kw) -> DecoderModel:
    """The decoder every family builds, from the family's pieces:

    - `args`: its ModelArgs (args.mlp_kind(i) says "dense" or "moe" per layer);
    - `attention(i, prefix, rope)`: layer i's attention block at `prefix` ("model.layers.{i}.self_attn");
    - `moe(i, prefix)`: layer i's MoE block, `prefix` the layer's ("model.layers.{i}"); dense
      layers get the SwiGLU MLP at "{prefix}.mlp";
    - `rope_head_dim`: the head width the rope rotates (MLA: qk_rope_head_dim), else args.head_dim;
    - `model`: the DecoderModel class (MLA's: MLAModel), given `model_kw` too;
    - `mtp_cache(n)`: a one-layer cache for the first multi-token-prediction layer, where the family
      has one (models/mtp.py; the layer is built as layer num_hidden_layers, on first use), and
      `mtp_layout` how the family names and wires it (mtp.MTPLayout)."""
    rope = build_rope(args, head_dim=rope_head_dim)

    def layer(i: int) -> DecoderLayer:
        p = f"model.layers.{i}"
        attn = attention(i, f"{p}.self_attn", rope)
        mlp = moe(i, p) if args.mlp_kind(i) == "moe" else MLP.from_weights(weights, f"{p}.mlp")
        return DecoderLayer(args, attn, mlp, p, weights)

    built = model(args, weights, [layer(i) for i in range(args.num_hidden_layers)], rope, **model_kw)
    if mtp_cache is not None:
        mtp.attach(built, args, weights, layer, mtp_cache, mtp_layout)
    return built
