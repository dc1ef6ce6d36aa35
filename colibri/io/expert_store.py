"""The expert store: serves each routed expert (layer, e) from the fastest tier holding it —
a RAM cache under one byte budget, else disk — so models larger than RAM run.

- One read per expert: each expert is one contiguous, 4096-aligned blob in the container, read
  with a single `os.preadv` into a preallocated buffer (no per-token allocation). `io="direct"`
  opens with O_DIRECT (aligned buffers, bypasses the page cache, so the budget is the only
  cache); `io="mmap"` maps the files instead and lets the kernel page cache do the caching
  (kept for comparison: it is llama.cpp's approach).
- Readahead threads: misses are read by a thread pool while the caller computes the previous
  expert (the read syscall releases the GIL).
- Placement, each part switchable so it can be measured: one LRU over the slots of all MoE
  layers (layers differ a lot in how many experts they use: a per-layer split left the busy
  layers missing while quiet ones kept idle slots); a pinned hot set, the experts with the most
  routing history across all layers; prefetch of the next layer's likely experts (the model
  calls `prefetch`).

Placement changes speed, never tokens: the bytes served are the container's bytes.

Integrity: every blob read from disk is checked against the manifest's checksum in the reader
thread, right after its pread (a RAM hit is not re-checked; with `io="mmap"` each expert is
checked the first time this process touches it, as the page cache decides later re-reads). A
mismatch, a short read or an I/O error is an EngineFault naming the file and the expert; it
fails the generation that asked and leaves the store serving every other expert.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import threading
import time
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError, EngineFault
from colibri.io.container import Container, ExpertLayout
from colibri.io.expert_reader import ExpertReader, aligned_buffer
from colibri.formats.expert_blob import FusedExperts, StackedExperts
from colibri.memory import huge_pages

IO_MODES = ("pread", "direct", "mmap")
# An expert's place in ExpertStore.heat_map: pinned (hot set), cached (LRU), being read, on disk only.
EXPERT_PLACES = {"p": "pinned", "c": "cached", "r": "reading", "-": "disk"}
_ALIGN = 4096


SHOW_BYTES = 1 << 30  # a read phase larger than this takes over a second: worth showing


def shown(show, what: str, total: int):
    """show(what, total), a context manager whose value has add(nbytes) (colibri.progress), when
    given and the phase is large enough to be worth showing; else one whose value is None."""
    return show(what, total) if show is not None and total >= SHOW_BYTES else contextlib.nullcontext()


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


def save_history(path: Path | None, earlier: dict, counts: dict[str, np.ndarray]) -> None:
    """Write `earlier` routing history plus this process's `counts` to `path` (None: nowhere),
    atomically (a crash leaves the old file or the new, never half of one). A layer whose
    earlier counts have another length (the model was re-converted) starts over. The caller
    serializes calls (a lock), as concurrent turn ends would race on the temporary file; each
    process writes a temporary file of its own, since processes serving one model (two servers,
    a server and `colibri run`) share its history file."""
    if path is None:
        return
    merged = {p: (np.asarray(earlier[p], dtype=np.int64) + c).tolist() if len(earlier.get(p, [])) == c.size
              else c.tolist() for p, c in counts.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": 1, "counts": merged}))
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not save routing history to {path}: {e}", stacklevel=3)


def read_expert(reader: ExpertReader, prefix: str, e: int, buf: np.ndarray, verify: bool) -> int:
    """Expert e of `prefix` from disk into buf, checked against the model's checksum when
    `verify`; returns the bytes read (expert_reader.py: failures are EngineFaults naming file
    and expert). One function every source reads through (tests slow it down here)."""
    return reader.read(prefix, e, buf, verify)


def arena(nbytes: int, touch: bool = True) -> np.ndarray:
    """uint8 [nbytes] for expert slots: colibri.memory.huge_pages, touched now by default.

    Expert slots are read into by O_DIRECT and streamed by the kernels: 2 MiB pages cut the page
    faults of a first read 512-fold (on 2 cores the faults of the reader threads took time from
    the compute threads) and the TLB misses of streaming ~0.5 GB of experts per token. Touching
    at allocation moves the remaining faults to load time; the budget is resident from the
    start, as it is a budget. Resident experts skip the touch (ResidentExperts): their readers
    fault the pages in while other reads are in flight, instead of zeroing 16 GB (~5 s here)
    before the first expert can be read."""
    return huge_pages(nbytes, touch=touch)


@dataclass
class StoreConfig:
    ram_bytes: int = 0              # RAM budget for cached experts (pinned hot set + LRU)
    io: str = "pread"               # "pread" | "direct" (O_DIRECT) | "mmap"
    threads: int = 2                # readahead threads
    hot_fraction: float = 0.5       # share of the slots pinned to the historically hottest experts
    prefetch: bool = True           # read the next layer's predicted experts during attention
    verify: bool = True             # check each blob read from disk against the manifest checksum
    history: dict = field(default_factory=dict)  # prefix -> routing counts [E] (from usage history)
    history_file: Path | None = None  # where save_history keeps them (None: nowhere)


@dataclass
class StoreStats:
    hits: int = 0                # served from RAM without waiting
    prefetch_hits: int = 0       # served from a prefetch (counted in hits once its read was done)
    misses: int = 0              # had to be read (or waited on) when asked for
    bytes_read: int = 0
    reads: int = 0
    wait_s: float = 0.0          # time the compute thread spent blocked on disk

    def as_dict(self) -> dict:
        asked = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "prefetch_hits": self.prefetch_hits,
                "hit_rate": self.hits / asked if asked else 0.0, "bytes_read": self.bytes_read,
                "reads": self.reads, "wait_s": self.wait_s}


class _Pool:
    """The RAM tier: fixed slots shared by every MoE layer, one LRU map (layer, expert) -> slot
    over all of them, and the reads in flight into slots."""

    def __init__(self, n_slots: int, slot_bytes: int):
        # slot_bytes is a multiple of 4096 (blobs are padded), so every slot is aligned.
        self.memory = arena(n_slots * slot_bytes)
        self.slot_bytes = slot_bytes
        self.buffers = [self.memory[i * slot_bytes:(i + 1) * slot_bytes] for i in range(n_slots)]
        self.free = list(range(n_slots))
        self.lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # (prefix, expert) -> slot, oldest first
        self.loading: dict[tuple[str, int], Future] = {}            # read in flight into its slot

    def take_slot(self, protect: set[tuple[str, int]]) -> int | None:
        """A free slot, else evict the least recently used expert not in `protect`."""
        if self.free:
            return self.free.pop()
        for key in self.lru:
            if key in protect:
                continue
            fut = self.loading.get(key)
            if fut is not None and not fut.done():
                continue  # a read is still writing into that slot
            self.loading.pop(key, None)
            return self.lru.pop(key)
        return None


class _Layer:
    """One MoE layer's view of the RAM tier: its pinned experts and routing heat."""

    def __init__(self, prefix: str, layout: ExpertLayout, pool: _Pool, interleaved: bool):
        self.prefix = prefix
        self.layout = layout
        self.pool = pool
        self.pinned: dict[int, int] = {}                    # expert -> slot, never evicted
        self.counts = np.zeros(layout.num_experts, dtype=np.int64)  # routing heat (this process)
        # The fused decode kernel for this layer's blob layout, and the slot pool seen through it.
        self.fused = FusedExperts.of(layout.projections, interleaved)
        self.stacked = StackedExperts.view(pool.memory, pool.slot_bytes, len(pool.buffers), layout.projections,
                                           interleaved)

    def slot_of(self, e: int) -> int | None:
        s = self.pinned.get(e)
        return s if s is not None else self.pool.lru.get((self.prefix, e))


