"""A sequence's cache for hybrid models, whose linear-attention layers keep a fixed-size
recurrent state instead of keys and values (Qwen3-Next / Qwen3.5 Gated DeltaNet): the KV cache
of the full-attention layers plus, per linear layer, the convolution's last inputs and the
delta rule's state, and snapshots of those states.

A KV cache is cut back by forgetting positions; a recurrent state cannot be: it is a sum over
every token so far. Everything that cuts a cache back therefore goes through `truncate(n)`,
which restores the state kept at position n:

- drafted rows being verified (speculation) and several positions of one sequence in one pass:
  while `rows()` is on (DecoderModel.forward_rows turns it on for a cache that has more than
  one row in a pass), each linear layer keeps its state after every row (`keep_row`), so a
  rejected draft rolls back exactly. These row snapshots last until the next pass.
- prefix reuse across turns and slots: after every prefill chunk, and every SNAPSHOT_EVERY
  decoded tokens, the whole state is kept (`snapshot`), the newest `max_snapshots` of them
  (each costs `state_bytes`). A new prompt reuses the longest prefix that ends at a kept state
  (`rewind(n)` returns how many tokens it kept), and prefills the rest.

`truncate(n)` is exact or it raises: the callers that must not lose a position (the
speculator, the end of a generation) use it. Slot persistence (io/kv_store.py) saves the live
state and its snapshots beside the attention layers' K and V (`saved_state` / `restore_state`).

Shape letters: Lk linear layers, C conv channels, K conv width, Hv value heads, Dk / Dv head
dims.
"""
from __future__ import annotations

import numpy as np

from colibri.errors import ColibriError
from colibri.models.cache import KVCache
from colibri.workspace import STATE_SNAPSHOTS

MAX_SNAPSHOTS = STATE_SNAPSHOTS  # snapshots kept per sequence (the newest)
SNAPSHOT_EVERY = 64  # decode steps between snapshots


