"""The VRAM tier of the expert cache (disk -> RAM -> VRAM), for --device cuda.

Routed experts the device computes live in device memory in one pool of slots over all MoE
layers: a hot set pinned at start (the experts with the most routing history, as the RAM
store's hot set) and an LRU for the rest. A miss is fetched from the tier below, the host
expert source (ExpertStore: its RAM cache, or a disk read; ResidentExperts: RAM), and copied up
on a stream of its own. `experts(prefix, ids)` yields the layer's hits first, so the device
computes them while the misses are read and copied; the caller adds the outputs in expert-id
order, so the VRAM budget never changes the tokens.

A budget too small for even one slot still works: each expert is copied up for its use and
dropped (a "staging" copy, as the RAM store's zero-slot reads).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from colibri.io.container import Container

HOT_FRACTION = 0.5  # share of the slots pinned to the hottest experts (the RAM store's default)
# Device memory left free for the KV cache's growth, scratch arrays and the CUDA context when the
# tier sizes itself (colibri plan's policy: 10%, at least 2 GiB, as the original keeps per GPU).
HEADROOM_FRACTION, HEADROOM_MIN = 0.10, 2 << 30


def vram_budget(free_bytes: int) -> int:
    """The expert tier's budget from the device memory free after the dense weights."""
    return max(0, free_bytes - max(HEADROOM_MIN, int(free_bytes * HEADROOM_FRACTION)))


@dataclass
class DeviceExpert:
    """One routed SwiGLU expert on the device: gate and up stacked (one kernel call), down."""

    gate_up: object  # DeviceMatrix [2I, D]
    down: object     # DeviceMatrix [D, I]
    inter: int
    nbytes: int


@dataclass
class VramStats:
    hits: int = 0            # experts the device found in VRAM
    misses: int = 0          # experts copied up from the tier below (RAM, or disk through it)
    bytes_uploaded: int = 0
    upload_s: float = 0.0    # host time fetching and copying the misses

    def as_dict(self) -> dict:
        asked = self.hits + self.misses
        return {"vram_hits": self.hits, "vram_misses": self.misses,
                "vram_hit_rate": self.hits / asked if asked else 0.0,
                "vram_bytes_uploaded": self.bytes_uploaded, "vram_upload_s": self.upload_s}


def upload_expert(cuda, projections: dict, stream=0) -> DeviceExpert:
    """{gate_proj, up_proj, down_proj: QTensor} (host) -> a DeviceExpert, copied on `stream`."""
    gate, up, down = (projections[p] for p in ("gate_proj", "up_proj", "down_proj"))
    gate_up = cuda.upload_stacked([gate, up], stream)
    down_d = cuda.upload(down, stream)
    return DeviceExpert(gate_up, down_d, gate.shape[0], gate_up.nbytes + down_d.nbytes)


class VramExperts:
    """Device-resident routed experts above a host expert source, within `budget_bytes`."""

    def __init__(self, container: Container, source, budget_bytes: int, history: dict | None = None,
                 hot_fraction: float = HOT_FRACTION):
        from colibri.kernels import cuda

        self._cuda = cuda
        self.source = source
        self.stats = VramStats()
        self._layouts = layouts = container.expert_layouts
        self.expert_bytes = max((l.blob_bytes for l in layouts.values()), default=0)
        total = sum(l.num_experts for l in layouts.values())
        self.slots = min(total, budget_bytes // self.expert_bytes) if self.expert_bytes else 0
        self.budget_bytes = budget_bytes
        self._pinned: dict[tuple[str, int], DeviceExpert] = {}
        self._lru: OrderedDict[tuple[str, int], DeviceExpert] = OrderedDict()
        self._copies = cuda.stream()
        self._pin_hot_set(history or {}, int(self.slots * hot_fraction) if self.slots < total else self.slots)

    def _pin_hot_set(self, history: dict, n: int) -> None:
        """The n experts with the most routing history (all of them when every expert fits),
        copied up at start and never evicted."""
        heat = []
        for prefix, counts in history.items():
            layout = self._layouts.get(prefix)
            if layout is not None and len(counts) == layout.num_experts:  # a history of this model's layers
                heat += [(-c, prefix, e) for e, c in enumerate(counts) if c > 0]
        if n >= self.slots and self.slots:  # the whole model fits: pin every expert
            heat = [(0, p, e) for p, l in self._layouts.items() for e in range(l.num_experts)]
        by_layer: dict[str, list[int]] = {}
        for _, prefix, e in sorted(heat)[:n]:
            by_layer.setdefault(prefix, []).append(e)
        for prefix, ids in by_layer.items():
            for e, projections in self.source.iter_experts(prefix, sorted(ids)):
                self._pinned[(prefix, e)] = self._upload(projections)
        self._sync()

    def _upload(self, projections) -> DeviceExpert:
        d = upload_expert(self._cuda, projections, self._copies)
        self.stats.bytes_uploaded += d.nbytes
        return d

    def _sync(self) -> None:
        if self._copies != 0:
            self._copies.synchronize()

    @property
    def bytes_resident(self) -> int:
        return sum(d.nbytes for d in self._pinned.values()) + sum(d.nbytes for d in self._lru.values())

    def experts(self, prefix: str, ids: list[int]):
        """Yield (expert id, DeviceExpert) for each of `ids`: VRAM hits first (the caller's
        kernels for them queue on the device while the misses are fetched), then each miss once
        it is fetched from the tier below and copied up. A yielded miss stays valid until the
        caller's next request even when it was not kept (no slot free)."""
        missing = []
        for e in ids:
            key = (prefix, e)
            d = self._pinned.get(key)
            if d is None and key in self._lru:
                self._lru.move_to_end(key)
                d = self._lru[key]
            if d is None:
                missing.append(e)
                continue
            self.stats.hits += 1
            yield e, d
        if not missing:
            return
        # Counted in the tier below as well: an ExpertStore counts its own RAM hits and reads.
        t0 = time.perf_counter()
        for e, projections in self.source.iter_experts(prefix, missing):
            d = self._upload(projections)
            self._sync()  # the host buffer may be reused once the next expert is asked for
            self.stats.misses += 1
            self.stats.upload_s += time.perf_counter() - t0
            lru_room = self.slots - len(self._pinned)
            if lru_room > 0:
                while len(self._lru) >= lru_room:
                    self._lru.popitem(last=False)
                self._lru[(prefix, e)] = d
            yield e, d
            t0 = time.perf_counter()

    def places(self, prefix: str, num_experts: int) -> list[str | None]:
        """Each expert of a layer: "pinned", "cached" (the LRU) or None (below VRAM)."""
        out: list[str | None] = [None] * num_experts
        for (p, e) in self._pinned:
            if p == prefix:
                out[e] = "pinned"
        for (p, e) in self._lru:
            if p == prefix:
                out[e] = "cached"
        return out
