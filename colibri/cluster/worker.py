"""The Ray actor that holds one shard of routed experts and computes them for the head."""
from __future__ import annotations

import os
import time

import numpy as np
import ray

from colibri.cluster.shard import expert_outputs, open_shard
from colibri.io.container import Container
from colibri.threads import ThreadPolicy


@ray.remote(max_restarts=0, num_cpus=0)
class ExpertWorker:
    """An expert store of its own (this node's disk copy of the container and its own RAM
    budget) over the experts the placement gave it; `compute` returns each routed expert's
    weighted output rows for the head to sum (colibri/cluster/shard.py)."""

    def __init__(self, model_dir: str, owned: dict[str, list[int]], ram_bytes: int | None,
                 heat: dict[str, list[int]] | None, verify: bool, threads: int | None, activations: str):
        self.container = Container(model_dir)
        self.owned = owned
        self.store = open_shard(self.container, owned, ram_bytes, heat, verify)
        self.threads = ThreadPolicy(threads)
        self._warm(activations)

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
        """Called once after start: who and where this worker is."""
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "experts": sum(len(ids) for ids in self.owned.values()),
                "bytes_resident": self.store.bytes_resident}

    def compute(self, prefix: str, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, experts: list[int],
                one_token_rows: bool, activations: str) -> tuple[np.ndarray, float]:
        """(expert_outputs for `experts` of layer `prefix`, seconds spent computing)."""
        t0 = time.perf_counter()
        # Arrays from Ray's object store are read-only views; numba compiles read-only arrays as a
        # type of their own, which need not round as the head's writable arrays do.
        x, weights = (a if a.flags.writeable else a.copy() for a in (x, weights))
        out = expert_outputs(self.store, prefix, x, weights, ids, experts, one_token_rows, activations,
                             self.threads.apply())
        return out, time.perf_counter() - t0

    def stats(self) -> dict:
        return self.store.stats.as_dict()

    def heat_map(self) -> dict[str, tuple[list[int], str]]:
        """The store's routing counts and expert places (the head keeps the owned experts')."""
        return self.store.heat_map()