class ExpertStore:
    def __init__(self, container: Container, config: StoreConfig, show=None):
        """`show`: a display for the hot set's reads at start (see `shown`)."""
        if config.io not in IO_MODES:
            raise ColibriError(f"unknown expert io mode {config.io!r}; choose one of {', '.join(IO_MODES)}")
        self.container = container
        self.config = config
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._history_lock = threading.Lock()  # turn ends of concurrent generations (batching) save it
        if config.io == "mmap" and container.gguf:
            raise ColibriError("--expert-io mmap maps a container's expert files; a model read from a GGUF "
                               "streams its experts with --expert-io pread or direct")
        self._reader = ExpertReader(container, "require" if config.io == "direct" else "off")
        self._maps: dict[str, np.ndarray] = {}
        self._verified: set[tuple[str, int]] = set()  # mmap: experts checked since the files were mapped
        prefixes = list(container.expert_layouts)
        blob_total = sum(l.blob_bytes for l in container.expert_layouts.values())
        # Slots are sized for the largest blob (MoE layers of one model share expert shapes, so
        # nothing is wasted in practice); slots_per_layer is the layers' average share, the
        # unit the budget and the planner speak in; any layer may hold more or fewer.
        per_layer = int(config.ram_bytes // blob_total) if blob_total else 0
        self.slots_per_layer = 0 if config.io == "mmap" else min(
            per_layer, max((l.num_experts for l in container.expert_layouts.values()), default=0))
        max_blob = max((l.blob_bytes for l in container.expert_layouts.values()), default=0)
        self.slots = _Pool(self.slots_per_layer * len(prefixes), max_blob)
        # Blobs read into RAM (slots, staging buffers) get their rows interleaved, as the
        # dense matrices do (formats/qtensor.py, Layout); mapped files are served as stored.
        self.interleaved = container.interleave_rows and config.io != "mmap"
        self.layers = {p: _Layer(p, container.expert_layouts[p], self.slots, self.interleaved) for p in prefixes}
        # Staging buffers serve misses that have no RAM slot (budget 0, or every slot in use by
        # this very call); 2 per reader keeps the pipeline full.
        self._staging = [aligned_buffer(max_blob) for _ in range(2 * max(1, config.threads))] if max_blob else []
        self._readers = ThreadPoolExecutor(max_workers=max(1, config.threads), thread_name_prefix="colibri-read")
        try:
            for p in prefixes:
                self._open(p)
            if config.hot_fraction > 0 and config.history:
                self._pin_hot_set(show)
        except BaseException:
            self.close()  # a damaged hot expert fails the load: leave no reader threads or fds behind
            raise

    # ------------------------------------------------------------------ files
    def _open(self, prefix: str) -> None:
        """Open the files of `prefix`'s experts now, so a missing or unreadable one fails the load."""
        if self.config.io != "mmap":
            for path in self.container.expert_paths(prefix):
                self._reader._fd(path)
            return
        path, _, _ = self.container.expert_range(prefix, 0)
        key = str(path)
        if key in self._maps:
            return
        # A private (copy-on-write) mapping, never written: its arrays are writable, so the
        # kernels get the same numba types as with experts in RAM. Read-only arrays compile
        # separate specializations, and numba's dispatcher may serve a later writable call
        # from one of them: the last bits then depended on which ran first in the process.
        with open(path, "rb") as f:
            self._maps[key] = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=np.uint8)

    def _read(self, prefix: str, e: int, buf: np.ndarray) -> np.ndarray:
        """One expert from disk into `buf` (runs in a reader thread), verified. Failures are
        EngineFaults: the client's request is fine, the model files are not."""
        nbytes = read_expert(self._reader, prefix, e, buf, self.config.verify)
        if self.interleaved:
            self.layers[prefix].layout.interleave(buf)
        with self._lock:
            self.stats.bytes_read += nbytes
            self.stats.reads += 1
        return buf

    def _mapped(self, prefix: str, e: int, mm: np.ndarray) -> np.ndarray:
        """One expert's bytes in the mapped file, verified the first time this process touches it."""
        _, off, n = self.container.expert_range(prefix, e)
        blob = mm[off: off + n]
        if self.config.verify and (prefix, e) not in self._verified:
            self.container.verify_expert(prefix, e, blob)
            self._verified.add((prefix, e))
        return blob

    # ------------------------------------------------------------------ placement
    def _pin_hot_set(self, show=None) -> None:
        """Load the experts with the most routing history, across all layers, into pinned slots
        (start-up warm-up). Counts compare across layers: every layer routes each token to
        top-k experts, so one count is one read saved wherever it is."""
        n_hot = int(len(self.slots.buffers) * self.config.hot_fraction)
        if n_hot <= 0:
            return
        heat = []  # (count, layer index, expert): ties go to earlier layers, lower ids
        for li, (prefix, layer) in enumerate(self.layers.items()):
            counts = np.asarray(self.config.history.get(prefix, []), dtype=np.float64)
            if counts.size != layer.layout.num_experts:
                continue
            heat += [(-counts[e], li, e) for e in range(counts.size) if counts[e] > 0]
        prefixes = list(self.layers)
        futures = []
        for _, li, e in sorted(heat)[:n_hot]:
            layer = self.layers[prefixes[li]]
            slot = self.slots.free.pop()
            layer.pinned[int(e)] = slot
            futures.append(self._readers.submit(self._read, layer.prefix, int(e), self.slots.buffers[slot]))
        with shown(show, "pinning the hot set", len(futures) * self.slots.slot_bytes) as progress:
            for f in futures:
                f.result()
                if progress:
                    progress.add(self.slots.slot_bytes)

    def prefetch(self, prefix: str, ids) -> None:
        """Start reading experts the next layer will probably ask for into RAM slots."""
        if not self.config.prefetch or not self.slots.buffers:
            return
        layer = self.layers[prefix]
        protect = {(prefix, int(e)) for e in ids}
        for _, e in protect:
            if layer.slot_of(e) is not None:
                continue
            slot = self.slots.take_slot(protect)
            if slot is None:
                return
            self.slots.lru[(prefix, e)] = slot
            self.slots.loading[(prefix, e)] = self._readers.submit(self._read, prefix, e, self.slots.buffers[slot])

    def stacked(self, prefix: str, ids: list[int]):
        """(StackedExperts, slot of each id) when every one of `ids` is in a RAM slot with its
        read done, so the fused decode kernel can run them in place (counted as hits, as
        iter_experts would); else None and nothing changes: the caller takes iter_experts."""
        layer = self.layers[prefix]
        if layer.stacked is None or self.config.io == "mmap":
            return None
        pool = self.slots
        slots = []
        for e in ids:
            slot = layer.slot_of(e)
            fut = pool.loading.get((prefix, e))
            # A read still in flight, or one that failed (iter_experts reads it again), goes
            # the step-by-step way.
            if slot is None or (fut is not None and (not fut.done() or fut.cancelled() or fut.exception())):
                return None
            slots.append(slot)
        for e in ids:
            key = (prefix, e)
            layer.counts[e] += 1
            if pool.loading.pop(key, None) is not None:  # a finished prefetch (checked above)
                self.stats.prefetch_hits += 1
            if key in pool.lru:
                pool.lru.move_to_end(key)
        self.stats.hits += len(ids)
        return layer.stacked, np.asarray(slots, dtype=np.int64)

    def fused(self, prefix: str) -> FusedExperts | None:
        """The fused decode kernel for this layer's blob format (None: the format needs the
        step-by-step path)."""
        return self.layers[prefix].fused

    def iter_experts(self, prefix: str, ids: list[int], blobs: bool = False):
        """Yield (expert id, {projection: QTensor}) for each of `ids`, or (expert id, its uint8
        blob) with `blobs`: those already in RAM first, then the ones being read, in `ids`
        order, so the caller computes while reads land. A yielded expert's buffer stays valid
        until the next one is requested (staging buffers are reused after that)."""
        layer = self.layers[prefix]
        layout = layer.layout
        unpack = (lambda blob: blob) if blobs else (lambda blob: layout.unpack(blob, self.interleaved))
        for e in ids:
            layer.counts[e] += 1
        if self.config.io == "mmap":
            path, _, _ = self.container.expert_range(prefix, 0)
            mm = self._maps[str(path)]
            for e in ids:
                blob = self._mapped(prefix, e, mm)
                self.stats.hits += 1  # the page cache decides; counted as served
                yield e, unpack(blob)
            return
        pool = self.slots
        protect = {(prefix, e) for e in ids}
        plan = []  # (expert, buffer or None, future or None, hit?, read started by another call?)
        for e in ids:
            key = (prefix, e)
            slot = layer.slot_of(e)
            if slot is not None:
                fut = pool.loading.get(key)
                if key in pool.lru:
                    pool.lru.move_to_end(key)
                plan.append((e, pool.buffers[slot], fut, fut is None or fut.done(), True))
                continue
            slot = pool.take_slot(protect)
            if slot is not None:
                pool.lru[key] = slot
                fut = self._readers.submit(self._read, prefix, e, pool.buffers[slot])
                pool.loading[key] = fut
                plan.append((e, pool.buffers[slot], fut, False, False))
            else:
                plan.append((e, None, None, False, False))  # staged: read just ahead of use
        staged = [i for i, p in enumerate(plan) if p[1] is None]
        staged_futs: dict[int, Future] = {}
        next_stage = 0

        def submit_staged(upto: int):
            nonlocal next_stage
            while next_stage < len(staged) and next_stage < upto:
                i = staged[next_stage]
                buf = self._staging[next_stage % len(self._staging)]
                staged_futs[i] = self._readers.submit(self._read, prefix, plan[i][0], buf)
                next_stage += 1

        submit_staged(len(self._staging))
        done_staged = 0
        is_ready = [hit and (fut is None or fut.done()) for _, _, fut, hit, _ in plan]
        order = [i for i, r in enumerate(is_ready) if r] + [i for i, r in enumerate(is_ready) if not r]
        try:
            for i in order:
                e, buf, fut, hit, theirs = plan[i]
                if buf is None:  # staged: its read was submitted by submit_staged
                    fut = staged_futs[i]
                if hit and (fut is None or fut.done()):
                    self.stats.hits += 1
                    if fut is not None:
                        self.stats.prefetch_hits += 1
                else:
                    self.stats.misses += 1
                if fut is not None:
                    t0 = time.perf_counter()
                    try:
                        try:
                            buf = fut.result()
                        except EngineFault:
                            if not theirs:
                                raise
                            # A read this call did not start (a prefetch, made before anyone
                            # asked) failed: read it once more now. The file may have been
                            # damaged only while that read ran (a transient fault, a file
                            # being restored); if it still is, this read fails the same way.
                            fut = self._readers.submit(self._read, prefix, e, buf)
                            pool.loading[(prefix, e)] = fut
                            buf = fut.result()
                    except BaseException:
                        # A failed read (EngineFault) fails this generation only: its slot is
                        # freed, so the expert is read afresh when next asked for.
                        self._forget(prefix, e)
                        raise
                    self.stats.wait_s += time.perf_counter() - t0
                    pool.loading.pop((prefix, e), None)
                yield e, unpack(buf)
                if i in staged_futs:
                    done_staged += 1
                    # The consumer is done with this staging buffer: reuse it for the next miss.
                    submit_staged(done_staged + len(self._staging))
        finally:
            self._settle(staged_futs.values())

    @staticmethod
    def _settle(futures) -> None:
        """Wait out staged reads this call left in flight (it raised, or its consumer stopped
        early): the next call reuses their staging buffers, and a late write would land in an
        expert being computed. Their own failures belong to no one and are dropped."""
        for fut in futures:
            if not fut.cancel():
                try:
                    fut.result()
                except BaseException:
                    pass

    def _forget(self, prefix: str, e: int) -> None:
        """After a failed read, the slot must not claim to hold the expert."""
        self.slots.loading.pop((prefix, e), None)
        slot = self.slots.lru.pop((prefix, e), None)
        if slot is not None:
            self.slots.free.append(slot)

    # ------------------------------------------------------------------ history
    def save_history(self) -> None:
        """Persist routing counts (earlier history + this process) crash-safely; called at every
        turn end so the next start pins the right hot set."""
        with self._history_lock:
            save_history(self.config.history_file, self.config.history,
                         {p: l.counts for p, l in self.layers.items()})

    # ------------------------------------------------------------------ telemetry
    def routing_counts(self) -> dict[str, list[int]]:
        return {p: l.counts.tolist() for p, l in self.layers.items()}

    def tiers(self) -> dict[str, dict[str, list[int]]]:
        """Per layer: which experts are pinned, in the LRU, or on disk only."""
        out = {}
        for p, l in self.layers.items():
            lru = [e for (prefix, e) in self.slots.lru if prefix == p]
            in_ram = set(l.pinned) | set(lru)
            out[p] = {"pinned": sorted(l.pinned), "lru": sorted(lru),
                      "disk": [e for e in range(l.layout.num_experts) if e not in in_ram]}
        return out

    def reset_counters(self) -> None:
        """Forget hits, reads and this process's routing counts (what a warm-up left)."""
        self.stats = StoreStats()
        for layer in self.layers.values():
            layer.counts[:] = 0

    def heat_map(self) -> dict[str, tuple[list[int], str]]:
        """Per layer, for the dashboard (colibri/serve/telemetry.py): routing counts of this
        process and each expert's place as one character (EXPERT_PLACES). Runs on the server's
        thread while the compute thread moves experts: every copy below is one C call (list()
        of a dict, ndarray.tolist()), during which no other Python thread runs, so none sees a
        dict change midway."""
        lru = list(self.slots.lru)
        reading = [key for key, fut in list(self.slots.loading.items()) if not fut.done()]
        places = {p: bytearray(b"-" * layer.layout.num_experts) for p, layer in self.layers.items()}
        for prefix, e in lru:
            places[prefix][e] = ord("c")
        for p, layer in self.layers.items():
            for e in list(layer.pinned):
                places[p][e] = ord("p")
        for prefix, e in reading:
            places[prefix][e] = ord("r")
        return {p: (layer.counts.tolist(), places[p].decode()) for p, layer in self.layers.items()}

    @property
    def bytes_resident(self) -> int:
        return sum(b.nbytes for b in self.slots.buffers) + sum(b.nbytes for b in self._staging)

    @property
    def bytes_budget(self) -> int:
        return self.config.ram_bytes

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        self._reader.close()

