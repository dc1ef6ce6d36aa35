"""KV caches: the per-layer K/V cache (float32 or float16) and MLA's compressed latent cache.

Shape letters: KV key/value heads, N cached positions, D head dim, r kv_lora_rank, R rope dims,
Di indexer head dim.
"""
from __future__ import annotations

import numpy as np

from colibri.errors import ColibriError
from colibri.memory import huge_arrays
from colibri.kernels import decode


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
        self._grow(min(self.max_tokens, max(n, 2 * self.capacity)))

    def _grow(self, cap: int) -> None:
        """Room for `cap` positions, the cached ones copied over."""
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
        """Keep the first n positions (prefix reuse, rejected drafts)."""
        self.length = min(self.length, n)

    def rewind(self, n: int) -> int:
        """Keep as many of the first n positions as this cache can (a KV cache: all of them; a
        recurrent state only back to a kept snapshot, models/recurrent.py); returns how many."""
        self.truncate(n)
        return self.length

    def saved_state(self) -> dict[str, np.ndarray]:
        """Arrays besides K and V that a saved slot must hold (io/kv_store.py): none here."""
        return {}

    def restore_state(self, arrays) -> None:
        """Put back what saved_state gave (`arrays`: a mapping with those names)."""

    @property
    def bytes_per_token(self) -> int:
        kvh, dk, dv = self._shape
        return len(self.k) * kvh * (dk + dv) * np.dtype(self._np).itemsize


class MLACache(KVCache):
    """The compressed MLA cache. It is a KVCache with one "head" whose K row is the latent c
    [r] and whose V row is k_rope [R] (plus, for DSA, the indexer key [Di]), so growing,
    truncating and slot persistence (io/kv_store.py) work unchanged."""

    def __init__(self, num_layers: int, kv_lora_rank: int, rope_dim: int, max_tokens: int, index_dim: int = 0):
        super().__init__(num_layers, 1, kv_lora_rank, max_tokens, v_dim=rope_dim + index_dim)
        self.rope_dim = rope_dim
        self.selections: dict[int, np.ndarray] = {}  # DSA: first position -> the indexer's choice

    def latent(self, layer: int) -> np.ndarray:
        return self.k[layer][0]                       # [capacity, r]

    def k_rope(self, layer: int) -> np.ndarray:
        return self.v[layer][0, :, : self.rope_dim]   # [capacity, R]

    def index_keys(self, layer: int) -> np.ndarray:
        return self.v[layer][0, :, self.rope_dim :]   # [capacity, Di]
