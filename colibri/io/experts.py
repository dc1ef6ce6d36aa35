"""Routed-expert sources: what a MoE block asks for its experts.

`ResidentExperts` reads every expert blob into RAM once at load (one preallocated array per
layer, each blob checked against the manifest checksum): the fastest choice when every expert
fits the budget. READ_THREADS readers issue O_DIRECT reads at once (one buffered reader reached
~1 GB/s cold here, four ~2 GB/s, the disk's speed): on the Qwen3-30B-A3B-shaped synthetic (16.3
GB of experts, 24 GB of RAM) 10-11 s against 16-24 s for the one buffered reader, runs
interleaved (bench/io/resident_load.py).
`expert_store.ExpertStore` (disk -> RAM LRU, readahead, hot set, prefetch) implements the same
`iter_experts` / `prefetch` contract, so models never know where an expert came from.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.expert_reader import ExpertReader
from colibri.io.expert_store import ExpertStore, StoreConfig, arena, load_heat, load_history, read_expert, shown
from colibri.io.mirrors import parse_mirrors
from colibri.memory import available_memory  # in colibri.memory so the kernels' CUDA simulator can size by it too
from colibri.formats.expert_blob import FusedExperts, StackedExperts

READ_THREADS = 4


# An expert's state in ResidentExperts while it loads.
_PENDING, _READING, _READY, _FAILED = 0, 1, 2, 3


class ResidentExperts:
    def __init__(self, container: Container, verify: bool = True,
                 on_read: Callable[[int], None] | None = None, background: bool = False, start: bool = True,
                 mirrors=(), primary_weight: float | None = None):
        """Every expert of `container` read into RAM by READ_THREADS reader threads, `on_read(nbytes)`
        after each one (a progress display), each from the drive it is striped to where `mirrors`
        gives copies of the expert files on other drives (ExpertReader). Without `background`
        this returns when all are in.

        With `background` it returns at once and the experts serve while the rest load: a forward
        that asks for experts not read yet reads them itself (or waits for the reader that has
        one), and prefetch() moves a layer's coming experts to the front of the readers' queue,
        so an engine answers before its experts are in, waiting only for those its tokens route
        to (the same bytes in the same places, so the same tokens). A failed read fails the
        forward that needs that expert, and is tried again by the next one. wait() blocks until
        the load ends and raises its first failure; cancel() stops the readers.

        The arena is not touched before the first read (expert_store.arena): the readers'
        O_DIRECT reads fault its pages in themselves (as huge pages all the same), so four
        readers overlap one's faults with another's transfer. Qwen3-30B-A3B's
        16 GB of experts, cold page cache, this 2-core VM, alternating: 11.4 / 15.8 s untouched
        against 19.7 / 16.0 s touched first; on memory the VM's host had to back again first
        (free page reporting), 28.8 against 44.7 / 45.9 s."""
        # Every expert file opened now, its size checked against its header: read lazily, a
        # truncated file would fail each request that routes to it instead of the start.
        for prefix in container.expert_layouts:
            container.expert_paths(prefix)
        self.layers: dict[str, list] = {}
        self._stacked: dict[str, StackedExperts | None] = {}
        self._blobs: dict[str, np.ndarray] = {}
        self.bytes_resident = 0
        # Routing heat of this process (the dashboard's heat map), as ExpertStore keeps it.
        self._counts = {p: np.zeros(l.num_experts, dtype=np.int64) for p, l in container.expert_layouts.items()}
        for prefix, layout in container.expert_layouts.items():
            store = arena(layout.num_experts * layout.blob_bytes, touch=False)
            store = store.reshape(layout.num_experts, layout.blob_bytes)
            # Each blob's rows are interleaved once read (_read), as the container's dense
            # matrices are: the layout the kernels stream fastest (formats/qtensor.py, Layout).
            ilv = container.interleave_rows
            self.layers[prefix] = [layout.unpack(store[e], interleaved=ilv) for e in range(layout.num_experts)]
            self._blobs[prefix] = store
            self._stacked[prefix] = StackedExperts.view(store, layout.blob_bytes, layout.num_experts,
                                                        layout.projections, interleaved=ilv)
            self.bytes_resident += store.nbytes
        self._container, self._verify, self.on_read = container, verify, on_read
        self._state = {p: np.full(b.shape[0], _PENDING, np.uint8) for p, b in self._blobs.items()}
        self._errors: dict[tuple[str, int], BaseException] = {}
        self._left = sum(b.shape[0] for b in self._blobs.values())  # experts not yet ready
        self.complete = self._left == 0
        self._queue = deque((p, e) for p, b in self._blobs.items() for e in range(b.shape[0]))
        self._cv = threading.Condition()
        # O_DIRECT where the file system takes it: the blobs go straight from disk into the arena.
        # Through the page cache, a model about the size of RAM also fills the cache with a
        # second copy, and the kernel must evict it while the arena's pages are being allocated:
        # a 16.3 GB load ran at 0.6 GB/s that way on a 24 GB machine.
        self._reader = ExpertReader(container, "prefer", mirrors, primary_weight)
        self._cancelled = threading.Event()
        self._readers = [threading.Thread(target=self._read_queue, name=f"colibri-expert-load-{i}", daemon=True)
                         for i in range(min(READ_THREADS, self._left))]
        self._started = False
        if start or not background:
            self.start()
        if not background:
            self.wait()

    def start(self) -> None:
        """Start the readers (a background load made with start=False: until then a forward
        reads the experts it needs itself, and the disk is left to other reads)."""
        if not self._started:
            self._started = True
            for t in self._readers:
                t.start()

    def wait(self) -> None:
        """Until the readers are done; raises the first expert (layer, then id) that failed and
        was not read since."""
        self.start()
        for t in self._readers:
            t.join()
        self._readers = []
        with self._cv:
            failed = sorted(self._errors)
            if failed:
                raise self._errors[failed[0]]

    def cancel(self) -> None:
        """Stop the readers (the reads in flight finish) and wait for them. Experts not read by
        then are read when a forward asks for them."""
        self._cancelled.set()
        for t in self._readers if self._started else ():
            t.join()
        self._readers = []

    @property
    def loaded_bytes(self) -> int:
        with self._cv:
            return sum(int((st == _READY).sum()) * self._blobs[p].shape[1] for p, st in self._state.items())

    def _read_queue(self) -> None:
        while not self._cancelled.is_set():
            with self._cv:
                job = None
                while self._queue and job is None:
                    p, e = self._queue.popleft()
                    if self._state[p][e] == _PENDING:
                        self._state[p][e] = _READING
                        job = (p, e)
            if job is None:
                return
            try:
                self._read(*job)
            except BaseException:  # noqa: BLE001 - kept for the forward that needs it, and for wait()
                pass

    def _read(self, prefix: str, e: int) -> None:
        """Read expert e (its state set to _READING by the caller); _READY or _FAILED after."""
        try:
            blob = self._blobs[prefix][e]
            nbytes = read_expert(self._reader, prefix, e, blob, self._verify)
            if self._container.interleave_rows:
                self._container.expert_layouts[prefix].interleave(blob)
        except BaseException as err:
            with self._cv:
                self._state[prefix][e] = _FAILED
                self._errors[(prefix, e)] = err
                self._cv.notify_all()
            raise
        with self._cv:
            self._state[prefix][e] = _READY
            self._errors.pop((prefix, e), None)
            self._left -= 1
            if self._left == 0:  # nothing is read any more: the files can close
                self.complete = True
                self._reader.close()
            self._cv.notify_all()
        on_read = self.on_read
        if on_read is not None:
            on_read(nbytes)

    def _ready(self, prefix: str, ids: list[int]):
        """Yield each of ids once it is in RAM: those already in first; the rest go to the front
        of the readers' queue, and this thread reads too, from the other end of the list, then
        waits for what the readers have. A failed read is tried once more here, and raises."""
        if self.complete:
            yield from ids
            return
        state = self._state[prefix]
        waiting = []
        for e in ids:
            if state[e] == _READY:
                yield e
            else:
                waiting.append(e)
        if not waiting:
            return
        with self._cv:
            self._queue.extendleft((prefix, e) for e in reversed(waiting) if state[e] == _PENDING)
        later = []
        for e in reversed(waiting):
            with self._cv:
                mine = state[e] == _PENDING
                if mine:
                    state[e] = _READING
            if mine:
                self._read(prefix, e)
                yield e
            else:
                later.append(e)
        for e in reversed(later):
            with self._cv:
                while state[e] == _READING:
                    self._cv.wait()
                mine = state[e] == _FAILED  # a reader's read failed (or an earlier one): once more, here
                if mine:
                    state[e] = _READING
            if mine:
                self._read(prefix, e)
            yield e

    # ------------------------------------------------------------------ the expert source contract
    def iter_experts(self, prefix: str, ids: list[int], blobs: bool = False):
        """Yield (expert id, {projection: QTensor}), or (expert id, its uint8 blob) with `blobs`,
        in the order they are ready (while the load goes on: see _ready)."""
        experts = self._blobs[prefix] if blobs else self.layers[prefix]
        self._counts[prefix][ids] += 1
        for e in self._ready(prefix, ids):
            yield e, experts[e]

    def prefetch(self, prefix: str, ids) -> None:
        """While the load goes on: the readers take these experts next."""
        if self.complete:
            return
        with self._cv:
            state = self._state[prefix]
            self._queue.extendleft((prefix, e) for e in ids if state[e] == _PENDING)

    def fused(self, prefix: str) -> FusedExperts | None:
        """The fused decode kernel for this layer's blob format and layout (None: the format
        needs the step-by-step path)."""
        view = self._stacked.get(prefix)
        return None if view is None else view.kernel

    def stacked(self, prefix: str, ids: list[int]):
        """(StackedExperts, slot of each id) for the fused decode kernel: every expert is in
        place, at slot = its id; None where the layer's format does not fit the kernel."""
        view = self._stacked.get(prefix)
        if view is None or not (self.complete or (self._state[prefix][ids] == _READY).all()):
            return None  # (not all read yet: the caller goes expert by expert, through iter_experts)
        slots = np.asarray(ids, dtype=np.int64)
        self._counts[prefix][slots] += 1
        return view, slots

    def heat_map(self) -> dict[str, tuple[list[int], str]]:
        """As ExpertStore.heat_map: every expert is resident for good ("p")."""
        return {p: (c.tolist(), "p" * c.size) for p, c in self._counts.items()}

    def drive_stats(self) -> dict[str, dict]:
        """What each drive read (ExpertReader.drive_stats); kept after the load closes the files."""
        return self._reader.drive_stats()

    def routing_counts(self) -> dict[str, list[int]]:
        """As ExpertStore.routing_counts: per MoE layer, how often each expert was routed to in
        this process (a turn's routing entropy is computed from two readings)."""
        return {p: c.tolist() for p, c in self._counts.items()}

    @property
    def bytes_budget(self) -> int:
        return self.bytes_resident


