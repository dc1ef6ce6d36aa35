"""Routed-expert sources: what a MoE block asks for its experts.

`ResidentExperts` reads every expert blob into RAM once at load (one pread per expert into
one preallocated array per layer, each checked against the manifest checksum): the fastest
choice when every expert fits the budget.
`expert_store.ExpertStore` (disk -> RAM LRU, readahead, hot set, prefetch) implements the same
`iter_experts` / `prefetch` contract, so models never know where an expert came from.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError, EngineFault
from colibri.io.container import Container
from colibri.io.expert_store import arena
from colibri.kernels.moe import FusedExperts, StackedExperts


class ResidentExperts:
    def __init__(self, container: Container, verify: bool = True):
        self.layers: dict[str, list] = {}
        self._stacked: dict[str, StackedExperts | None] = {}
        self._blobs: dict[str, np.ndarray] = {}
        self.bytes_resident = 0
        for prefix, layout in container.expert_layouts.items():
            store = arena(layout.num_experts * layout.blob_bytes).reshape(layout.num_experts, layout.blob_bytes)
            path = container.expert_file(prefix).path
            fd = os.open(path, os.O_RDONLY)
            try:
                for e in range(layout.num_experts):
                    _, offset, nbytes = container.expert_range(prefix, e)
                    n = os.preadv(fd, [memoryview(store[e])], offset)
                    if n != nbytes:
                        raise EngineFault(f"expert {e} of {prefix} in {path} is truncated (read {n} of {nbytes} "
                                          "bytes): the file is damaged; re-convert or restore it")
                    if verify:
                        container.verify_expert(prefix, e, store[e])
            finally:
                os.close(fd)
            self.layers[prefix] = [layout.unpack(store[e]) for e in range(layout.num_experts)]
            self._blobs[prefix] = store
            self._stacked[prefix] = StackedExperts.view(store, layout.blob_bytes, layout.num_experts,
                                                        layout.projections)
            self.bytes_resident += store.nbytes

    def iter_experts(self, prefix: str, ids: list[int], blobs: bool = False):
        """Yield (expert id, {projection: QTensor}), or (expert id, its uint8 blob) with `blobs`."""
        experts = self._blobs[prefix] if blobs else self.layers[prefix]
        for e in ids:
            yield e, experts[e]

    def prefetch(self, prefix: str, ids, certain: bool = False) -> None:
        """Everything is resident: nothing to fetch ahead."""

    def fused(self, prefix: str) -> FusedExperts | None:
        """The fused decode kernel for this layer's blob format (None: the format needs the
        step-by-step path)."""
        view = self._stacked.get(prefix)
        return None if view is None else view.kernel

    def stacked(self, prefix: str, ids: list[int]):
        """(StackedExperts, slot of each id) for the fused decode kernel: every expert is in
        place, at slot = its id; None where the layer's format does not fit the kernel."""
        view = self._stacked.get(prefix)
        return None if view is None else (view, np.asarray(ids, dtype=np.int64))


GiB = 1 << 30


def available_memory() -> int:
    """Bytes this process may still use: MemAvailable, lowered by a cgroup-v1/v2 memory limit."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_limit()
    candidates = [v for v in (avail, limit) if v]
    return min(candidates) if candidates else 8 * GiB


def _cgroup_limit() -> int | None:
    """The tightest memory limit on this process's cgroup (page cache counts against it there, so
    the budget planned below it leaves room for reads in flight)."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "":  # cgroup v2
                base = f"/sys/fs/cgroup{path}"
                raw = open(f"{base}/memory.max").read().strip()
                if raw != "max":
                    found.append(int(raw))
            elif "memory" in controllers.split(","):
                base = f"/sys/fs/cgroup/memory{path}"
                limit = int(open(f"{base}/memory.limit_in_bytes").read())
                if limit < (1 << 60):
                    found.append(limit)
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def plan_budget(ram_gb: float | None) -> int:
    """The RAM budget for resident weights: explicit, else available memory less headroom
    (15%, at least 1 GiB) so the process never runs the machine out of memory."""
    if ram_gb is not None:
        if ram_gb <= 0:
            raise ColibriError(f"--ram-gb must be positive, not {ram_gb}")
        return int(ram_gb * GiB)
    avail = available_memory()
    return max(0, avail - max(GiB, int(0.15 * avail)))


def open_experts(container: Container, config):
    """Resident experts when they all fit the budget (or streaming is off), else an ExpertStore
    holding what the budget allows. Raises when the dense part alone does not fit."""
    from colibri.io.expert_store import ExpertStore, StoreConfig

    dense = container.dense_bytes
    expert_total = container.expert_bytes
    budget = plan_budget(config.ram_gb)
    if dense > budget:
        raise ColibriError(f"the dense weights need {dense / GiB:.2f} GiB but the RAM budget is "
                           f"{budget / GiB:.2f} GiB; raise --ram-gb to at least {dense / GiB + 0.1:.1f}")
    stream = config.stream_experts
    if stream is None:
        stream = expert_total > budget - dense or config.expert_io != "pread"
    # EngineConfig.verify_experts (default on): check each expert read from disk against the
    # manifest checksum. Read with a default so this module works before the field exists.
    verify = bool(getattr(config, "verify_experts", True))
    if not stream or not container.expert_layouts:
        return ResidentExperts(container, verify=verify)
    history = load_history(history_path(container))
    store_cfg = StoreConfig(ram_bytes=budget - dense, io=config.expert_io, threads=config.read_threads,
                            hot_fraction=0.5 if config.hot_set else 0.0, prefetch=config.prefetch,
                            history=history, verify=verify)
    return ExpertStore(container, store_cfg)


def history_path(container: Container) -> Path:
    """Routing history lives in the user's cache directory, keyed by the model's path."""
    from colibri.default_model import cache_root

    key = hashlib.sha1(str(container.dir.resolve()).encode()).hexdigest()[:10]
    return cache_root() / "history" / f"{container.dir.name}-{key}.json"


def load_history(path: Path) -> dict:
    """Routing counts per MoE layer; a missing file is empty, a corrupt one is ignored with a warning."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return {k: [int(c) for c in v] for k, v in data["counts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"ignoring unreadable routing history {path}: {e}", stacklevel=2)
        return {}
