"""The head's expert source for --cluster: routed experts computed by Ray actors (ExpertWorker).

Per MoE layer the model hands `compute` the layer's whole routed work; each worker owning any
of the chosen experts gets one call with the rows routed to its experts, and all calls run at
once. The head sums the returned per-expert rows in expert-id order (shard.sum_in_id_order),
so the tokens are the single-process engine's bits.

Faults: a worker that is dead or has not answered within `deadline_s` has that layer's experts
computed by the head from its own copy of the container (an ExpertStore opened on the first
fault), is killed and started again, and serves again once its shard is loaded; until then the
head computes its experts. Every such event is logged and counted in `faults`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from numba import get_num_threads

from colibri.cluster.placement import Placement
from colibri.cluster.shard import expert_outputs, split_outputs, sum_in_id_order
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.expert_store import ExpertStore, StoreConfig, save_history
from colibri.kernels import idot

log = logging.getLogger("colibri.cluster")

DEADLINE_S = 30.0      # a worker silent this long on one layer is treated as failed
# A worker that fails again before it has answered a call (a node out of memory, a container
# missing on its node) is restarted after a pause that doubles each time, up to a minute, so a
# crash loop does not spend the head's time on starting processes; the head computes its
# experts meanwhile.
RESPAWN_BACKOFF_S = (0.0, 1.0, 60.0)  # first restart, second, the cap


def respawn_delay(failures: int) -> float:
    """Seconds to wait before restarting a worker that has failed `failures` times in a row."""
    first, second, cap = RESPAWN_BACKOFF_S
    return first if failures <= 1 else min(cap, second * 2.0 ** (failures - 2))
START_TIMEOUT_S = 600  # loading a shard reads its experts from disk: minutes for a big one
# Ray's shared-memory object store carries arrays over 100 KiB (a prefill chunk's hidden
# states); a chunk of 512 tokens of a 7168-wide model is 14 MiB per worker.
OBJECT_STORE_BYTES = 512 << 20


def connect(address: str) -> None:
    """Join the Ray cluster at `address`, or with "local" start one on this machine bound to
    127.0.0.1 only (already running in this process: reused)."""
    if address == "local":
        # Ray advertises and binds its servers on the machine's outward address unless it is
        # told this is a single-machine cluster; this must be set before ray is imported (and
        # reaches raylet, GCS and workers through the environment). Usage stats off: nothing
        # leaves the machine.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise ColibriError("--cluster needs Ray: pip install 'colibri[cluster]' (or pip install ray)") from None
    if ray.is_initialized():
        if address == "local" and _node_ip(ray) != "127.0.0.1":
            raise ColibriError("a Ray instance not bound to 127.0.0.1 is already running in this process; "
                               "--cluster local starts its own on loopback")
        return
    if address == "local":
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before the variable was set
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES,
                 log_to_driver=False, configure_logging=False, namespace="colibri")
        if _node_ip(ray) != "127.0.0.1":
            ray.shutdown()
            raise ColibriError("the local Ray instance did not bind to 127.0.0.1; refusing to serve experts on "
                               "an outward address (start Ray yourself and pass --cluster ADDRESS)")
        return
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False, namespace="colibri")
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ColibriError(f"cannot join the Ray cluster at {address}: {e}") from None


def _node_ip(ray) -> str:
    return ray.util.get_node_ip_address()


def cluster_nodes() -> list[dict]:
    """The live nodes of the joined cluster: {"id", "address", "ram_bytes", "head"} (head: the
    node this process runs on). ram_bytes is Ray's `memory` resource: what it lets tasks and
    actors use there."""
    import ray

    here = _node_ip(ray)
    return [{"id": n["NodeID"], "address": n["NodeManagerAddress"],
             "ram_bytes": int(n.get("Resources", {}).get("memory", 0)), "head": n["NodeManagerAddress"] == here}
            for n in ray.nodes() if n.get("Alive")]


@dataclass
class _Worker:
    index: int
    handle: object | None      # None: failed, to be restarted at `respawn_at`
    ready_ref: object | None
    info: dict | None = None   # ExpertWorker.ready() once it answered: pid, node, experts
    failures: int = 0          # faults in a row, without a call answered in between
    respawn_at: float = 0.0    # time.monotonic() before which a failed worker is not restarted


@dataclass
class Transport:
    """Where a cluster MoE layer's time went, summed over the layers computed."""

    layers: int = 0
    wall_s: float = 0.0        # head: from sending the calls to having every result
    compute_s: float = 0.0     # the slowest worker's own compute time per layer, summed
    local_s: float = 0.0       # the head computing a failed worker's experts

    @property
    def transport_s(self) -> float:
        """wall - slowest compute - local: serialization, Ray's scheduling and the network."""
        return max(0.0, self.wall_s - self.compute_s - self.local_s)

    def as_dict(self) -> dict:
        per = 1e3 / self.layers if self.layers else 0.0
        return {"layers": self.layers, "wall_ms_per_layer": self.wall_s * per,
                "compute_ms_per_layer": self.compute_s * per, "transport_ms_per_layer": self.transport_s * per,
                "local_ms_per_layer": self.local_s * per}


