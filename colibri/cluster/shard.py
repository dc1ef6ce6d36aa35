"""A shard of routed experts: its expert store, and the per-expert outputs computed from it.

Both the Ray workers and the head (when a worker fails) compute through `expert_outputs`, and
the head adds the outputs up in `sum_in_id_order`. Together they do what
colibri.models.moe.run_experts / run_experts_rows do in one process, operation for operation:
the same compiled calls per expert and row, the same float32 products with the routing weight,
and the same sum (from zero, ascending expert id, each row on its own), so the tokens are the
same bits whoever computed which expert.
"""
from __future__ import annotations

import math

import numpy as np

from colibri.io.container import Container
from colibri.io.expert_store import ExpertStore, StoreConfig
from colibri.kernels import idot
from colibri.kernels.moe import one_expert
from colibri.models.moe import swiglu_expert


def open_shard(container: Container, owned: dict[str, list[int]], ram_bytes: int | None,
               heat: dict[str, list[int]] | None = None, verify: bool = True, read_threads: int = 2) -> ExpertStore:
    """An ExpertStore over `container` that pins the experts this shard owns (prefix -> ids).

    `ram_bytes` None: room for the whole shard, all pinned at start (read now, so the first
    token does not wait on disk). A smaller budget: the usual store under it, half its slots
    pinned to the shard's hottest experts (by `heat`, the head's routing history) and the
    rest one LRU, as a single process streams."""
    layouts = container.expert_layouts
    blob_total = sum(l.blob_bytes for l in layouts.values())
    owned_count = sum(len(ids) for ids in owned.values())
    whole = math.ceil(owned_count / max(1, len(layouts))) * blob_total
    fits = ram_bytes is None or ram_bytes >= whole
    # The store pins the experts with the highest counts that are above zero: +1 makes every
    # owned expert a candidate, 0 keeps the others out.
    history = {}
    for prefix, ids in owned.items():
        counts = np.zeros(layouts[prefix].num_experts, np.int64)
        past = (heat or {}).get(prefix)
        for e in ids:
            counts[e] = 1 + (int(past[e]) if past is not None and len(past) == len(counts) else 0)
        history[prefix] = counts.tolist()
    config = StoreConfig(ram_bytes=whole if fits else int(ram_bytes), io="pread", threads=read_threads,
                         hot_fraction=1.0 if fits else 0.5, prefetch=False, verify=verify, history=history)
    return ExpertStore(container, config)


def expert_outputs(source, prefix: str, x: np.ndarray, weights: np.ndarray, ids: np.ndarray,
                   experts: list[int], one_token_rows: bool, activations: str, nthreads: int) -> np.ndarray:
    """weight * expert(row) for each of `experts` (ascending) and each row of x [L, D] routed to
    it (ids, weights [L, K]), stacked expert by expert, rows ascending within an expert ->
    [rows routed to these experts, D].

    `one_token_rows`: every row is a decode token of its own (run_experts on one row, or
    run_experts_rows), computed as colibri.models.moe's one-token path does (the fused kernel,
    one expert per call) or, for blob formats that kernel does not take, as run_experts on that one row.
    Otherwise x is a prefill chunk: each expert runs on all its rows at once (run_experts)."""
    kernel = source.fused(prefix) if one_token_rows else None
    parts: dict[int, np.ndarray] = {}
    with idot.activations(activations):
        if kernel is not None:
            for e, blob in source.iter_experts(prefix, experts, blobs=True):
                rows, slots = np.nonzero(ids == e)
                parts[e] = np.stack([one_expert(kernel, np.ascontiguousarray(x[r], dtype=np.float32), blob,
                                                np.float32(weights[r, k]), nthreads, activations)
                                     for r, k in zip(rows, slots)])
        else:
            for e, ew in source.iter_experts(prefix, experts):
                rows, slots = np.nonzero(ids == e)
                if one_token_rows:
                    ys = [swiglu_expert(np.ascontiguousarray(x[[r]]), ew) * weights[[r], [k]][:, None]
                          for r, k in zip(rows, slots)]
                    parts[e] = np.concatenate(ys)
                else:
                    parts[e] = swiglu_expert(np.ascontiguousarray(x[rows]), ew) * weights[rows, slots][:, None]
    return np.concatenate([parts[e] for e in sorted(parts)]) if parts else np.zeros((0, x.shape[1]), x.dtype)


def sum_in_id_order(x: np.ndarray, ids: np.ndarray, outputs: dict[int, np.ndarray]) -> np.ndarray:
    """The routed experts' sum [L, D] from each expert's rows (expert_outputs, split per expert):
    from zero, in ascending expert id, each row its own sum, as colibri.models.moe's run_experts
    and its expert-by-expert path add them."""
    out = np.zeros_like(x)
    for e in sorted(outputs):
        rows, _ = np.nonzero(ids == e)
        out[rows] += outputs[e]
    return out


def split_outputs(stacked: np.ndarray, ids: np.ndarray, experts: list[int]) -> dict[int, np.ndarray]:
    """expert_outputs' stack -> {expert: its rows}."""
    out, pos = {}, 0
    for e in experts:
        n = int(np.count_nonzero(ids == e))
        out[e] = stacked[pos:pos + n]
        pos += n
    return out