GiB = 1 << 30


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


def mirror_drives(config) -> dict:
    """EngineConfig.mirrors and primary_weight as the readers take them (ExpertReader's `mirrors`,
    `primary_weight`). Read with defaults, as verify_reads does."""
    return {"mirrors": parse_mirrors(getattr(config, "mirrors", ())),
            "primary_weight": getattr(config, "primary_weight", None)}


def open_experts(container: Container, config, show=None, history_file: Path | None = None):
    """Resident experts when they all fit the budget (or streaming is off), else an ExpertStore
    holding what the budget allows. Raises when the dense part alone does not fit. `show`
    displays the reads at start (expert_store.shown); `history_file` keeps the store's routing
    history between runs (its hot set; None: none kept)."""
    verify = verify_reads(config)
    drives = mirror_drives(config)
    if experts_fit(container, config):
        with shown(show, f"reading the experts of {container.dir.name}", container.expert_bytes) as progress:
            return ResidentExperts(container, verify=verify, on_read=progress.add if progress else None, **drives)
    history = load_history(history_file) if history_file is not None else {}
    budget, dense = plan_budget(config.ram_gb), container.dense_bytes
    store_cfg = StoreConfig(ram_bytes=budget - dense, io=config.expert_io, threads=config.read_threads,
                            hot_fraction=0.5 if config.hot_set else 0.0, prefetch=config.prefetch,
                            repin=getattr(config, "repin", True),
                            heat=load_heat(history_file) if history_file is not None else {},
                            history=history, history_file=history_file, verify=verify, **drives)
    return ExpertStore(container, store_cfg, show=show)