@dataclass
class ClusterExperts:
    container: Container
    placement: Placement
    worker_ram_bytes: int | None = None     # each worker's budget (None: its whole shard, pinned)
    worker_budgets: list[int | None] | None = None  # per worker, overriding worker_ram_bytes (the plan's)
    worker_nodes: list[str | None] | None = None    # per worker, the Ray node id it runs on (None: SPREAD)
    heat: dict | None = None                # routing history: the workers' hot sets under a budget
    history_file: object = None             # where save_history keeps routing counts (None: nowhere)
    verify: bool = True
    threads: int | None = None              # each worker's kernel threads (None: adapted to its machine)
    activations: str = "f32"
    fallback_bytes: int = 0                 # RAM the head's own store may cache failed workers' experts in
    deadline_s: float = DEADLINE_S
    faults: int = 0                         # workers found dead or silent (each one restarted)
    transport: Transport = field(default_factory=Transport)

    def __post_init__(self):
        import ray

        self._ray = ray
        self._local_store: ExpertStore | None = None
        # Store figures of workers since replaced, as last read: the totals stay monotonic counters.
        self._last_stats: dict[int, dict] = {}
        self._retired: list[dict] = []
        self._lock = threading.Lock()  # one layer at a time: warm-up, batching and generation threads
        self._history_lock = threading.Lock()
        # Routing counts of this process, counted where the routing happens (here), for the
        # history file: what the next start's placement ("balanced") and hot sets follow.
        self.counts = {p: np.zeros(l.num_experts, np.int64) for p, l in self.container.expert_layouts.items()}
        self.workers = [self._spawn(w) for w in range(self.placement.workers)]
        try:
            infos = ray.get([w.ready_ref for w in self.workers], timeout=START_TIMEOUT_S)
        except Exception as e:
            self.close()
            raise ColibriError(f"expert workers did not start: {e}") from None
        for w, info in zip(self.workers, infos):
            w.info = info

    # ------------------------------------------------------------------ workers
    def _spawn(self, index: int, failures: int = 0) -> _Worker:
        from colibri.cluster.worker import ExpertWorker

        node = self.worker_nodes[index] if self.worker_nodes else None
        budget = self.worker_budgets[index] if self.worker_budgets else self.worker_ram_bytes
        if node is not None:  # the node the cluster plan put it on (soft: another if that one is gone)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=True)
        else:  # one worker per node as far as the nodes go
            strategy = "SPREAD"
        handle = ExpertWorker.options(scheduling_strategy=strategy).remote(
            str(self.container.dir), self.placement.experts_of(index), budget, self.heat,
            self.verify, self.threads, self.activations)
        return _Worker(index, handle, handle.ready.remote(), failures=failures)

    def _usable(self, w: _Worker) -> bool:
        """Serving: started and answered ready(). A restarted worker is checked without waiting;
        a failed one is restarted here once its pause (respawn_delay) has passed."""
        if w.info is not None:
            return True
        if w.handle is None:
            if time.monotonic() >= w.respawn_at:
                self.workers[w.index] = self._spawn(w.index, w.failures)
            return False  # a worker started just now has not loaded its shard yet
        done, _ = self._ray.wait([w.ready_ref], timeout=0)
        if not done:
            return False
        try:
            w.info = self._ray.get(w.ready_ref)
            log.warning("expert worker %d is back (pid %s)", w.index, w.info["pid"])
        except self._ray.exceptions.RayError as e:
            self._fail(w, f"its restart failed: {e}")
            return False
        return True

    def _fail(self, w: _Worker, why: str) -> None:
        """Count the fault, kill what is left of the worker and start a new one in its place: at
        once after a first fault, after respawn_delay when it keeps failing."""
        self.faults += 1
        if w.index in self._last_stats:
            self._retired.append(self._last_stats.pop(w.index))
        failures = w.failures + 1
        delay = respawn_delay(failures)
        log.warning("expert worker %d (pid %s) %s; the head computes its experts until a new one has "
                    "loaded them (fault %d; restart %s)", w.index, (w.info or {}).get("pid"), why, self.faults,
                    f"in {delay:g} s, failure {failures} in a row" if delay else "now")
        try:
            self._ray.kill(w.handle, no_restart=True)
        except Exception:  # already gone
            pass
        if delay:
            self.workers[w.index] = _Worker(w.index, None, None, failures=failures,
                                            respawn_at=time.monotonic() + delay)
        else:
            self.workers[w.index] = self._spawn(w.index, failures)

    def _local(self) -> ExpertStore:
        """The head's own store over the container, opened at the first fault."""
        if self._local_store is None:
            self._local_store = ExpertStore(self.container, StoreConfig(
                ram_bytes=self.fallback_bytes, hot_fraction=0.0, prefetch=False, verify=self.verify))
        return self._local_store

    # ------------------------------------------------------------------ the model's hook
    def compute(self, prefix: str, x: np.ndarray, weights: np.ndarray, ids: np.ndarray,
                one_token_rows: bool) -> np.ndarray:
        """The routed experts' sum [L, D] for hidden states x [L, D] routed to `ids` with
        `weights` [L, K]: one call per worker owning any of them, summed at the head in
        expert-id order. `one_token_rows`: each row is a decode token (see shard.expert_outputs)."""
        with self._lock:
            return self._compute(prefix, x, weights, ids, one_token_rows)

    def _compute(self, prefix, x, weights, ids, one_token_rows) -> np.ndarray:
        ray = self._ray
        owners = self.placement.owner[prefix]
        mode = idot.current()
        by_worker: dict[int, list[int]] = {}
        for e in np.unique(ids).tolist():
            by_worker.setdefault(owners[e], []).append(e)
        t0 = time.perf_counter()
        calls, local = {}, []
        for index, experts in by_worker.items():
            w = self.workers[index]
            if not self._usable(w):
                local.append(experts)
                continue
            rows = np.flatnonzero(np.isin(ids, experts).any(axis=1))
            # Passed in the call: Ray inlines it up to 100 KiB (a decode row) and moves a larger
            # one (a prefill chunk) through its shared-memory object store itself; ray.put first
            # measured no faster at 512 KiB and 4 MiB and 1.4 ms slower at 8 KiB (bench/scale/cluster.py).
            calls[index] = w.handle.compute.remote(prefix, x[rows], weights[rows], ids[rows], experts,
                                                   one_token_rows, mode)
        outputs: dict[int, np.ndarray] = {}
        slowest = 0.0
        if calls:
            _, late = ray.wait(list(calls.values()), num_returns=len(calls), timeout=self.deadline_s)
            late = set(late)
            for index, ref in calls.items():
                w, experts = self.workers[index], by_worker[index]
                if ref in late:
                    self._fail(w, f"did not answer within {self.deadline_s:g} s")
                    local.append(experts)
                    continue
                try:
                    stacked, seconds = ray.get(ref)
                except ray.exceptions.RayError as e:
                    self._fail(w, f"failed ({type(e).__name__})")
                    local.append(experts)
                    continue
                slowest = max(slowest, seconds)
                w.failures = 0  # it served: a later fault restarts it at once again
                outputs.update(split_outputs(stacked, ids, experts))
        t1 = time.perf_counter()
        for experts in local:
            stacked = expert_outputs(self._local(), prefix, x, weights, ids, experts, one_token_rows, mode,
                                     get_num_threads())
            outputs.update(split_outputs(stacked, ids, experts))
        t2 = time.perf_counter()
        self.transport.layers += 1
        self.transport.wall_s += t1 - t0
        self.transport.compute_s += slowest
        self.transport.local_s += t2 - t1
        self.counts[prefix][np.unique(ids)] += 1  # once per expert per layer call, as a store counts
        return sum_in_id_order(x, ids, outputs)

    def save_history(self) -> None:
        """Persist the routing counts (earlier history + this process), as a streaming store does
        at every turn end: the next start's balanced placement and the workers' hot sets."""
        with self._history_lock:
            save_history(self.history_file, self.heat or {}, self.counts)

    # ------------------------------------------------------------------ the rest of the contract
    def fused(self, prefix: str):
        """No in-process fused kernel: the model takes `compute` instead."""
        return None

    def prefetch(self, prefix: str, ids) -> None:
        """Workers hold their shards resident (or stream them under their own budgets)."""

    def iter_experts(self, prefix: str, ids: list[int], blobs: bool = False):
        """The experts themselves, from the head's own store (callers that need weights rather
        than outputs)."""
        return self._local().iter_experts(prefix, ids, blobs=blobs)

    def stacked(self, prefix: str, ids: list[int]):
        return None

    # ------------------------------------------------------------------ telemetry
    def worker_stats(self) -> list[dict | None]:
        """Each worker's store figures (None for one that is not serving)."""
        ray = self._ray
        with self._lock:  # the server's /metrics asks from its own thread; a fault changes self.workers
            refs = {w.index: w.handle.stats.remote() for w in self.workers if self._usable(w)}
            out: list[dict | None] = [None] * len(self.workers)
            for index, ref in refs.items():
                try:
                    out[index] = self._last_stats[index] = ray.get(ref, timeout=self.deadline_s)
                except ray.exceptions.RayError:  # dead or silent: the next layer's call finds it
                    pass
            return out

    def store_stats(self) -> dict:
        """The workers' stores and the head's fallback store together, as ExpertStore's as_dict."""
        now = self.worker_stats()  # a worker not answering now counts with its last figures
        parts = [s or self._last_stats.get(i) for i, s in enumerate(now)]
        parts = [s for s in parts if s] + self._retired
        if self._local_store is not None:
            parts.append(self._local_store.stats.as_dict())
        total = {k: sum(p[k] for p in parts) for k in ("hits", "misses", "prefetch_hits", "bytes_read", "reads",
                                                       "wait_s")}
        asked = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / asked if asked else 0.0
        total["worker_faults"] = self.faults
        return total

    def heat_map(self) -> dict[str, tuple[list[int], str]]:
        """As ExpertStore.heat_map, for the dashboard: each expert's routing count and place as
        its owner reports them; the experts of a worker that does not answer now show on disk
        with no count. (Called from the server's telemetry thread, never the event loop.)"""
        ray = self._ray
        with self._lock:
            refs = {w.index: w.handle.heat_map.remote() for w in self.workers if self._usable(w)}
        maps = {}
        for index, ref in refs.items():
            try:
                maps[index] = ray.get(ref, timeout=self.deadline_s)
            except ray.exceptions.RayError:
                pass
        out = {}
        for prefix, owners in self.placement.owner.items():
            counts, places = [0] * len(owners), ["-"] * len(owners)
            for e, w in enumerate(owners):
                counts_w, places_w = maps.get(w, {}).get(prefix, (None, None))
                if counts_w is not None:
                    counts[e], places[e] = counts_w[e], places_w[e]
            out[prefix] = (counts, "".join(places))
        return out

    @property
    def bytes_resident(self) -> int:
        """Expert bytes the workers hold in RAM (as each reported when it started)."""
        return sum((w.info or {}).get("bytes_resident", 0) for w in self.workers)

    @property
    def bytes_budget(self) -> int:
        return self.bytes_resident

    @property
    def worker_pids(self) -> list[int | None]:
        return [(w.info or {}).get("pid") for w in self.workers]

    def close(self) -> None:
        """Stop the workers (the Ray instance stays: it may serve others in this process)."""
        for w in self.workers if hasattr(self, "workers") else []:
            if w.handle is None:
                continue
            try:
                self._ray.kill(w.handle, no_restart=True)
            except Exception:
                pass
        if self._local_store is not None:
            self._local_store.close()
            self._local_store = None
