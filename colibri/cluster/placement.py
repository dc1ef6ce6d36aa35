"""Which expert worker owns which routed experts: every expert of every MoE layer has exactly
one owner. Placement decides speed and memory per worker, never tokens (the head sums every
expert's output in expert-id order whoever computed it)."""
from __future__ import annotations

from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.io.container import Container

PLACEMENTS = ("contiguous", "balanced")


@dataclass
class Placement:
    workers: int
    how: str
    owner: dict[str, list[int]]      # MoE layer prefix -> worker of each expert [E]
    blob_bytes: dict[str, int]       # MoE layer prefix -> bytes of one expert blob

    def experts_of(self, worker: int) -> dict[str, list[int]]:
        """prefix -> the experts `worker` owns, ascending."""
        return {p: [e for e, w in enumerate(owners) if w == worker] for p, owners in self.owner.items()}

    def bytes_of(self, worker: int) -> int:
        return sum(self.blob_bytes[p] * len(ids) for p, ids in self.experts_of(worker).items())

    def describe(self) -> str:
        """One line per worker: how many experts it owns, their bytes, and which (the first
        layer's ids; contiguous placement gives every layer the same ranges)."""
        lines = [f"expert placement ({self.how}, {self.workers} workers, {len(self.owner)} MoE layers):"]
        first = next(iter(self.owner), None)
        for w in range(self.workers):
            mine = self.experts_of(w)
            n = sum(len(ids) for ids in mine.values())
            ids = _ranges(mine[first]) if first is not None else "-"
            lines.append(f"  worker {w}: {n} experts, {self.bytes_of(w) / 2**30:.2f} GiB; {first}: {ids}")
        return "\n".join(lines)


def place(container: Container, workers: int, how: str = "contiguous",
          history: dict[str, list[int]] | None = None, shares: list[float] | None = None) -> Placement:
    """Contiguous: worker w owns experts [w*E/N, (w+1)*E/N) of every layer. Balanced: each
    layer's experts sorted by routing history (hottest first) are dealt to the workers in snake
    order (0, 1, ..., N-1, N-1, ..., 0, ...), so each worker holds the same number of experts and
    about the same share of the routed work; with no history it is the contiguous placement.

    `shares` (the cluster plan's, colibri/plan/cluster.py: proportional to each worker's RAM
    budget) replaces the equal split: contiguous ranges sized by share, and balanced dealing
    that gives each expert to the worker furthest below its share."""
    if how not in PLACEMENTS:
        raise ColibriError(f"expert placement must be one of {', '.join(PLACEMENTS)}, not {how!r}")
    layouts = container.expert_layouts
    if not layouts:
        raise ColibriError(f"{container.dir} has no routed experts: --cluster serves MoE models only")
    smallest = min(l.num_experts for l in layouts.values())
    if not 1 <= workers <= smallest:
        raise ColibriError(f"--expert-workers must be between 1 and {smallest} (the experts per layer), not {workers}")
    if shares is not None and (len(shares) != workers or min(shares) < 0 or not sum(shares) > 0):
        raise ColibriError(f"expert shares must be {workers} non-negative numbers with a positive sum, not {shares}")
    equal = shares is None or max(shares) - min(shares) < 1e-9
    owner = {}
    for prefix, layout in layouts.items():
        E = layout.num_experts
        counts = (history or {}).get(prefix)
        if how == "balanced" and counts is not None and len(counts) == E and any(counts):
            order = sorted(range(E), key=lambda e: (-counts[e], e))
            owners = [0] * E
            if equal:
                for rank, e in enumerate(order):
                    turn, pos = divmod(rank, workers)
                    owners[e] = pos if turn % 2 == 0 else workers - 1 - pos
            else:
                held = [0] * workers
                for e in order:  # to the worker furthest below its share (lowest index on ties)
                    w = min((w for w in range(workers) if shares[w] > 0), key=lambda w: (held[w] / shares[w], w))
                    owners[e], held[w] = w, held[w] + 1
        elif equal:
            owners = [e * workers // E for e in range(E)]
        else:
            total, bounds, acc = sum(shares), [], 0.0
            for share in shares:  # the end of each worker's range, in experts
                acc += share
                bounds.append(E if acc >= total - 1e-9 else round(E * acc / total))
            owners = [next(w for w, b in enumerate(bounds) if e < b) for e in range(E)]
        owner[prefix] = owners
    return Placement(workers, how, owner, {p: l.blob_bytes for p, l in layouts.items()})


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out, start = [], None
    for i, e in enumerate(ids):
        if start is None:
            start = e
        if i + 1 == len(ids) or ids[i + 1] != e + 1:
            out.append(f"{start}" if start == e else f"{start}-{e}")
            start = None
    return ", ".join(out) or "-"
