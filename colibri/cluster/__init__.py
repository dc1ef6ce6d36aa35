"""Expert-parallel serving on Ray (`--cluster ADDRESS`, `--expert-workers N`).

The head process keeps the dense weights, attention, the KV cache and the scheduler; routed
experts are sharded over Ray actors (worker.py), each with an expert store of its own over the
same container (placement.py decides who owns what). The model hands each MoE layer's routed
work to `ClusterExperts.compute` (head.py): one round trip per worker per layer, the per-expert
outputs summed at the head in expert-id order (shard.py), so tokens never depend on placement
or on faults.

Imports run one way: cluster -> io, kernels, models; nothing outside imports it but the engine,
and only when --cluster is given (Ray is an optional dependency: the `cluster` extra).
"""
from __future__ import annotations

from pathlib import Path

from colibri.cluster.placement import PLACEMENTS, Placement, place
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.expert_store import load_history
from colibri.io.experts import GiB, plan_budget

DEFAULT_WORKERS = 2


def open_cluster_experts(container: Container, config, history_file: Path | None = None, out=None):
    """ClusterExperts for EngineConfig `config` (cluster, expert_workers, expert_placement,
    worker_ram_gb, threads, activations, verify_experts, ram_gb), its placement printed to `out`
    (a text stream; None: not printed)."""
    from colibri.cluster.head import ClusterExperts, connect

    workers = config.expert_workers or DEFAULT_WORKERS
    if config.worker_ram_gb is not None and config.worker_ram_gb <= 0:
        raise ColibriError(f"--worker-ram-gb must be positive, not {config.worker_ram_gb}")
    history = load_history(history_file) if history_file is not None else {}
    placement = place(container, workers, config.expert_placement, history)
    if out is not None:
        print(placement.describe(), file=out, flush=True)
    connect(config.cluster)
    # The head computes a failed worker's experts from its own disk copy; what its budget
    # leaves beside the dense weights caches them (at most the largest shard).
    largest = max(placement.bytes_of(w) for w in range(workers))
    fallback = min(largest, max(0, plan_budget(config.ram_gb) - container.dense_bytes))
    worker_ram = None if config.worker_ram_gb is None else int(config.worker_ram_gb * GiB)
    return ClusterExperts(container, placement, worker_ram_bytes=worker_ram, heat=history or None,
                          verify=bool(config.verify_experts), threads=config.threads,
                          activations=config.activations, fallback_bytes=fallback)


__all__ = ["open_cluster_experts", "place", "Placement", "PLACEMENTS", "DEFAULT_WORKERS"]
