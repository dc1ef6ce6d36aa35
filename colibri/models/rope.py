"""RoPE variants (default, linear, llama3, yarn; partial rotary), after transformers'
modeling_rope_utils; decode angles sliced from tables computed ROPE_BLOCK positions at a time.

Shape letters: L tokens, H heads, Dh head dim, R rotated dims.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from colibri.errors import ColibriError
from colibri.kernels import ops
from colibri.kernels.tasks import over_rows
from colibri.models.args import ModelArgs


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

