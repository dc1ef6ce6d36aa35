"""DeepSeek V4 (`deepseek_v4`: V4-Flash, V4-Pro); after transformers'
models/deepseek_v4/modeling_deepseek_v4.py.

What sets it apart from the other families, and where each part lives here:

- Attention (`V4Attention`): one shared key=value head (MQA), a low-rank query with an
  unweighted per-head RMSNorm, partial *interleaved* rope on each head's trailing dims, learned
  per-head sinks, the output's rope slice rotated back by the query's angle, and a grouped
  low-rank output projection (o_a per head group, then o_b). Every layer sees a sliding window
  of plain keys; "compressed" layers see long-range entries besides:
  - heavily compressed attention (HCA): one entry per `m'` tokens (128), a softmax-gated sum of
    the window's projected rows, every entry of a finished window visible;
  - compressed sparse attention (CSA): one entry per `m` tokens (4) over two overlapping
    windows, of which the lightning indexer picks the `index_topk` best per query.
- The residual is `hc_mult` parallel streams (mHC, `HyperConnection`): each block reads a mix of
  them, and its output goes back into each stream beside a Sinkhorn-normalised mixing of the
  streams; a last mix (`hc_head`) collapses them before the final norm.
- MoE (`V4MoE`): sqrt(softplus) (or sigmoid / softmax) scores, a correction bias that steers the
  choice, always-normalised weights times routed_scaling_factor, one shared expert, a SwiGLU
  whose gate and up are clipped at swiglu_limit; the first layers route by token id alone
  (`hash_moe`: a fixed tid2eid table), so their experts are known before the layer runs and a
  streamed model reads them ahead (V4Model.forward).

The compressors' state: transformers keeps a running buffer, the overlap slice and the entries,
which cannot be cut back. Here the cache (`V4Cache`) keeps each position's projected compressor
rows in a ring of the last two windows plus a slack, and a window's entry once its rows are
complete: an entry depends only on the rows of its window (and the one before), so the cache
cuts back exactly to any length whose unfinished windows' rows the ring still holds (drafts, a
re-rendered end of a turn), and every path computes an entry with the same call on the same
rows (the same bits).

Shape letters: L tokens, N keys, E compressed entries, D hidden, H heads, Dh head dim, R rotated
dims, S streams (hc_mult), m compression rate, C compressor width, I expert intermediate size.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from colibri.errors import ColibriError
from colibri.formats.qtensor import dequantize
from colibri.kernels import embedding, ops
from colibri.kernels.attention import seen_index, seen_rows
from colibri.kernels.moe import ExpertActivation
from colibri.models.args import ModelArgs as BaseModelArgs
from colibri.models.cache import KVCache
from colibri.models.decoder import DecoderModel, in_activation_mode
from colibri.models.hyper_connections import HyperConnection, merge
from colibri.models.layers import clipped_swiglu, linear, rms_norm, sigmoid, softmax, unweighted_rms
from colibri.models.moe import RoutedMoE, layer_index
from colibri.models.rope import Rope, build_rope
from colibri.plan.shapes import v4_schedule
from colibri.memory import huge_arrays
from colibri.profile import PHASES, clock
from colibri.workspace import V4_ROW_SLACK

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
QUERY_BLOCK = 256  # queries whose scores are held at once, at most


@dataclass
class ModelArgs(BaseModelArgs):
    """config.json fields (defaults: transformers' DeepseekV4Config, V4-Flash)."""

    num_key_value_heads: int | None = 1
    q_lora_rank: int = 1024
    moe_intermediate_size: int = 2048
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int | None = 1
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    layer_types: list | None = None
    compress_rates: dict | None = None
    compress_rope_theta: float = 160000.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: list | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int | None = 1  # MTP layers: kept by convert, not run here
    partial_rotary_factor: float | None = None
    qk_rope_head_dim: int | None = None
    mlp_bias: bool = False

    def __post_init__(self):
        super().__post_init__()
        n = self.num_hidden_layers
        # the schedule as DeepseekV4Config derives it, legacy fields included (shared with the planner)
        self.layer_types, self.mlp_layer_types, self.compress_rates = v4_schedule(
            {**self.extra, "num_hidden_layers": n, "layer_types": self.layer_types,
             "mlp_layer_types": self.mlp_layer_types, "compress_rates": self.compress_rates})
        for name, types, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) < n or set(types[:n]) - set(allowed):
                raise ColibriError(f"config field {name}={types!r} is not implemented (one of "
                                   f"{', '.join(allowed)} per layer)")
        if self.qk_rope_head_dim is None:
            factor = self.partial_rotary_factor if self.partial_rotary_factor is not None else 64 / 512
            self.qk_rope_head_dim = int(self.head_dim * factor)
        self.partial_rotary_factor = self.qk_rope_head_dim / self.head_dim
        self._check()

    def _check(self) -> None:
        def bad(field: str, why: str):
            raise ColibriError(f"config field {field}={getattr(self, field, self.extra.get(field))!r} {why}")

        if self.num_key_value_heads != 1:
            bad("num_key_value_heads", "is not implemented for deepseek_v4 (one shared key=value head)")
        for field in ("attention_bias", "mlp_bias"):
            if getattr(self, field):
                bad(field, "is not implemented for deepseek_v4")
        if self.scoring_func not in SCORING_FUNCS:
            bad("scoring_func", f"is not implemented (one of {', '.join(SCORING_FUNCS)})")
        if self.n_shared_experts not in (None, 1):
            bad("n_shared_experts", "is not implemented (DeepSeek V4 has one shared expert)")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            bad("num_experts_per_tok", f"must be between 1 and n_routed_experts={self.n_routed_experts}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            bad("o_groups", f"must divide num_attention_heads * head_dim = {self.num_attention_heads * self.head_dim}")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            bad("qk_rope_head_dim", "must be even and fit in head_dim and index_head_dim")
        for kind, rate in self.compress_rates.items():
            if kind not in (CSA, HCA) or not isinstance(rate, int) or rate < 1:
                raise ColibriError(f"config field compress_rates={self.compress_rates!r} is not implemented "
                                   f"(a positive rate for {CSA} and {HCA})")
        if self.sliding_window < 1 or self.hc_mult < 1 or self.index_topk < 1 or self.hc_sinkhorn_iters < 1:
            raise ColibriError("config fields sliding_window, hc_mult, hc_sinkhorn_iters and index_topk must be "
                               "positive")
        if self.extra.get("quantization_config"):
            bad("quantization_config", "is read by `colibri convert` (FP8 weights dequantized, FP4 experts kept "
                "as MXFP4), not by the model: run the container it writes")

    def mlp_kind(self, layer: int) -> str:
        return "moe"

    def ropes(self) -> dict[str, Rope]:
        """The two rope tables: "main" (sliding layers) and "compress" (CSA / HCA layers, their
        compressors and indexer), as DeepseekV4Config builds rope_parameters."""
        p = dict(self.rope_parameters or {})
        if isinstance(p.get("main"), dict) and isinstance(p.get("compress"), dict):
            params = {"main": dict(p["main"]), "compress": dict(p["compress"])}
        else:
            flat = {**(self.rope_scaling or {}), **{k: v for k, v in p.items() if k not in ("main", "compress")}}
            params = {"main": {"rope_type": "default", "rope_theta": self.rope_theta or 10000.0},
                      "compress": {**flat, "rope_theta": self.compress_rope_theta}}
            params["compress"].setdefault("rope_type", flat.get("type", "default"))
            if params["compress"]["rope_type"] == "yarn":
                params["compress"].setdefault("attention_factor", 1.0)
        ropes = {}
        for kind, q in params.items():
            q["partial_rotary_factor"] = self.partial_rotary_factor
            q.setdefault("rope_type", "default")
            source = SimpleNamespace(rope_params=lambda q=q: q, max_position_embeddings=self.max_position_embeddings)
            ropes[kind] = build_rope(source, head_dim=self.head_dim)
        return ropes

    def rate(self, layer: int) -> int:
        """The layer's compression rate m (0: sliding only)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    def row_width(self, layer: int) -> int:
        """Floats a position keeps for layer `layer`'s compressors (V4Cache): kv and gate
        projections, two series each for CSA, plus the indexer's."""
        kind = self.layer_types[layer]
        if kind == HCA:
            return 2 * self.head_dim
        if kind == CSA:
            return 4 * self.head_dim + 4 * self.index_head_dim
        return 0


# ----------------------------------------------------------------------------- numerics
def interleaved_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [L, ..., Dh] with its trailing R dims rotated in pairs (2i, 2i+1) by angle i (V4's
    interleaved rope); cos / sin [L, R/2] (negate sin to rotate back). A new array."""
    R = 2 * cos.shape[-1]
    out = np.array(x, dtype=np.float32)
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    even, odd = x[..., -R::2].astype(np.float32), x[..., -R + 1::2].astype(np.float32)
    out[..., -R::2] = even * c - odd * s
    out[..., -R + 1::2] = odd * c + even * s
    return out


def half_angles(rope: Rope, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [L, R/2] at `positions` (one per rotated pair)."""
    if positions.shape[0] == 1:
        cos, sin = rope.cos_sin_at(int(positions[0]))
    else:
        cos, sin = rope.cos_sin(positions)
    half = rope.rotary_dim // 2
    return cos[:, :half], sin[:, :half]


def score(logits: np.ndarray, func: str) -> np.ndarray:
    """Router scores [L, E] from logits: sqrt(softplus) (torch's softplus: x itself past 20),
    sigmoid or softmax."""
    x = logits.astype(np.float32)
    if func == "sqrtsoftplus":
        with np.errstate(over="ignore"):
            soft = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, np.float32(20)))))
        return np.sqrt(soft).astype(np.float32)
    return sigmoid(x) if func == "sigmoid" else softmax(x, -1)


