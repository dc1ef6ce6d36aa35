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
  routing heat across all layers, re-pinned at turn ends as the heat moves (`_repin`); reads
  of the experts the model predicts a coming layer will use (`prefetch`, see "Guesses").

Guesses. A prefetch is a guess: the read it starts must not cost more than it can save. Its
slot comes from a free slot or from an LRU expert whose measured use rate (the share of its
layer's passes that used it) is below the guessing layer's measured precision: never from an
expert more likely to be used than the guess is. A guessed expert is protected until its layer
runs; then, if that layer did not use it, it goes to the cold end of the LRU (the next slot
taken), so a wrong guess costs one read and one cold slot. Every guess is scored when its layer
runs (precision and recall per layer, `prediction_by_layer`).

Heat and re-pinning. Each layer keeps its routing counts, and a decayed copy (`heat`, halved
every HEAT_HALF_LIFE passes of the layer) that follows the workload. At a turn end the store
marks a re-pin due; the next call (on the compute thread, so no forward pass sees slots move)
swaps pinned experts for hotter unpinned ones, when hotter by REPIN_MARGIN, at most
`repin_reads` of them needing a read per turn (one already in an LRU slot changes owner
without a read). The heat is saved with the routing history and pins the next start's hot set.

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
from collections import OrderedDict, deque
from concurrent.futures import Future
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


def _history_file(path: Path) -> dict:
    """The history file's JSON; a missing file is empty, a corrupt one is ignored with a warning."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        data["counts"] = {k: [int(c) for c in v] for k, v in data["counts"].items()}
        return data
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"ignoring unreadable routing history {path}: {e}", stacklevel=3)
        return {}


def load_history(path: Path) -> dict:
    """Routing counts per MoE layer; a missing file is empty, a corrupt one is ignored with a warning."""
    return _history_file(path).get("counts", {})


def load_heat(path: Path) -> dict:
    """The decayed routing heat the last process saved, prefix -> (passes, heat per expert):
    what the hot set follows. {} when there is none (a history saved before heat was kept:
    the hot set then follows its counts)."""
    data = _history_file(path)
    try:
        return {k: (float(data["heat_passes"][k]), [float(c) for c in v]) for k, v in data.get("heat", {}).items()}
    except (TypeError, ValueError, KeyError, AttributeError):
        return {}


def save_history(path: Path | None, earlier: dict, counts: dict[str, np.ndarray],
                 heat: dict[str, tuple[float, np.ndarray]] | None = None) -> None:
    """Write `earlier` routing history plus this process's `counts` to `path` (None: nowhere),
    atomically (a crash leaves the old file or the new, never half of one), with the decayed
    `heat` (prefix -> (passes, heat per expert)) when given. A layer whose earlier counts have another length (the model was
    re-converted) starts over. The caller serializes calls (a lock), as concurrent turn ends
    would race on the temporary file; each process writes a temporary file of its own, since
    processes serving one model (two servers, a server and `colibri run`) share its history file."""
    if path is None:
        return
    merged = {p: (np.asarray(earlier[p], dtype=np.int64) + c).tolist() if len(earlier.get(p, [])) == c.size
              else c.tolist() for p, c in counts.items()}
    data = {"version": 1, "counts": merged}
    if heat is not None:
        data["heat"] = {p: np.round(h, 3).tolist() for p, (_, h) in heat.items()}
        data["heat_passes"] = {p: round(float(n), 3) for p, (n, _) in heat.items()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
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
    hot_fraction: float = 0.5       # share of the slots pinned to the hottest experts
    prefetch: bool = True           # read the experts the model predicts coming layers use
    repin: bool = True              # the hot set follows the heat at turn ends (False: pinned once at start)
    repin_reads: int = 0            # most re-pins needing a disk read per turn (0: an eighth of the hot set)
    verify: bool = True             # check each blob read from disk against the manifest checksum
    mirrors: list = field(default_factory=list)  # (directory, weight or None) per mirror drive (io/mirrors.py)
    primary_weight: float | None = None  # the model directory's drive's weight beside mirrors (None: 1)
    history: dict = field(default_factory=dict)  # prefix -> routing counts [E] (from usage history)
    heat: dict = field(default_factory=dict)     # prefix -> (passes, decayed heat [E]) (load_heat; {}: pin by history)
    history_file: Path | None = None  # where save_history keeps them (None: nowhere)


HEAT_HALF_LIFE = 64      # passes of a layer after which a routing count weighs half
REPIN_MARGIN = 1.25      # an unpinned expert replaces a pinned one when its heat is this much higher ...
REPIN_MIN_GAP = 1.0      # ... and higher by at least this (one use: noise on a short history)
GUESS_PRIOR = (1.0, 2.0)  # a layer's guess precision before any is scored: 1 used of 2 guessed
GUESS_SCAN = 64          # LRU entries a guess looks through for one colder than itself
GUESS_QUEUE = 2          # guessed reads queued (not started) per reader thread at most


@dataclass
class StoreStats:
    hits: int = 0                # served from RAM without waiting
    prefetch_hits: int = 0       # served from a prefetch (counted in hits once its read was done)
    misses: int = 0              # had to be read (or waited on) when asked for
    bytes_read: int = 0
    reads: int = 0
    wait_s: float = 0.0          # time the compute thread spent blocked on disk
    predicted: int = 0           # experts guessed for a layer before it ran (scored ones)
    predicted_used: int = 0      # ... of which the layer used
    needed: int = 0              # experts the guessed-for layers used
    guess_reads: int = 0         # disk reads a guess started
    guess_reads_used: int = 0    # ... whose expert the layer used
    guess_skipped: int = 0       # guesses not read: no slot held an expert colder than the guess
    repins: int = 0              # hot-set swaps

    def as_dict(self) -> dict:
        asked = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "prefetch_hits": self.prefetch_hits,
                "hit_rate": self.hits / asked if asked else 0.0, "bytes_read": self.bytes_read,
                "reads": self.reads, "wait_s": self.wait_s, "predicted": self.predicted,
                "predicted_used": self.predicted_used, "needed": self.needed, "guess_reads": self.guess_reads,
                "guess_reads_used": self.guess_reads_used, "guess_skipped": self.guess_skipped,
                "repins": self.repins}


class ReadQueue:
    """The reader threads, taking reads from two queues: first the reads a forward pass needs
    now, then guesses (reads for coming layers). A queued guess never delays a read someone waits
    for, and one that someone comes to wait for moves to the front (`promote`). Futures as
    concurrent.futures makes them (cancel() stops a read not started)."""

    def __init__(self, threads: int, name: str = "colibri-read"):
        self._cv = threading.Condition()
        self._now: deque = deque()
        self._guesses: deque = deque()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, guess: bool = False) -> Future:
        fut = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the expert store is closed")
            (self._guesses if guess else self._now).append((fut, fn, args))
            self._cv.notify()
        return fut

    def promote(self, fut: Future) -> None:
        """A queued guess someone now waits for: read it next."""
        with self._cv:
            for item in self._guesses:
                if item[0] is fut:
                    self._guesses.remove(item)
                    self._now.appendleft(item)
                    return

    @property
    def queued_guesses(self) -> int:
        return len(self._guesses)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._now or self._guesses or self._closed):
                    self._cv.wait()
                if not (self._now or self._guesses):
                    return  # closed, and nothing left
                fut, fn, args = (self._now or self._guesses).popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the waiter gets it
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Finish what is queued, then stop the threads."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()


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
        self.guessed: set[tuple[str, int]] = set()  # read by a guess, kept until its layer runs

    def take_slot(self, protect: set[tuple[str, int]]) -> int | None:
        """A free slot, else evict the least recently used expert not in `protect` and not
        waiting for its layer after a guess."""
        if self.free:
            return self.free.pop()
        for key in self.lru:
            if key in protect or key in self.guessed:
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
        self.counts = np.zeros(layout.num_experts, dtype=np.int64)  # routing counts (this process)
        # Passes of the layer (one per forward step, whatever its tokens) and, per expert, the
        # passes that used it; decayed copies of both (HEAT_HALF_LIFE) for the heat.
        self.passes = 0
        self.heat = np.zeros(layout.num_experts, dtype=np.float64)
        self.heat_passes = 0.0
        self.folded = np.zeros(layout.num_experts, dtype=np.int64)  # counts already in the heat
        self.folded_passes = 0
        # Guesses since the layer last ran (all of them, and those that started a read), and
        # the scores of all earlier ones: guessed, used, needed.
        self.guesses: set[int] = set()
        self.guess_reads: set[int] = set()
        self.scores = np.zeros(3, dtype=np.int64)
        self.read_scores = np.zeros(2, dtype=np.int64)  # guesses that started a read: read, used
        # The fused decode kernel for this layer's blob layout, and the slot pool seen through it.
        self.fused = FusedExperts.of(layout.projections, interleaved)
        self.stacked = StackedExperts.view(pool.memory, pool.slot_bytes, len(pool.buffers), layout.projections,
                                           interleaved)

    def slot_of(self, e: int) -> int | None:
        s = self.pinned.get(e)
        return s if s is not None else self.pool.lru.get((self.prefix, e))

    def use_rate(self, e: int) -> float:
        """The share of the layer's recent passes that used expert e (its decayed heat, with the
        passes not yet folded in)."""
        passes = self.heat_passes + (self.passes - self.folded_passes)
        return (self.heat[e] + (self.counts[e] - self.folded[e])) / passes if passes > 0 else 0.0

    def read_precision(self) -> float:
        """The share of this layer's guessed reads (guesses of experts not in RAM: less
        predictable than the hot ones) it used, GUESS_PRIOR before any is scored."""
        return (self.read_scores[1] + GUESS_PRIOR[0]) / (self.read_scores[0] + GUESS_PRIOR[1])

    def heat_now(self) -> tuple[float, np.ndarray]:
        """(passes, heat) with the counts since the last fold decayed in, the layer unchanged
        (save_history reads it from another thread)."""
        new_passes = max(0, self.passes - self.folded_passes)
        keep = 0.5 ** (new_passes / HEAT_HALF_LIFE)
        return self.heat_passes * keep + new_passes, self.heat * keep + (self.counts - self.folded)

    def fold(self) -> None:
        """Move the counts since the last fold into the decayed heat."""
        if self.passes > self.folded_passes:
            self.heat_passes, self.heat = self.heat_now()
            self.folded = self.counts.copy()
            self.folded_passes = self.passes


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
        if config.io == "mmap" and config.mirrors:
            raise ColibriError("--expert-io mmap maps the model's own files and cannot read mirrors; "
                               "use --expert-io pread or direct with --mirror")
        self._reader = ExpertReader(container, "require" if config.io == "direct" else "off",
                                    mirrors=config.mirrors, primary_weight=config.primary_weight)
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
        self._readers = ReadQueue(config.threads)
        for p, layer in self.layers.items():  # the heat goes on where the last process left it
            passes, heat = config.heat.get(p, (0.0, []))
            if len(heat) == layer.layout.num_experts and passes > 0:
                layer.heat, layer.heat_passes = np.asarray(heat, dtype=np.float64), passes
        self.n_hot = int(len(self.slots.buffers) * config.hot_fraction)
        self._repin_due = False  # set at a turn end, done by the compute thread's next call
        try:
            for p in prefixes:
                self._open(p)
            if self.n_hot > 0 and (config.heat or config.history):
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
        """Load the hottest experts across all layers into pinned slots (start-up warm-up): by
        the heat the last process saved, else by the routing history's counts. Counts compare
        across layers: every layer routes each token to top-k experts, so one count is one read
        saved wherever it is."""
        heat = []  # (count, layer index, expert): ties go to earlier layers, lower ids
        for li, (prefix, layer) in enumerate(self.layers.items()):
            counts = np.asarray(self.config.heat[prefix][1] if prefix in self.config.heat
                                else self.config.history.get(prefix, []), dtype=np.float64)
            if counts.size != layer.layout.num_experts:
                continue
            heat += [(-counts[e], li, e) for e in range(counts.size) if counts[e] > 0]
        prefixes = list(self.layers)
        futures = []
        for _, li, e in sorted(heat)[:self.n_hot]:
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
        """A guess: layer `prefix` will probably ask for `ids`. Start reading those not in RAM,
        each into a slot that holds nothing more likely to be used than the guess (see the
        module's "Guesses"); the guesses are scored when the layer runs."""
        if not self.config.prefetch or not self.slots.buffers:
            return
        self._repin_if_due()
        layer, pool = self.layers[prefix], self.slots
        precision = layer.read_precision()
        wanted = sorted({int(e) for e in ids})  # (in id order: the same reads in every run)
        protect = {(prefix, e) for e in wanted}
        for e in wanted:
            layer.guesses.add(e)
            if layer.slot_of(e) is not None:
                continue
            # Guesses use the disk's idle time: a few queued at most, behind every needed read.
            if self._readers.queued_guesses >= GUESS_QUEUE * max(1, self.config.threads):
                self.stats.guess_skipped += 1
                continue
            slot = self._guess_slot(protect, precision)
            if slot is None:
                self.stats.guess_skipped += 1
                continue
            key = (prefix, e)
            pool.lru[key] = slot
            pool.guessed.add(key)
            layer.guess_reads.add(e)
            self.stats.guess_reads += 1
            pool.loading[key] = self._readers.submit(self._read, prefix, e, pool.buffers[slot], guess=True)

    def _guess_slot(self, protect: set[tuple[str, int]], precision: float) -> int | None:
        """A free slot, else the slot of the least recently used expert (of the GUESS_SCAN
        oldest) whose use rate is below `precision`; None when each is more likely to be used
        than the guess."""
        pool = self.slots
        if pool.free:
            return pool.free.pop()
        for n, key in enumerate(pool.lru):
            if n >= GUESS_SCAN:
                return None
            if key in protect or key in pool.guessed:
                continue
            fut = pool.loading.get(key)
            if fut is not None and not fut.done():
                continue
            if self.layers[key[0]].use_rate(key[1]) < precision:
                pool.loading.pop(key, None)
                return pool.lru.pop(key)
        return None

    def _score_guesses(self, layer: _Layer, ids) -> None:
        """Layer `layer` runs with experts `ids`: score its guesses, send the guessed reads it did
        not use to the cold end of the LRU, and count the pass."""
        layer.passes += 1
        if not layer.guesses:
            return
        used = set(ids)
        right = len(layer.guesses & used)
        layer.scores += (len(layer.guesses), right, len(used))
        self.stats.predicted += len(layer.guesses)
        self.stats.predicted_used += right
        self.stats.needed += len(used)
        pool = self.slots
        for e in layer.guess_reads:
            key = (layer.prefix, e)
            pool.guessed.discard(key)
            layer.read_scores[0] += 1
            if e in used:
                self.stats.guess_reads_used += 1
                layer.read_scores[1] += 1
            elif key in pool.lru:
                pool.lru.move_to_end(key, last=False)
        layer.guesses.clear()
        layer.guess_reads.clear()

    def prediction_by_layer(self) -> dict[str, dict[str, int]]:
        """Per MoE layer, the scored guesses so far: experts guessed, of them used, and used in all."""
        return {p: {"predicted": int(l.scores[0]), "used": int(l.scores[1]), "needed": int(l.scores[2])}
                for p, l in self.layers.items()}

    # ------------------------------------------------------------------ re-pinning
    def _repin_if_due(self) -> None:
        if self._repin_due:
            self._repin_due = False
            self._repin()

    def _repin(self) -> None:
        """Fold the counts into the heat; then, while the hottest unpinned expert's heat beats
        the coldest pinned one's by REPIN_MARGIN and REPIN_MIN_GAP, swap them: the pinned one
        becomes an LRU entry (it stays in RAM), the new one takes its LRU slot if it has one,
        else a slot read now (at most `repin_reads` such reads per turn). Heat compares across
        layers as counts do (every layer sees every token). Runs on the compute thread."""
        for layer in self.layers.values():
            layer.fold()
        if not self.config.repin or self.n_hot <= 0 or self.config.io == "mmap":
            return
        pool = self.slots
        prefixes = list(self.layers)
        pinned = sorted((l.heat[e], li, e) for li, l in enumerate(self.layers.values()) for e in l.pinned)
        unpinned = sorted(((-l.heat[e], li, e) for li, l in enumerate(self.layers.values())
                           for e in np.flatnonzero(l.heat > 0).tolist() if e not in l.pinned))
        reads_left = self.config.repin_reads or max(1, self.n_hot // 8)
        n_pinned = len(pinned)
        for neg_heat, li, e in unpinned:
            layer = self.layers[prefixes[li]]
            key = (layer.prefix, e)
            in_ram = key in pool.lru and not (key in pool.loading and not pool.loading[key].done())
            if n_pinned < self.n_hot:  # room in the hot set (a start without history): no swap
                out = None
            elif pinned and -neg_heat > pinned[0][0] * REPIN_MARGIN + REPIN_MIN_GAP:
                out = pinned.pop(0)
            else:
                break
            if not in_ram:
                if reads_left <= 0:
                    if out is not None:
                        pinned.insert(0, out)
                    break
                slot = pool.take_slot({key})
                if slot is None:
                    if out is not None:
                        pinned.insert(0, out)
                    break
                reads_left -= 1
                fut = self._readers.submit(self._read, layer.prefix, e, pool.buffers[slot])
                pool.loading[key] = fut
            else:
                slot = pool.lru.pop(key)
            pool.guessed.discard(key)
            layer.guess_reads.discard(e)
            layer.pinned[e] = slot
            if out is not None:  # the old one keeps its slot as an LRU entry
                old_layer = self.layers[prefixes[out[1]]]
                pool.lru[(old_layer.prefix, out[2])] = old_layer.pinned.pop(out[2])
            else:
                n_pinned += 1
            self.stats.repins += 1

    def stacked(self, prefix: str, ids: list[int]):
        """(StackedExperts, slot of each id) when every one of `ids` is in a RAM slot with its
        read done, so the fused decode kernel can run them in place (counted as hits, as
        iter_experts would); else None and nothing changes: the caller takes iter_experts."""
        self._repin_if_due()
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
        self._score_guesses(layer, ids)
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
        self._repin_if_due()
        layer = self.layers[prefix]
        layout = layer.layout
        unpack = (lambda blob: blob) if blobs else (lambda blob: layout.unpack(blob, self.interleaved))
        self._score_guesses(layer, ids)
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
                    if theirs and not fut.done():
                        self._readers.promote(fut)  # (a guess, queued behind needed reads)
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
        """After a failed read, the slot must not claim to hold the expert (an LRU entry, or a
        hot-set place a re-pin was reading into)."""
        self.slots.loading.pop((prefix, e), None)
        self.slots.guessed.discard((prefix, e))
        slot = self.slots.lru.pop((prefix, e), None)
        if slot is None:
            slot = self.layers[prefix].pinned.pop(e, None)
        if slot is not None:
            self.slots.free.append(slot)

    # ------------------------------------------------------------------ history
    def save_history(self) -> None:
        """A turn ended: persist routing counts (earlier history + this process) and the heat
        crash-safely, so the next start pins the right hot set, and have the hot set follow the
        heat (re-pinned by the compute thread's next call: this may run on another thread)."""
        self._repin_due = True
        with self._history_lock:
            save_history(self.config.history_file, self.config.history,
                         {p: l.counts.copy() for p, l in self.layers.items()},
                         {p: l.heat_now() for p, l in self.layers.items()})

    # ------------------------------------------------------------------ telemetry
    def drive_stats(self) -> dict[str, dict]:
        """What each drive read: the model's own and its mirrors (ExpertReader.drive_stats)."""
        return self._reader.drive_stats()

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
        """Forget hits, reads, guesses' scores and this process's routing counts and heat (what
        a warm-up left)."""
        self.stats = StoreStats()
        for layer in self.layers.values():
            layer.counts[:] = 0
            layer.folded[:] = 0
            layer.passes = layer.folded_passes = 0
            layer.scores[:] = 0
            layer.read_scores[:] = 0

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
        self._readers.shutdown()
        self._reader.close()

