"""The head's expert source for --cluster: routed experts computed by Ray actors (ExpertWorker).

Per MoE layer the model hands `compute` the layer's whole routed work; each worker owning any
of the chosen experts gets one call with the rows routed to its experts, and all calls run at
once. The head sums the returned per-expert rows in expert-id order (shard.sum_in_id_order),
so the tokens are the single-process engine's bits.

The arrays go over one TCP connection per worker (wire.py; `wire="ray"`: as Ray actor calls,
about 2 ms slower per layer). Ray places, starts and restarts the workers: each is a named
detached actor pinned to the node the cluster plan chose (by address, so a node that restarts
under a new Ray id gets its workers back), and a head that restarts adopts the workers it
finds under its names instead of loading their shards again.

Faults: a worker that is dead or has not answered within `deadline_s` has that layer's experts
computed by the head from its own copy of the container (an ExpertStore opened on the first
fault), is killed and started again, and serves again once its shard is loaded; until then the
head computes its experts. Every such event is logged and counted in `faults`. A worker whose
node is gone (cut off, stopped) waits for a node at that address to join again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from numba import get_num_threads

from colibri.cluster.placement import Placement
from colibri.cluster.shard import expert_outputs, split_outputs, sum_in_id_order
from colibri.cluster.wire import SECRET_BYTES, WireError, WireLink, quick_handoff
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


WIRES = ("tcp", "ray")
# A worker no head has connected to (or called) for this long exits: a head that crashed and
# never came back must not leave shards holding the nodes' memory.
ORPHAN_S = 600.0
NODE_RETRY_S = 2.0     # how often a worker whose node is gone looks for it again
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
    info: dict | None = None   # ExpertWorker.ready() once it answered: pid, node, experts, port
    link: WireLink | None = None  # the data path to it (None: Ray calls)
    failures: int = 0          # faults in a row, without a call answered in between
    respawn_at: float = 0.0    # time.monotonic() before which a failed worker is not restarted


@dataclass
class Transport:
    """Where a cluster MoE layer's time went, summed over the layers computed."""

    layers: int = 0
    wall_s: float = 0.0        # head: from sending the calls to having every result
    compute_s: float = 0.0     # the slowest worker's own compute time per layer, summed
    local_s: float = 0.0       # the head computing a failed worker's experts
    overlap_s: float = 0.0     # the head's own work (shared experts) while the requests were out
    # Of the wire answer the layer waited for last: its round trip less the worker's handling
    # (the network, the head's sending and receiving, waking up), and the worker's handling less
    # its compute (reading, parsing, writing the frames).
    network_s: float = 0.0
    worker_io_s: float = 0.0

    @property
    def transport_s(self) -> float:
        """wall - slowest compute - local: serialization, scheduling and the network (the head's
        overlapped work counts where it outlasted the workers)."""
        return max(0.0, self.wall_s - self.compute_s - self.local_s)

    def as_dict(self) -> dict:
        per = 1e3 / self.layers if self.layers else 0.0
        return {"layers": self.layers, "wall_ms_per_layer": self.wall_s * per,
                "compute_ms_per_layer": self.compute_s * per, "transport_ms_per_layer": self.transport_s * per,
                "local_ms_per_layer": self.local_s * per, "overlap_ms_per_layer": self.overlap_s * per,
                "network_ms_per_layer": self.network_s * per, "worker_io_ms_per_layer": self.worker_io_s * per}


