"""The Ray actor that holds one shard of routed experts and computes them for the head.

The head reaches it two ways: Ray calls (start, ready, stats, heat maps, and compute when the
head's transport is "ray") and its WireServer (wire.py: compute over a plain TCP connection,
the default data path). A worker is a named detached actor, so a head that restarts finds it
with its shard still loaded; one that no head has connected to for `orphan_s` exits.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import ray

from colibri.cluster.shard import expert_outputs, open_shard
from colibri.cluster.wire import WireServer
from colibri.io.container import Container
from colibri.threads import ThreadPolicy


@ray.remote(max_restarts=0, num_cpus=0)
class ExpertWorker:
    """An expert store of its own (this node's disk copy of the container and its own RAM
    budget) over the experts the placement gave it; `compute` returns each routed expert's
    weighted output rows for the head to sum (colibri/cluster/shard.py)."""

    def __init__(self, model_dir: str, owned: dict[str, list[int]], ram_bytes: int | None,
                 heat: dict[str, list[int]] | None, verify: bool, threads: int | None, activations: str,
                 secret: bytes | None = None, orphan_s: float | None = None, identity: str = ""):
        self.container = Container(model_dir)
        self.owned = owned
        self.identity = identity  # the digest its actor name carries (head._identity_of), reported by ready()
        self.store = open_shard(self.container, owned, ram_bytes, heat, verify)
        self.threads = ThreadPolicy(threads)
        self._lock = threading.Lock()  # one compute at a time, whichever path it came by
        self._warm(activations)
        self.wire = None
        if secret is not None:  # on this node's own address only (see wire.py)
            self.wire = WireServer(ray.util.get_node_ip_address(), secret, self._compute)
        self._last_call = time.monotonic()
        if orphan_s:
            threading.Thread(target=self._watch_orphan, args=(orphan_s,), name="colibri-orphan", daemon=True).start()

    def _watch_orphan(self, orphan_s: float) -> None:
        """Exit once no head has been connected or called for orphan_s: a head that crashed and
        never came back must not leave its shard holding a node's memory for ever."""
        while True:
            time.sleep(min(5.0, orphan_s / 4))
            wire_busy = self.wire is not None and self.wire.connected > 0
            last = max(self._last_call, self.wire.last_seen if self.wire is not None else 0.0)
            if not wire_busy and time.monotonic() - last > orphan_s:
                os._exit(0)

    def _warm(self, activations: str) -> None:
        """Compile (or load from numba's disk cache) the kernels a decode token and a prefill
        chunk call, so the first real request answers within the head's deadline; then clear
        the counts it left."""
        prefix, ids = next(((p, ids) for p, ids in self.owned.items() if ids), (None, []))
        if prefix is None:
            return
        D = next(iter(self.container.expert_layouts[prefix].projections.values()))["shape"][1]
        # A decode row, and prefill experts with one row (the decode kernels) and with two (matmul).
        for rows, one_token_rows in ((1, True), (1, False), (2, False)):
            x = np.zeros((rows, D), np.float32)
            route = np.full((rows, 1), ids[0], np.int64)
            expert_outputs(self.store, prefix, x, np.ones((rows, 1), np.float32), route, ids[:1],
                           one_token_rows, activations, self.threads.apply())
        self.store.reset_counters()

    def ready(self) -> dict:
        """Called after start, and by a head that finds this worker by name: who and where
        this worker is, and the port of its wire server (None: Ray calls only)."""
        self._last_call = time.monotonic()
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "experts": sum(len(ids) for ids in self.owned.values()),
                "bytes_resident": self.store.bytes_resident, "identity": self.identity,
                "port": self.wire.port if self.wire is not None else None}

    def compute(self, prefix: str, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, experts: list[int],
                one_token_rows: bool, activations: str) -> tuple[np.ndarray, float]:
        """(expert_outputs for `experts` of layer `prefix`, seconds spent computing)."""
        self._last_call = time.monotonic()
        # Arrays from Ray's object store are read-only views; numba compiles read-only arrays as a
        # type of their own, which need not round as the head's writable arrays do.
        x, weights = (a if a.flags.writeable else a.copy() for a in (x, weights))
        return self._compute(prefix, x, weights, ids, experts, one_token_rows, activations)

    def _compute(self, prefix, x, weights, ids, experts, one_token_rows, activations):
        with self._lock:
            t0 = time.perf_counter()
            out = expert_outputs(self.store, prefix, x, weights, ids, experts, one_token_rows, activations,
                                 self.threads.apply())
            return out, time.perf_counter() - t0

    def adopt(self, secret: bytes) -> dict:
        """A head that found this worker by name takes it over: the wire now wants its secret
        (the old head's connection, if any is left, keeps working until it closes)."""
        if self.wire is not None:
            self.wire.secret = secret
        return self.ready()

    def stats(self) -> dict:
        with self._lock:
            return self.store.stats.as_dict()

    def heat_map(self) -> dict[str, tuple[list[int], str]]:
        """The store's routing counts and expert places (the head keeps the owned experts')."""
        return self.store.heat_map()