# ----------------------------------------------------------------------------- the cache
ROW_SLACK = V4_ROW_SLACK  # positions of compressor rows kept beyond two windows: how far back a cut stays exact


class V4Cache(KVCache):
    """A sequence's cache. Per layer: K [1, N, Dh], the rope'd key=value row of every position
    (a sliding window reads the last few; keeping all makes any cut exact for them, at one
    head's K per position); the compressed entries of every finished window (`entries`,
    appended as windows finish, saved with a slot); and V [1, RING, W], each position's
    compressor rows (kv and raw gate projections, ModelArgs.row_width) in a ring of the last
    RING = 2 * (largest rate) + ROW_SLACK positions: a window's entry needs its own rows and,
    for CSA, the window before.

    An entry depends only on those rows, so the cache can be cut back to n exactly while the
    ring still holds the rows n's unfinished windows need (`exact(n)`): a rejected draft, a
    re-rendered end of a conversation. Further back, `rewind` starts over (0) and `truncate`
    refuses, as a recurrent state's cache does (models/recurrent.py)."""

    def __init__(self, args: ModelArgs, max_tokens: int, dtype: str = "f32", slack: int | None = None):
        if dtype != "f32":
            raise ColibriError("--kv-cache f16 is not implemented for deepseek_v4 (its compressors read float32 "
                               "rows)")
        n = args.num_hidden_layers
        self._widths = [args.row_width(i) for i in range(n)]
        self._rates = {i: args.rate(i) for i in range(n) if args.rate(i)}
        self._overlap = {i for i in self._rates if args.layer_types[i] == CSA}
        self._index_dim = args.index_head_dim
        self.ring = 2 * max(self._rates.values(), default=0) + (ROW_SLACK if slack is None else slack)
        super().__init__(n, 1, args.head_dim, max_tokens)
        self._low = {i: 0 for i in self._rates}  # per compressed layer: the oldest position whose rows the ring holds
        # (layer, "kv" | "index") -> [capacity, C] rows, the first _counts[key] of them the
        # entries of the windows finished so far (grown by doubling: a step appends one)
        self._entries: dict[tuple[int, str], np.ndarray] = {}
        self._counts: dict[tuple[int, str], int] = {}

    def _arrays(self, num_layers: int, cap: int) -> tuple[list, list]:
        """K arrays [1, cap, Dh] and the rings [1, RING, W] (a fixed size, whatever cap)."""
        arrays = huge_arrays([((1, cap, self._shape[1]), np.float32)] * num_layers
                             + [((1, self.ring, w), np.float32) for w in self._widths])
        return arrays[:num_layers], arrays[num_layers:]

    def _grow(self, cap: int) -> None:
        """Grow K; the rings keep their size and contents."""
        grown = huge_arrays([((1, cap, self._shape[1]), np.float32)] * len(self.k))
        for old, new in zip(self.k, grown):
            new[:, :self.length] = old[:, :self.length]
        self.k = grown

    # -- compressor rows -------------------------------------------------------------------
    def write_rows(self, layer: int, pos0: int, rows: np.ndarray) -> None:
        """Rows [L, W] of positions pos0.. into layer's ring (the last RING of them)."""
        L = rows.shape[0]
        first = max(pos0, pos0 + L - self.ring)
        slots = np.arange(first, pos0 + L) % self.ring
        self.v[layer][0, slots] = rows[first - pos0:]
        self._low[layer] = max(self._low[layer], pos0 + L - self.ring)

    def ring_rows(self, layer: int, a: int, b: int) -> np.ndarray:
        """The rows of positions [a, b) from layer's ring."""
        if a < self._low[layer]:
            raise ColibriError(f"deepseek_v4 cache: the rows of position {a} have left the ring (it holds "
                               f"{self._low[layer]} on)")
        return self.v[layer][0, np.arange(a, b) % self.ring]

    def _needed_from(self, layer: int, n: int) -> int:
        """The oldest position whose rows the windows after the first n positions need."""
        m = self._rates[layer]
        w = n // m  # the next entry's window; CSA pools the window before it too
        return max(0, (w - 1 if layer in self._overlap else w) * m)

    def exact(self, n: int) -> bool:
        """Whether the cache can be cut back to n positions exactly."""
        return n <= 0 or n >= self.length or all(self._needed_from(i, n) >= self._low[i] for i in self._rates)

    # -- entries ---------------------------------------------------------------------------
    def entries(self, layer: int, name: str, n: int, make) -> np.ndarray:
        """Layer `layer`'s `name` entries of every window the first n positions finish
        [n // m, C] (n: the positions whose rows this layer has); `make(w)` computes window w's
        entry, once per window."""
        key = (layer, name)
        rows, count, finished = self._entries.get(key), self._counts.get(key, 0), n // self._rates[layer]
        for w in range(count, finished):
            entry = make(w)
            if rows is None or w == rows.shape[0]:
                grown = np.empty((max(16, 2 * w, finished), entry.shape[0]), np.float32)
                if rows is not None:
                    grown[:w] = rows[:w]
                self._entries[key] = rows = grown
            rows[w] = entry
            count = self._counts[key] = w + 1
        # a view, valid until the next pass appends: the callers use it within the layer
        return rows[:count] if count else np.zeros((0, 1), np.float32)

    # -- cutting back ----------------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep exactly the first n positions: n must be `exact` (0 always is). Also run at the
        start of every pass, with n the length: a pass that failed part way may have derived
        entries from rows it never committed."""
        if not self.exact(n):
            raise ColibriError(f"cannot cut a deepseek_v4 cache back to {n} tokens: the compressor rows its "
                               f"unfinished windows need have left the ring (it holds {self.length})")
        super().truncate(n)
        if self.length == 0:
            self._low = {i: 0 for i in self._rates}
        for key in self._counts:
            self._counts[key] = min(self._counts[key], self.length // self._rates[key[0]])

    def rewind(self, n: int) -> int:
        """Keep the first n positions where that is exact, else none; returns how many."""
        self.truncate(n if self.exact(n) else 0)
        return self.length

    def recover(self) -> int:
        """After a pass failed part way (some layers wrote its rows into their rings): keep the
        length where that is still exact, else start over; returns the length."""
        return self.rewind(self.length)

    # -- persistence (io/kv_store.py: K and the rings are saved as the K / V arrays) --------
    def saved_state(self) -> dict[str, np.ndarray]:
        arrays = {"low": np.asarray([self._low[i] for i in sorted(self._rates)], np.int64)}
        for (layer, name), rows in self._entries.items():
            count = min(self._counts[layer, name], self.length // self._rates[layer])
            if count:
                arrays[f"entries{layer}_{name}"] = rows[:count].copy()
        return arrays

    def restore_state(self, arrays) -> None:
        if "low" not in arrays:
            raise ValueError("no deepseek_v4 compressor state in the file")
        self._low = dict(zip(sorted(self._rates), np.asarray(arrays["low"]).tolist()))
        self._entries, self._counts = {}, {}
        for key in arrays:
            if key.startswith("entries"):
                layer, name = key[len("entries"):].split("_", 1)
                rows = np.array(arrays[key], np.float32)
                self._entries[int(layer), name], self._counts[int(layer), name] = rows, rows.shape[0]

    @property
    def bytes_per_token(self) -> int:
        """K of every layer plus the entries a position adds on average: a CSA layer's entry and
        indexer key per m positions, an HCA layer's entry per m' (the rings are fixed:
        `state_bytes`)."""
        dh = self._shape[1]
        per = dh * len(self.k)
        for i, m in self._rates.items():
            per += (dh + self._index_dim if i in self._overlap else dh) / m
        return int(4 * per)

    @property
    def state_bytes(self) -> int:
        """The compressor rows' rings of one sequence, whatever its length."""
        return 4 * self.ring * sum(self._widths)


