"""Expert-cache figures: cumulative ones from the expert source (and the VRAM tier above it),
and one generation's share of them."""
from __future__ import annotations

from colibri.io.expert_store import ExpertStore


def store_stats(experts, vram) -> dict | None:
    """The expert cache's cumulative figures, None when every expert is resident in RAM and no
    VRAM tier sits above (`vram`: the model's VRAM tier, or None)."""
    if hasattr(experts, "store_stats"):  # --cluster: the workers' stores, summed
        return experts.store_stats()
    stats = experts.stats.as_dict() if isinstance(experts, ExpertStore) else None
    if vram is not None:  # --device cuda: the VRAM tier above the RAM tier
        v = vram.stats.as_dict()
        if stats is None:  # every expert resident in RAM: each VRAM miss was a RAM hit
            stats = {"hits": v["vram_misses"], "misses": 0, "prefetch_hits": 0, "bytes_read": 0, "reads": 0,
                     "wait_s": 0.0, "hit_rate": 1.0 if v["vram_misses"] else 0.0}
        stats.update(v)
    return stats


def turn_stats(before: dict | None, after: dict | None) -> dict | None:
    """What changed between two `store_stats` readings, with the hit rates of that span."""
    if before is None or after is None:
        return None
    d = {k: after[k] - before[k] for k in ("hits", "misses", "prefetch_hits", "bytes_read", "reads", "wait_s")}
    asked = d["hits"] + d["misses"]
    d["hit_rate"] = d["hits"] / asked if asked else 0.0
    if "vram_hits" in after:  # --device cuda: the tier above
        v = {k: after[k] - before[k] for k in ("vram_hits", "vram_misses", "vram_bytes_uploaded", "vram_upload_s")}
        asked = v["vram_hits"] + v["vram_misses"]
        d.update(v, vram_hit_rate=v["vram_hits"] / asked if asked else 0.0)
    return d
