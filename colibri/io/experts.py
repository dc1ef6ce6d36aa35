"""Routed-expert sources: what a MoE block asks for its experts.

`ResidentExperts` reads every expert blob into RAM once at load (one preallocated array per
layer, each blob checked against the manifest checksum): the fastest choice when every expert
fits the budget. READ_THREADS readers issue O_DIRECT reads at once (one buffered reader reached
~1 GB/s cold here, four ~2 GB/s, the disk's speed): on the Qwen3-30B-A3B-shaped synthetic (16.3
GB of experts, 24 GB of RAM) 10-11 s against 16-24 s for the one buffered reader, runs
interleaved (bench/resident_load.py).
`expert_store.ExpertStore` (disk -> RAM LRU, readahead, hot set, prefetch) implements the same
`iter_experts` / `prefetch` contract, so models never know where an expert came from.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.expert_store import ExpertStore, StoreConfig, arena, load_history, read_expert, shown
from colibri.kernels.moe import FusedExperts, StackedExperts

READ_THREADS = 4


def _open_direct(path) -> int:
    """O_DIRECT where the file system takes it: the blobs go straight from disk into the arena.
    Through the page cache, a model about the size of RAM also fills the cache with a second
    copy, and the kernel must evict it while the arena's pages are being allocated: a 16.3 GB
    load ran at 0.6 GB/s that way on a 24 GB machine. (Blob offsets and sizes are multiples of
    4096 and the arena is page-aligned, as O_DIRECT needs.)"""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:  # e.g. tmpfs: no O_DIRECT
        return os.open(path, os.O_RDONLY)


class ResidentExperts:
    def __init__(self, container: Container, verify: bool = True,
                 on_read: Callable[[int], None] | None = None, background: bool = False):
        """Every expert of `container` read into RAM now; `on_read(nbytes)` after each one (a
        progress display). With `background`, the reads go on in a thread of their own while
        the caller loads the rest (the dense weights: on the Qwen3-30B-A3B-shaped synthetic,
        cold, 12.5-15.8 s for both instead of 15.4-16.9 one after the other); wait() then
        blocks until they are done and raises what stopped them, cancel() stops them."""
        self.layers: dict[str, list] = {}
        self._stacked: dict[str, StackedExperts | None] = {}
        self._blobs: dict[str, np.ndarray] = {}
        self.bytes_resident = 0
        # Routing heat of this process (the dashboard's heat map), as ExpertStore keeps it.
        self._counts = {p: np.zeros(l.num_experts, dtype=np.int64) for p, l in container.expert_layouts.items()}
        for prefix, layout in container.expert_layouts.items():
            store = arena(layout.num_experts * layout.blob_bytes)
            store = store.reshape(layout.num_experts, layout.blob_bytes)
            self.layers[prefix] = [layout.unpack(store[e]) for e in range(layout.num_experts)]
            self._blobs[prefix] = store
            self._stacked[prefix] = StackedExperts.view(store, layout.blob_bytes, layout.num_experts,
                                                        layout.projections)
            self.bytes_resident += store.nbytes
        self._cancelled = threading.Event()
        self._failure: BaseException | None = None
        self._reader: threading.Thread | None = None
        if background:
            self._reader = threading.Thread(target=self._read_in_background, args=(container, verify, on_read),
                                            name="colibri-expert-load", daemon=True)
            self._reader.start()
        else:
            self._read_all(container, verify, on_read)

    def wait(self) -> None:
        """Until a background load is done; raises what stopped it."""
        if self._reader is not None:
            self._reader.join()
            self._reader = None
        if self._failure is not None:
            raise self._failure

    def cancel(self) -> None:
        """Stop a background load (the reads in flight finish) and wait for its threads."""
        self._cancelled.set()
        if self._reader is not None:
            self._reader.join()
            self._reader = None

    def _read_in_background(self, container: Container, verify: bool, on_read) -> None:
        try:
            self._read_all(container, verify, on_read)
        except BaseException as e:  # handed to wait(), in the loading thread
            self._failure = e

    def _read_all(self, container: Container, verify: bool, on_read) -> None:
        fds = {p: _open_direct(container.expert_file(p).path) for p in self._blobs}

        def read(job: tuple[str, int]) -> None:
            if self._cancelled.is_set():
                return
            prefix, e = job
            nbytes = read_expert(container, fds[prefix], prefix, e, self._blobs[prefix][e], verify)
            if on_read is not None:
                on_read(nbytes)

        jobs = [(p, e) for p, blobs in self._blobs.items() for e in range(blobs.shape[0])]
        try:
            with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="colibri-expert-read") as pool:
                for _ in pool.map(read, jobs):  # the first failure, in layer and expert order, raises
                    pass
        finally:
            for fd in fds.values():
                os.close(fd)

    # ------------------------------------------------------------------ the expert source contract
    def iter_experts(self, prefix: str, ids: list[int], blobs: bool = False):
        """Yield (expert id, {projection: QTensor}), or (expert id, its uint8 blob) with `blobs`."""
        experts = self._blobs[prefix] if blobs else self.layers[prefix]
        self._counts[prefix][ids] += 1
        for e in ids:
            yield e, experts[e]

    def prefetch(self, prefix: str, ids) -> None:
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
        if view is None:
            return None
        slots = np.asarray(ids, dtype=np.int64)
        self._counts[prefix][slots] += 1
        return view, slots

    def heat_map(self) -> dict[str, tuple[list[int], str]]:
        """As ExpertStore.heat_map: every expert is resident for good ("p")."""
        return {p: (c.tolist(), "p" * c.size) for p, c in self._counts.items()}

    @property
    def bytes_budget(self) -> int:
        return self.bytes_resident


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


def experts_fit(container: Container, config) -> bool:
    """Whether every routed expert stays in RAM (ResidentExperts) rather than streaming through
    an ExpertStore: they fit the budget beside the dense weights, or streaming is off. Raises
    when the dense part alone does not fit."""
    dense = container.dense_bytes
    budget = plan_budget(config.ram_gb)
    if dense > budget:
        raise ColibriError(f"the dense weights need {dense / GiB:.2f} GiB but the RAM budget is "
                           f"{budget / GiB:.2f} GiB; raise --ram-gb to at least {dense / GiB + 0.1:.1f}")
    stream = config.stream_experts
    if stream is None:
        stream = container.expert_bytes > budget - dense or config.expert_io != "pread"
    return not stream or not container.expert_layouts


def verify_reads(config) -> bool:
    """EngineConfig.verify_experts (default on): check each expert read from disk against the
    manifest checksum. Read with a default so this module works before the field exists."""
    return bool(getattr(config, "verify_experts", True))


def open_experts(container: Container, config, show=None, history_file: Path | None = None):
    """Resident experts when they all fit the budget (or streaming is off), else an ExpertStore
    holding what the budget allows. Raises when the dense part alone does not fit. `show`
    displays the reads at start (expert_store.shown); `history_file` keeps the store's routing
    history between runs (its hot set; None: none kept)."""
    verify = verify_reads(config)
    if experts_fit(container, config):
        with shown(show, f"reading the experts of {container.dir.name}", container.expert_bytes) as progress:
            return ResidentExperts(container, verify=verify, on_read=progress.add if progress else None)
    history = load_history(history_file) if history_file is not None else {}
    budget, dense = plan_budget(config.ram_gb), container.dense_bytes
    store_cfg = StoreConfig(ram_bytes=budget - dense, io=config.expert_io, threads=config.read_threads,
                            hot_fraction=0.5 if config.hot_set else 0.0, prefetch=config.prefetch,
                            history=history, history_file=history_file, verify=verify)
    return ExpertStore(container, store_cfg, show=show)