@dataclass
class ClusterExperts:
    container: Container
    placement: Placement
    worker_ram_bytes: int | None = None     # each worker's budget (None: its whole shard, pinned)
    worker_budgets: list[int | None] | None = None  # per worker, overriding worker_ram_bytes (the plan's)
    worker_nodes: list[str | None] | None = None    # per worker, the node address it runs on (None: SPREAD)
    heat: dict | None = None                # routing history: the workers' hot sets under a budget
    history_file: object = None             # where save_history keeps routing counts (None: nowhere)
    verify: bool = True
    threads: int | None = None              # each worker's kernel threads (None: adapted to its machine)
    activations: str = "f32"
    fallback_bytes: int = 0                 # RAM the head's own store may cache failed workers' experts in
    deadline_s: float = DEADLINE_S
    wire: str = "tcp"                       # the data path: "tcp" (wire.py) or "ray" (actor calls)
    orphan_s: float = ORPHAN_S              # a worker without a head this long exits (0: never)
    adopt: bool = True                      # take over live workers of the same model and placement
    faults: int = 0                         # workers found dead or silent (each one restarted)
    adopted: int = 0                        # workers found alive at start and taken over
    transport: Transport = field(default_factory=Transport)

    def __post_init__(self):
        import ray

        self._ray = ray
        self._local_store: ExpertStore | None = None
        # Store figures of workers since replaced, as last read: the totals stay monotonic counters.
        self._last_stats: dict[int, dict] = {}
        self._retired: list[dict] = []
        self._waiting: set[int] = set()  # workers whose node is gone (logged once)
        self._lock = threading.Lock()  # one layer at a time: warm-up, batching and generation threads
        self._history_lock = threading.Lock()
        # Routing counts of this process, counted where the routing happens (here), for the
        # history file: what the next start's placement ("balanced") and hot sets follow.
        self.counts = {p: np.zeros(l.num_experts, np.int64) for p, l in self.container.expert_layouts.items()}
        if self.wire not in WIRES:
            raise ColibriError(f"the cluster wire must be one of {', '.join(WIRES)}, not {self.wire!r}")
        self._secret = secrets.token_bytes(SECRET_BYTES)  # the wire's, for this head's lifetime
        if self.wire == "tcp":
            quick_handoff()
        self._identity = self._identity_of()
        found = self._named_workers() if self.adopt else {}
        self.workers = []
        for index in range(self.placement.workers):
            w = self._adopt(index, found.get(index)) if index in found else None
            self.workers.append(w or self._spawn(index))
        try:
            infos = ray.get([w.ready_ref for w in self.workers], timeout=START_TIMEOUT_S)
        except Exception as e:
            self.close()
            raise ColibriError(f"expert workers did not start: {e}") from None
        for w, info in zip(self.workers, infos):
            self._serving(w, info)
        if self.adopted:
            log.warning("adopted %d expert worker(s) left by an earlier head, shards already loaded", self.adopted)

    # ------------------------------------------------------------------ workers
    def _identity_of(self) -> str:
        """What a worker serves, as a digest: the container (its path and manifest), the experts
        each worker owns and its budget. Workers are named by it, so a head finds only workers
        that hold what it would load itself."""
        manifest = json.dumps(self.container.manifest, sort_keys=True, default=str)
        what = {"dir": str(self.container.dir.resolve()), "manifest": hashlib.sha256(manifest.encode()).hexdigest(),
                "owner": self.placement.owner, "budget": [self._budget(i) for i in range(self.placement.workers)],
                "verify": self.verify, "threads": self.threads}
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def _name(self, index: int, restart: bool = False) -> str:
        """The worker's actor name; a restart gets a name of its own (the one it replaces may
        not be released by Ray yet)."""
        base = f"colibri-experts-{self._identity}-w{index}of{self.placement.workers}"
        return f"{base}-r{secrets.token_hex(4)}" if restart else base

    def _budget(self, index: int) -> int | None:
        return self.worker_budgets[index] if self.worker_budgets else self.worker_ram_bytes

    def _named_workers(self) -> dict[int, str]:
        """Live workers of this identity in the Ray namespace (index -> actor name)."""
        found = {}
        for name in self._ray.util.list_named_actors():
            for index in range(self.placement.workers):
                base = self._name(index)
                if name == base or name.startswith(base + "-r"):
                    found[index] = name
        return found

    def _adopt(self, index: int, name: str) -> _Worker | None:
        try:
            handle = self._ray.get_actor(name)
        except ValueError:  # gone since it was listed
            return None
        self.adopted += 1
        return _Worker(index, handle, handle.adopt.remote(self._secret))

    def _node_id(self, address: str) -> str | None:
        """The live Ray node at `address` now (a node that restarted has a new id)."""
        return next((n["NodeID"] for n in self._ray.nodes() if n.get("Alive") and n["NodeManagerAddress"] == address),
                    None)

    def _spawn(self, index: int, failures: int = 0) -> _Worker:
        from colibri.cluster.worker import ExpertWorker

        address = self.worker_nodes[index] if self.worker_nodes else None
        if address is not None:  # the node the cluster plan put it on, and only there
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = self._node_id(address)
            if node is None:  # the node is gone: the head computes its experts until it is back
                if index not in self._waiting:
                    log.warning("expert worker %d waits for its node %s to join again", index, address)
                    self._waiting.add(index)
                return _Worker(index, None, None, failures=failures, respawn_at=time.monotonic() + NODE_RETRY_S)
            self._waiting.discard(index)
            strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
        else:  # one worker per node as far as the nodes go
            strategy = "SPREAD"
        handle = ExpertWorker.options(scheduling_strategy=strategy, lifetime="detached",
                                      name=self._name(index, restart=failures > 0)).remote(
            str(self.container.dir), self.placement.experts_of(index), self._budget(index), self.heat,
            self.verify, self.threads, self.activations, self._secret if self.wire == "tcp" else None,
            self.orphan_s, self._identity)
        return _Worker(index, handle, handle.ready.remote(), failures=failures)

    def _serving(self, w: _Worker, info: dict) -> None:
        """`w` answered ready(): open its wire (falling back to Ray calls if it cannot be reached)."""
        w.info = info
        if self.wire != "tcp" or info.get("port") is None:
            return
        try:
            w.link = WireLink(info["node"], info["port"], self._secret)
        except (OSError, WireError) as e:
            log.warning("expert worker %d: no direct connection to %s:%s (%s); its layers go as Ray calls",
                        w.index, info["node"], info["port"], e)

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
            self._serving(w, self._ray.get(w.ready_ref))
            log.warning("expert worker %d is back (pid %s on %s)", w.index, w.info["pid"], w.info["node"])
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
        if w.link is not None:
            w.link.close()
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
        return self.begin(prefix, x, weights, ids, one_token_rows)()

    def begin(self, prefix: str, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, one_token_rows: bool):
        """`compute` in two halves: the requests go out now, and the function returned waits
        for the answers and sums them. The model computes its shared experts in between, while
        the workers compute the routed ones (colibri.models.moe.RoutedMoE)."""
        self._lock.acquire()
        try:
            finish = self._compute(prefix, x, weights, ids, one_token_rows)
        except BaseException:
            self._lock.release()
            raise

        def collect() -> np.ndarray:
            try:
                return finish()
            finally:
                self._lock.release()
        return collect

    def _compute(self, prefix, x, weights, ids, one_token_rows):
        ray = self._ray
        owners = self.placement.owner[prefix]
        mode = idot.current()
        by_worker: dict[int, list[int]] = {}
        for e in np.unique(ids).tolist():
            by_worker.setdefault(owners[e], []).append(e)
        t0 = time.perf_counter()
        deadline = t0 + self.deadline_s
        calls, links, local = {}, {}, []
        for index, experts in by_worker.items():
            w = self.workers[index]
            if not self._usable(w):
                local.append(experts)
                continue
            rows = np.flatnonzero(np.isin(ids, experts).any(axis=1))
            work = (prefix, x[rows], weights[rows], ids[rows], experts, one_token_rows, mode)
            if w.link is not None:
                try:
                    w.link.send(*work)
                    links[index] = w.link
                except WireError as e:
                    self._fail(w, f"lost its connection ({e})")
                    local.append(experts)
                continue
            # Passed in the call: Ray inlines it up to 100 KiB (a decode row) and moves a larger
            # one (a prefill chunk) through its shared-memory object store itself; ray.put first
            # measured no faster at 512 KiB and 4 MiB and 1.4 ms slower at 8 KiB (bench/scale/cluster.py).
            calls[index] = w.handle.compute.remote(*work)
        return lambda: self._collect(prefix, x, weights, ids, one_token_rows, mode, t0, deadline, by_worker, calls,
                                     links, local)

    def _collect(self, prefix, x, weights, ids, one_token_rows, mode, t0, deadline, by_worker, calls, links, local):
        """The answers to _compute's requests by `deadline` (a late or failed worker's experts
        computed here), summed in expert-id order."""
        ray = self._ray
        waiting = time.perf_counter()  # from here the head only waits (before it: its own work overlapped)
        outputs: dict[int, np.ndarray] = {}
        slowest = 0.0
        last = None  # (round trip, handled) of the answer that came last: what the layer waited for
        for index, link in links.items():  # every request is out: now the answers, by one deadline
            w, experts = self.workers[index], by_worker[index]
            try:
                stacked, seconds, handled = link.receive(deadline - time.perf_counter())
            except WireError as e:
                self._fail(w, f"did not answer within {self.deadline_s:g} s" if "no answer" in str(e)
                           else f"failed ({e})")
                local.append(experts)
                continue
            slowest = max(slowest, seconds)
            w.failures = 0
            outputs.update(split_outputs(stacked, ids, experts))
            if last is None or link.answered_at > last[0]:
                last = (link.answered_at, link.round_trip_s, handled, seconds)
        if last is not None:  # the wire's own share: the network and both ends' reading and writing
            _, round_trip, handled, seconds = last
            self.transport.network_s += round_trip - handled
            self.transport.worker_io_s += handled - seconds
        if calls:
            _, late = ray.wait(list(calls.values()), num_returns=len(calls),
                               timeout=max(0.0, deadline - time.perf_counter()))
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
        self.transport.overlap_s += waiting - t0
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
    def hop_counters(self) -> dict:
        """Cumulative seconds of the MoE layers computed (Transport) and the faults, for a turn's
        profile (colibri/engine/turn_profile.py diffs two readings)."""
        t = self.transport
        return {"layers": t.layers, "wall_s": t.wall_s, "compute_s": t.compute_s, "transport_s": t.transport_s,
                "network_s": t.network_s, "worker_io_s": t.worker_io_s, "local_s": t.local_s,
                "overlap_s": t.overlap_s, "faults": self.faults}

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
        """Stop the workers (the Ray instance stays: it may serve others in this process). A
        head that dies without closing leaves them for the next head to adopt (or for their
        orphan watchdog)."""
        for w in self.workers if hasattr(self, "workers") else []:
            if w.link is not None:
                w.link.close()
            if w.handle is None:
                continue
            try:
                self._ray.kill(w.handle, no_restart=True)
            except Exception:
                pass
        if self._local_store is not None:
            self._local_store.close()
            self._local_store = None