# ----------------------------------------------------------------------------- compressors
def pooled(kv: np.ndarray, gate: np.ndarray, norm: np.ndarray, eps: float) -> np.ndarray:
    """One compressed entry [C]: the softmax over slots (per channel) of gate [n, C] weighting
    kv [n, C], summed over slots, then RMSNorm (DeepseekV4HCACompressor / CSACompressor)."""
    p = softmax(gate.astype(np.float32), axis=0)
    return rms_norm(np.sum(kv * p, axis=0, dtype=np.float32)[None, :], norm, eps)[0]


class Compressor:
    """One compressed series of a layer (the CSA / HCA compressor, or the indexer's): its
    kv / gate projections, per-slot position bias, norm, and how window w's entry is pooled.
    `overlap` (CSA and its indexer): each position projects two series of width C, entry w
    pools the first series of window w-1 with the second of window w; else one series of window
    w. Entries are rope'd (compress rope) at their window's first position."""

    def __init__(self, w, prefix: str, rate: int, width: int, overlap: bool, eps: float, rope: Rope):
        self.kv_proj, self.gate_proj = w.tensor(f"{prefix}.kv_proj.weight"), w.tensor(f"{prefix}.gate_proj.weight")
        self.bias = dequantize(w.tensor(f"{prefix}.position_bias")).astype(np.float32)  # [m, C or 2C]
        self.norm = w.tensor(f"{prefix}.kv_norm.weight")
        self.rate, self.width, self.overlap, self.eps, self.rope = rate, width, overlap, eps, rope
        self.row_width = 2 * self.bias.shape[1]  # kv then gate

    def rows(self, x: np.ndarray) -> np.ndarray:
        """The positions' rows [L, row_width]: kv projection, then raw gate projection."""
        return np.concatenate([linear(x, self.kv_proj), linear(x, self.gate_proj)], axis=1)

    def entry(self, rows, w: int) -> np.ndarray:
        """Window w's entry [C]; rows(a, b): the series' rows [b - a, row_width] of positions a..b."""
        m, C, half = self.rate, self.width, self.row_width // 2
        cur = rows(w * m, (w + 1) * m)
        kv, gate = cur[:, :half], cur[:, half:] + self.bias
        if self.overlap:
            kv, gate = kv[:, C:], gate[:, C:]  # the second series: this window's
            if w > 0:
                prev = rows((w - 1) * m, w * m)
                kv = np.concatenate([prev[:, :C], kv])
                gate = np.concatenate([prev[:, half:half + C] + self.bias[:, :C], gate])
        entry = pooled(kv, gate, self.norm, self.eps)
        cos, sin = half_angles(self.rope, np.asarray([w * m]))
        return interleaved_rope(entry[None, :], cos, sin)[0]