class RecurrentCache(KVCache):
    """KVCache over the full-attention layers (`kv_layer` maps a decoder layer to its K/V
    arrays) plus the linear layers' states (`conv[layer]` [K-1, C], `state[layer]` [Hv, Dk, Dv],
    float32) for one sequence."""

    def __init__(self, attention_layers: list[int], linear_layers: list[int], num_kv_heads: int, head_dim: int,
                 max_tokens: int, conv_shape: tuple[int, int], state_shape: tuple[int, int, int],
                 dtype: str = "f32", max_snapshots: int = MAX_SNAPSHOTS, v_dim: int | None = None):
        super().__init__(len(attention_layers), num_kv_heads, head_dim, max_tokens, v_dim=v_dim, dtype=dtype)
        self.kv_layer = {layer: j for j, layer in enumerate(attention_layers)}
        self.linear_layers = list(linear_layers)
        self._conv_shape, self._state_shape = tuple(conv_shape), tuple(state_shape)
        self.conv = {i: np.zeros(conv_shape, np.float32) for i in self.linear_layers}
        self.state = {i: np.zeros(state_shape, np.float32) for i in self.linear_layers}
        self.max_snapshots = max_snapshots
        self.snapshots: dict[int, tuple[dict, dict]] = {}  # length -> (conv, state) after that many tokens
        self._rows: dict[int, tuple[dict, dict]] | None = None  # row snapshots of the current pass
        self._last_snapshot = 0  # the length at the newest snapshot (decoded() counts from it)

    # -- how big --------------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """The linear layers' state for one sequence (what a snapshot costs)."""
        return len(self.linear_layers) * 4 * (int(np.prod(self._conv_shape)) + int(np.prod(self._state_shape)))

    # -- kept states -----------------------------------------------------------------------
    def _copy(self) -> tuple[dict, dict]:
        return ({i: a.copy() for i, a in self.conv.items()}, {i: a.copy() for i, a in self.state.items()})

    def snapshot(self) -> None:
        """Keep the state at the current length (the end of a prefill chunk)."""
        if self.max_snapshots < 1 or self.length == 0:
            return
        self.snapshots[self.length] = self._copy()
        self._last_snapshot = self.length
        while len(self.snapshots) > self.max_snapshots:
            del self.snapshots[min(self.snapshots)]

    def decoded(self) -> None:
        """After a decode step: keep the state every SNAPSHOT_EVERY generated tokens too, so a
        next turn whose re-rendered answer differs near its end reuses most of it (a copy of the
        state per SNAPSHOT_EVERY tokens: 1.9 ms at Qwen3.6-35B-A3B's shapes, docs/benchmarks.md)."""
        if self.length - self._last_snapshot >= SNAPSHOT_EVERY:
            self.snapshot()

    def rows(self, on: bool) -> None:
        """Start (on) or end a pass in which this sequence has several rows: the linear layers
        keep their state after each row (keep_row) until the next pass starts."""
        if on:
            self._rows = {}
        elif self._rows is not None and not self._rows:
            self._rows = None

    def keep_row(self, layer: int, length: int) -> None:
        """Layer `layer` has just consumed the row at position length - 1 (under rows(True))."""
        if self._rows is None:
            return
        conv, state = self._rows.setdefault(length, ({}, {}))
        conv[layer], state[layer] = self.conv[layer].copy(), self.state[layer].copy()

    def _kept(self, n: int) -> tuple[dict, dict] | None:
        if self._rows and n in self._rows and len(self._rows[n][1]) == len(self.linear_layers):
            return self._rows[n]
        return self.snapshots.get(n)

    def _restore(self, kept: tuple[dict, dict] | None) -> None:
        for i in self.linear_layers:
            if kept is None:
                self.conv[i][...] = 0.0
                self.state[i][...] = 0.0
            else:
                self.conv[i][...] = kept[0][i]
                self.state[i][...] = kept[1][i]

    # -- cutting back ----------------------------------------------------------------------
    def rewind(self, n: int) -> int:
        """Keep as many of the first n positions as a kept state allows (the longest kept
        prefix of at most n tokens; 0 when there is none) and return how many that is."""
        if n >= self.length:
            return self.length
        return self._cut(self._newest_kept(n))

    def _newest_kept(self, n: int) -> int:
        """The longest kept state of at most n tokens (0: none, start from zeros)."""
        kept = [p for p in (*self.snapshots, *(self._rows or ())) if p <= n and self._kept(p) is not None]
        return max(kept, default=0)

    def recover(self) -> int:
        """After a pass failed part way (a damaged expert, a cancelled batch): some linear layers
        may have consumed its tokens and others not, so go back to the newest kept state at or
        before the cache's length (which the failed pass did not advance); returns the length."""
        return self._cut(self._newest_kept(self.length))

    def truncate(self, n: int) -> None:
        """Keep exactly the first n positions: n must be the current length, 0 or a kept state (or
        any n where there is no recurrent state: an MTP layer's cache of one attention layer)."""
        if n >= self.length:
            return
        if n > 0 and self.linear_layers and self._kept(n) is None:
            raise ColibriError(f"cannot cut a recurrent state back to {n} tokens: no state was kept there "
                               f"(it holds {self.length})")
        self._cut(n)

    def _cut(self, n: int) -> int:
        self._restore(self._kept(n) if n > 0 else None)
        super().truncate(n)
        self.snapshots = {p: s for p, s in self.snapshots.items() if p <= n}
        self._last_snapshot = min(self._last_snapshot, n)
        if self._rows is not None:
            self._rows = {p: s for p, s in self._rows.items() if p <= n}
        return n

    # -- persistence (io/kv_store.py) ------------------------------------------------------
    def saved_state(self) -> dict[str, np.ndarray]:
        """The live state and the kept snapshots (a restored slot can then still reuse a prefix
        shorter than all it holds: a re-rendered answer often differs in its last tokens)."""
        arrays = {"snapshots": np.asarray(sorted(self.snapshots), np.int64)}
        for i in self.linear_layers:
            arrays[f"conv{i}"], arrays[f"state{i}"] = self.conv[i], self.state[i]
        for j, p in enumerate(sorted(self.snapshots)):
            conv, state = self.snapshots[p]
            for i in self.linear_layers:
                arrays[f"snap{j}_conv{i}"], arrays[f"snap{j}_state{i}"] = conv[i], state[i]
        return arrays

    def restore_state(self, arrays) -> None:
        def get(name: str, like: np.ndarray) -> np.ndarray:
            a = arrays[name]
            if a.shape != like.shape:
                raise ValueError(f"{name} has shape {a.shape}, the model's is {like.shape}")
            return np.array(a, np.float32)

        for i in self.linear_layers:
            self.conv[i][...] = get(f"conv{i}", self.conv[i])
            self.state[i][...] = get(f"state{i}", self.state[i])
        self.snapshots = {}
        for j, p in enumerate(np.asarray(arrays["snapshots"]).tolist()):
            self.snapshots[int(p)] = ({i: get(f"snap{j}_conv{i}", self.conv[i]) for i in self.linear_layers},
                                      {i: get(f"snap{j}_state{i}", self.state[i]) for i in self.linear_layers})
        self._rows = None
