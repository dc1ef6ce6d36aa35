"""The expert-parallel plan for `--cluster` (colibri/cluster): which node each expert worker runs
on, the RAM budget it gets there, and the share of every MoE layer's experts it owns.

The rule (one, so a plan is reproducible):
- Workers go to the nodes round-robin in the order given (the head's node last, since it also
  holds the dense weights and the KV cache), so N workers over M nodes put ceil or floor(N/M)
  on each.
- A node's usable RAM (its memory less the policy's headroom, and less `head_bytes` on the
  head's node) is split evenly between the workers on it: that is each worker's budget.
- Each worker owns a share of every layer's experts proportional to its budget, so a worker on
  a larger node holds more; when the experts fit the workers' combined budgets every worker's
  shard fits its own budget (hit rate 1.0, no disk reads once loaded).
"""
from __future__ import annotations

from dataclasses import dataclass

from colibri.plan.policy import Policy, size_text


@dataclass
class Node:
    name: str            # an address or a Ray node id: how the user and Ray know it
    ram_bytes: int       # memory the node offers (Ray's `memory` resource, or MemAvailable here)
    head: bool = False   # the node the head process runs on


def plan_cluster(nodes: list[Node], workers: int, expert_bytes: int, head_bytes: int = 0,
                 policy: Policy | None = None) -> dict:
    """The plan as a dict: per worker its node, budget and share; whether the experts fit the
    workers' combined budgets. `expert_bytes`: all routed experts (blobs, as stored);
    `head_bytes`: what the head keeps on its node (dense weights, KV cache)."""
    p = policy or Policy()
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if not nodes:
        raise ValueError("a cluster plan needs at least one node")
    order = [n for n in nodes if not n.head] + [n for n in nodes if n.head]
    placed = [order[w % len(order)] for w in range(workers)]
    budgets = []
    for node in placed:
        usable = node.ram_bytes - max(p.ram_headroom_min_bytes, int(node.ram_bytes * p.ram_headroom_fraction))
        if node.head:
            usable -= head_bytes
        budgets.append(max(0, usable) // sum(1 for n in placed if n is node))
    total = sum(budgets)
    # Equal shares when no worker has room (the experts then stream inside every worker alike).
    shares = [b / total for b in budgets] if total else [1 / workers] * workers
    return {
        "workers": [{"worker": w, "node": placed[w].name, "budget_bytes": budgets[w], "share": shares[w],
                     "expert_bytes": int(expert_bytes * shares[w])} for w in range(workers)],
        "expert_bytes": expert_bytes, "budget_bytes": total, "fits": expert_bytes <= total,
    }


def describe_cluster_plan(plan: dict) -> str:
    lines = [f"cluster plan: {len(plan['workers'])} expert workers, {size_text(plan['expert_bytes'])} of experts, "
             f"{size_text(plan['budget_bytes'])} of worker budgets: "
             + ("every shard fits its worker's RAM" if plan["fits"] else "shards stream inside their workers")]
    for w in plan["workers"]:
        lines.append(f"  worker {w['worker']} on {w['node']}: {100 * w['share']:.0f}% of each layer's experts "
                     f"({size_text(w['expert_bytes'])}), budget {size_text(w['budget_bytes'])}")
    return "\n".join(lines)