class Indexer:
    """The lightning indexer of a CSA layer: its own compressed keys (Compressor, overlapping,
    index_head_dim wide), query heads from the attention's low-rank query, and per query the
    index_topk entries of finished windows with the highest sum_h w_h relu(q_h . k)."""

    def __init__(self, args: ModelArgs, w, prefix: str, rope: Rope):
        self.keys = Compressor(w, prefix, args.compress_rates[CSA], args.index_head_dim, True, args.rms_norm_eps,
                               rope)
        self.q_b_proj = w.tensor(f"{prefix}.q_b_proj.weight")
        self.weights_proj = w.tensor(f"{prefix}.scorer.weights_proj.weight")
        self.heads, self.dim, self.topk, self.rope = args.index_n_heads, args.index_head_dim, args.index_topk, rope

    def select(self, x: np.ndarray, q_residual: np.ndarray, keys: np.ndarray, positions: np.ndarray,
               cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Which entries each query sees: bool [L, E] (keys [E, Di] the indexer's entries)."""
        L, E = x.shape[0], keys.shape[0]
        visible = np.arange(E)[None, :] < ((positions + 1) // self.keys.rate)[:, None]   # finished windows
        if E <= self.topk:
            return visible
        q = interleaved_rope(linear(q_residual, self.q_b_proj).reshape(L, self.heads, self.dim), cos, sin)
        q_keys = (q.reshape(L * self.heads, self.dim) @ keys.T).reshape(L, self.heads, E)  # one GEMM, not einsum's loops
        scores = np.maximum(q_keys, np.float32(0)) * np.float32(self.dim ** -0.5)
        weights = linear(x, self.weights_proj) * np.float32(self.heads ** -0.5)                  # [L, Hi]
        total = np.sum(scores * weights[:, :, None], axis=1)                                      # [L, E]
        total = np.where(visible, total, np.float32(-np.inf))
        best = np.argsort(-total, axis=-1, kind="stable")[:, :self.topk]
        chosen = np.zeros((L, E), bool)
        np.put_along_axis(chosen, best, True, axis=-1)
        return chosen & visible


# ----------------------------------------------------------------------------- attention
def _seen_of_two(visible: np.ndarray, window: np.ndarray, entries: np.ndarray) -> tuple:
    """seen_rows(visible, window's rows then the entries) for one query, without joining the two
    first (that copied every entry a token: 16 MB a CSA layer at 32k): the same rows in the
    same order, so the same bits."""
    seen = seen_index(visible)
    if seen is None:
        return visible, np.concatenate([window, entries])
    nw = window.shape[0]
    rows = np.concatenate([window[seen[seen < nw]], entries[seen[seen >= nw] - nw]])
    return np.ones((1, seen.size), bool), rows


def v4_attention(q: np.ndarray, keys: np.ndarray, pos0: int, window: int, scale: np.float32, sinks: np.ndarray,
                 entries: np.ndarray | None = None, entry_mask: np.ndarray | None = None) -> np.ndarray:
    """Queries q [L, H, Dh] at positions pos0.. over the shared key=value rows keys [N, Dh]
    (N = pos0 + L), each query seeing the last `window` of them (itself included) and, where
    given, the compressed entries [E, Dh] its entry_mask [L, E] allows, with a learned sink
    logit per head in the softmax's denominator. Returns [L, H, Dh]."""
    L, H, Dh = q.shape
    out = np.empty((L, H, Dh), np.float32)
    sink = sinks.astype(np.float32)[None, :, None]                     # [1, H, 1]
    for a in range(0, L, QUERY_BLOCK):
        b = min(L, a + QUERY_BLOCK)
        qpos = np.arange(pos0 + a, pos0 + b)
        first = max(0, pos0 + a - window + 1)
        kpos = np.arange(first, pos0 + b)
        seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)  # [l, n]
        kv = keys[first:pos0 + b]
        nq = b - a
        joined = entries is not None and entries.shape[0] > 0
        if joined:
            seen = np.concatenate([seen, entry_mask[a:b]], axis=1)
        if nq == 1:  # one query (decode, and each row of a batch or a draft): only the rows it sees
            seen, kv = _seen_of_two(seen, kv, entries) if joined else seen_rows(seen, kv)
        elif joined:
            kv = np.concatenate([kv, entries])
        # every head against the same rows: [nq H, Dh] @ [Dh, n], one GEMM
        s = (q[a:b].reshape(nq * H, Dh) @ kv.T).reshape(nq, H, -1) * scale  # [nq, H, n]
        s = np.where(seen[:, None, :], s, np.float32(-np.inf))
        m = np.maximum(s.max(axis=-1, keepdims=True), sink)
        p = np.exp(s - m)
        p = p / (p.sum(axis=-1, keepdims=True) + np.exp(sink - m))
        out[a:b] = (p.reshape(nq * H, -1) @ kv).reshape(nq, H, Dh)
    return out


class V4Attention:
    """A DeepSeek V4 attention block (module docstring), with its compressor and indexer."""

    def __init__(self, args: ModelArgs, w, prefix: str, layer: int, ropes: dict[str, Rope]):
        self.kind = args.layer_types[layer]
        self.rope = ropes["main" if self.kind == SLIDING else "compress"]
        self.q_a_proj, self.q_b_proj = w.tensor(f"{prefix}.q_a_proj.weight"), w.tensor(f"{prefix}.q_b_proj.weight")
        self.q_a_norm = w.tensor(f"{prefix}.q_a_norm.weight")
        self.kv_proj, self.kv_norm = w.tensor(f"{prefix}.kv_proj.weight"), w.tensor(f"{prefix}.kv_norm.weight")
        o_a = w.tensor(f"{prefix}.o_a_proj.weight")                    # [G * Ro, H * Dh / G]
        self.groups = args.o_groups
        rank = o_a.shape[0] // self.groups
        try:  # each group's rows as a view: one matrix per group, no wasted products
            self.o_a = [o_a.rows(g * rank, (g + 1) * rank) for g in range(self.groups)]
        except ValueError:  # rows interleaved across groups: whole products, each group's slice kept
            self.o_a = [(o_a, g * rank, (g + 1) * rank) for g in range(self.groups)]
        self.o_b_proj = w.tensor(f"{prefix}.o_b_proj.weight")
        self.sinks = w.tensor(f"{prefix}.sinks")
        self.h, self.dh, self.eps = args.num_attention_heads, args.head_dim, args.rms_norm_eps
        self.window, self.scale = args.sliding_window, np.float32(args.head_dim ** -0.5)
        self.layer = layer
        self.compressor = self.indexer = None
        if self.kind != SLIDING:
            c = f"{prefix}.compressor"
            self.compressor = Compressor(w, c, args.rate(layer), args.head_dim, self.kind == CSA, args.rms_norm_eps,
                                         ropes["compress"])
            if self.kind == CSA:
                self.indexer = Indexer(args, w, f"{c}.indexer", ropes["compress"])

    def __call__(self, x: np.ndarray, cache: V4Cache, pos0: int) -> np.ndarray:
        L, layer = x.shape[0], self.layer
        positions = np.arange(pos0, pos0 + L)
        cos, sin = half_angles(self.rope, positions)
        q_residual = rms_norm(linear(x, self.q_a_proj), self.q_a_norm, self.eps)            # [L, Rq]
        q = unweighted_rms(linear(q_residual, self.q_b_proj).reshape(L, self.h, self.dh), self.eps)
        q = interleaved_rope(q, cos, sin)
        kv = interleaved_rope(rms_norm(linear(x, self.kv_proj), self.kv_norm, self.eps), cos, sin)  # [L, Dh]
        cache.k[layer][0, pos0:pos0 + L] = kv
        n = pos0 + L
        entries = mask = None
        if self.compressor is not None:
            c = self.compressor
            own = c.rows(x)                                                 # this pass's rows [L, W]
            if self.indexer is not None:
                own = np.concatenate([own, self.indexer.keys.rows(x)], axis=1)

            def rows(a: int, b: int, lo: int = 0, hi: int = own.shape[1]) -> np.ndarray:
                """Columns lo..hi of the rows of positions a..b: older ones from the ring."""
                if a >= pos0:
                    return own[a - pos0:b - pos0, lo:hi]
                old = cache.ring_rows(layer, a, min(b, pos0))[:, lo:hi]
                return old if b <= pos0 else np.concatenate([old, own[:b - pos0, lo:hi]])

            entries = cache.entries(layer, "kv", n, lambda w: c.entry(lambda a, b: rows(a, b, 0, c.row_width), w))
            mask = np.arange(entries.shape[0])[None, :] < ((positions + 1) // c.rate)[:, None]
            if self.indexer is not None and entries.shape[0]:
                ix = self.indexer
                keys = cache.entries(layer, "index", n,
                                     lambda w: ix.keys.entry(lambda a, b: rows(a, b, c.row_width), w))
                mask = ix.select(x, q_residual, keys, positions, cos, sin)
            cache.write_rows(layer, pos0, own)
        out = v4_attention(q, cache.k[layer][0, :n], pos0, self.window, self.scale, self.sinks, entries, mask)
        out = interleaved_rope(out, cos, -sin).reshape(L, self.groups, -1)                 # [L, G, H Dh / G]
        parts = []
        for g, o_a in enumerate(self.o_a):
            xg = np.ascontiguousarray(out[:, g])
            parts.append(linear(xg, o_a) if not isinstance(o_a, tuple) else linear(xg, o_a[0])[:, o_a[1]:o_a[2]])
        return linear(np.concatenate(parts, axis=1), self.o_b_proj)


# ----------------------------------------------------------------------------- MoE
class V4MoE(RoutedMoE):
    """Routed experts (clipped SwiGLU) chosen by scores plus a correction bias, or by token id
    (hash layers), plus one shared expert. The experts come from the expert source as any
    family's (RAM, disk, prefetch); a decode token's run in the fused MoE kernel with the clip
    (`activation`), several tokens' over the matrix kernels (`expert`)."""

    def __init__(self, args: ModelArgs, w, experts, prefix: str, hashed: bool):
        if getattr(experts, "compute", None) is not None:
            raise ColibriError("deepseek_v4: experts computed on other machines (colibri/cluster) run the "
                               "unclipped SwiGLU; V4's clipped experts are not implemented there yet")
        self.router = w.tensor(f"{prefix}.gate.weight")                    # [E, D]
        self.hashed = hashed
        if hashed:  # token id -> its experts (float32 in the container: ids below 2**24 are exact)
            self.tid2eid = dequantize(w.tensor(f"{prefix}.gate.tid2eid")).astype(np.int64)
        bias = f"{prefix}.gate.e_score_correction_bias"
        self.bias = w.tensor(bias).astype(np.float32) if w.has(bias) else np.zeros(args.n_routed_experts, np.float32)
        self.shared = [w.tensor(f"{prefix}.shared_experts.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")]
        self.experts, self.prefix, self.layer = experts, prefix, layer_index(prefix)
        self.top_k, self.func = args.num_experts_per_tok, args.scoring_func
        self.scaling, self.limit = np.float32(args.routed_scaling_factor), args.swiglu_limit
        self.activation = ExpertActivation(ops.CLIPPED_SILU, limit=self.limit)

    def route(self, x: np.ndarray, ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(weights [L, K], expert ids [L, K]); hash layers need the tokens' ids."""
        scores = score(linear(x, self.router), self.func)                  # [L, E]
        if self.hashed:
            if ids is None:  # RoutedMoE.prefetch_for guesses from x alone: nothing to guess here
                raise ColibriError("deepseek_v4: a hash-routed layer needs the token ids")
            chosen = self.tid2eid[ids]
        else:
            chosen = np.argsort(-(scores + self.bias), axis=-1, kind="stable")[:, :self.top_k]
        weights = np.take_along_axis(scores, chosen, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
        return (weights * self.scaling).astype(np.float32), chosen

    def wants_prefetch(self) -> bool:
        return not self.hashed and super().wants_prefetch()

    def expert(self, x: np.ndarray, e: int, ew: dict) -> np.ndarray:
        """Expert e's output for tokens x [L, D] (its matrices ew) -> [L, D]."""
        gate, up = linear(x, ew["gate_proj"]), linear(x, ew["up_proj"])
        return linear(clipped_swiglu(gate, up, self.limit), ew["down_proj"])

    def shared_out(self, x: np.ndarray) -> np.ndarray:
        gate, up, down = self.shared
        return linear(clipped_swiglu(linear(x, gate), linear(x, up), self.limit), down)

    def __call__(self, x: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        t0 = clock() if PHASES.on else 0.0
        return self.over_matrices(x, self.route(x, ids), t0)


# ----------------------------------------------------------------------------- layers and model
class V4Layer:
    """mHC around attention, then mHC around the MoE block."""

    def __init__(self, args: ModelArgs, w, experts, layer: int, ropes: dict[str, Rope]):
        p = f"model.layers.{layer}"
        self.attn = V4Attention(args, w, f"{p}.self_attn", layer, ropes)
        self.mlp = V4MoE(args, w, experts, f"{p}.mlp", args.mlp_layer_types[layer] == "hash_moe")
        self.input_norm = w.tensor(f"{p}.input_layernorm.weight")
        self.post_norm = w.tensor(f"{p}.post_attention_layernorm.weight")
        self.attn_hc, self.ffn_hc = HyperConnection(args, w, f"{p}.attn_hc"), HyperConnection(args, w, f"{p}.ffn_hc")
        self.eps, self.index = args.rms_norm_eps, layer

    def __call__(self, streams: np.ndarray, ids: np.ndarray, cache: V4Cache, pos0: int) -> np.ndarray:
        t0 = clock() if PHASES.on else 0.0
        post, comb, x = self.attn_hc(streams)
        streams = merge(streams, self.attn(rms_norm(x, self.input_norm, self.eps), cache, pos0), post, comb)
        if t0:
            PHASES.add("attention", self.index, t0)
            t0 = clock()
        post, comb, x = self.ffn_hc(streams)
        streams = merge(streams, self.mlp(rms_norm(x, self.post_norm, self.eps), ids), post, comb)
        if t0:
            PHASES.add("ffn", self.index, t0)
        return streams


class V4Model(DecoderModel):
    """Embedding -> hc_mult streams -> V4 layers -> hc_head collapse -> norm -> lm_head."""

    read_hash_ahead = True  # streamed experts: request the hash layers' experts before any layer runs

    def __init__(self, args: ModelArgs, w, experts):
        ropes = args.ropes()
        super().__init__(args, w, [V4Layer(args, w, experts, i, ropes) for i in range(args.num_hidden_layers)],
                         ropes["main"])
        self.hc_fn = dequantize(w.tensor("model.hc_head.hc_fn")).astype(np.float32)   # [S, S D]
        self.hc_base = w.tensor("model.hc_head.hc_base").astype(np.float32)
        self.hc_scale = w.tensor("model.hc_head.hc_scale").astype(np.float32)

    def new_cache(self, max_tokens: int) -> V4Cache:
        return V4Cache(self.args, max_tokens, dtype=self.kv_cache)

    def _head(self, streams: np.ndarray) -> np.ndarray:
        """The streams [L, S, D] collapsed (DeepseekV4HyperHead) and normed -> [L, D]."""
        a = self.args
        mixes = unweighted_rms(streams.reshape(streams.shape[0], -1), a.rms_norm_eps) @ self.hc_fn.T
        pre = sigmoid(mixes * self.hc_scale + self.hc_base) + np.float32(a.hc_eps)
        return rms_norm(np.sum(pre[:, :, None] * streams, axis=1, dtype=np.float32), self.norm, a.rms_norm_eps)

    @in_activation_mode
    def forward(self, ids: np.ndarray, cache: V4Cache, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` [L] after the cache's contents; returns logits [L or 1, V]."""
        h = self.hidden(ids, cache, all_logits)
        t0 = clock() if PHASES.on else 0.0
        logits = linear(h, self.lm_head)
        if t0:
            PHASES.add("head", -1, t0)
        return logits

    def hidden(self, ids: np.ndarray, cache: V4Cache, all_logits: bool = False) -> np.ndarray:
        """The final hidden states (collapsed, normed) [L or 1, D] of forward."""
        ids = np.asarray(ids, dtype=np.int64)
        L, pos0 = ids.shape[0], cache.length
        cache.reserve(pos0 + L)
        cache.truncate(pos0)  # entries a failed pass derived are dropped (V4Cache.truncate)
        if self.prefetch and self.read_hash_ahead:  # hash layers: their experts follow from the ids alone
            for layer in self.layers:
                if layer.mlp.hashed:
                    layer.mlp.experts.prefetch(layer.mlp.prefix, np.unique(layer.mlp.tid2eid[ids]).tolist())
        t0 = clock() if PHASES.on else 0.0
        x = embedding(self.embed, ids)                                          # [L, D]
        streams = np.ascontiguousarray(np.broadcast_to(x[:, None, :], (L, self.args.hc_mult, x.shape[1])))
        if t0:
            PHASES.add("embed", -1, t0)
        try:
            for layer in self.layers:
                streams = layer(streams, ids, cache, pos0)
        except BaseException:  # some layers wrote this pass's rows into their rings
            cache.recover()
            raise
        cache.length = pos0 + L
        if not all_logits:
            streams = streams[-1:]
        return self._head(streams)

    @in_activation_mode
    def forward_rows(self, ids, caches: list) -> np.ndarray:
        """Each row decoded alone, in row order (rows of one cache are its next positions): the
        same bits as decoding them one by one, which is what batching and drafts promise."""
        self.rows_hidden = h = np.concatenate([self.hidden(np.asarray([t]), c) for t, c in zip(ids, caches)])
        return np.concatenate([linear(h[r:r + 1], self.lm_head) for r in range(h.shape[0])])


def build(config: dict, weights, experts) -> V4Model:
    return V4Model(ModelArgs.from_dict(config), weights, experts)
