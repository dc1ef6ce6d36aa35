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
    worker_ram_gb, threads, activations, verify_experts, ram_gb): the cluster plan
    (colibri/plan/cluster.py: each worker's node, budget and share of the experts, from the
    cluster's nodes and their memory) and the placement it gives, both printed to `out` (a text
    stream; None: not printed)."""
    from colibri.cluster.head import ClusterExperts, cluster_nodes, connect
    from colibri.plan.cluster import Node, describe_cluster_plan, plan_cluster

    workers = config.expert_workers or DEFAULT_WORKERS
    if config.worker_ram_gb is not None and config.worker_ram_gb <= 0:
        raise ColibriError(f"--worker-ram-gb must be positive, not {config.worker_ram_gb}")
    connect(config.cluster)
    nodes = cluster_nodes()
    plan = plan_cluster([Node(n["address"], n["ram_bytes"], n["head"]) for n in nodes], workers,
                        container.expert_bytes, head_bytes=container.dense_bytes)
    history = load_history(history_file) if history_file is not None else {}
    placement = place(container, workers, config.expert_placement, history,
                      shares=[w["share"] for w in plan["workers"]])
    if out is not None:
        print(describe_cluster_plan(plan), file=out, flush=True)
        print(placement.describe(), file=out, flush=True)
    # Where the plan put each worker; its budget only when the shards do not fit (a fitting shard
    # is held whole and read at start) and no --worker-ram-gb overrides it.
    worker_nodes = [w["node"] for w in plan["workers"]]  # addresses: a restarted node keeps its workers
    budgets = None
    if config.worker_ram_gb is None and not plan["fits"]:
        budgets = [max(1, w["budget_bytes"]) for w in plan["workers"]]
    # The head computes a failed worker's experts from its own disk copy; what its budget
    # leaves beside the dense weights caches them (at most the largest shard).
    largest = max(placement.bytes_of(w) for w in range(workers))
    fallback = min(largest, max(0, plan_budget(config.ram_gb) - container.dense_bytes))
    worker_ram = None if config.worker_ram_gb is None else int(config.worker_ram_gb * GiB)
    return ClusterExperts(container, placement, worker_ram_bytes=worker_ram, worker_budgets=budgets,
                          worker_nodes=worker_nodes, heat=history or None, history_file=history_file, verify=bool(config.verify_experts),
                          threads=config.threads, activations=config.activations, fallback_bytes=fallback,
                          wire=config.cluster_wire)


__all__ = ["open_cluster_experts", "place", "Placement", "PLACEMENTS", "DEFAULT_WORKERS"]
