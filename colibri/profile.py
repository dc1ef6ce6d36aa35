"""Where a forward pass spends its time, by phase and layer (`colibri bench`'s breakdown).

The models report each block as they run it (attention; the feed-forward, and inside a MoE
block its router, routed experts and shared experts) to the module's PHASES clock, which
adds up seconds only while a measurement is on: off, a report is one attribute test. The
routed experts' time includes waiting for the disk; the expert store measures that wait
separately (StoreStats.wait_s), and `breakdown` subtracts it.
"""
from __future__ import annotations

import time
from collections import defaultdict

clock = time.perf_counter


class PhaseClock:
    def __init__(self):
        self.on = False
        self.seconds: dict[tuple[str, int], float] = defaultdict(float)  # (phase, layer) -> s

    def add(self, phase: str, layer: int, t0: float) -> None:
        """Count the time since t0 (from `clock()`) to `phase` of decoder layer `layer` (-1:
        outside the layers)."""
        self.seconds[(phase, layer)] += clock() - t0

    def start(self) -> None:
        self.seconds.clear()
        self.on = True

    def stop(self) -> dict[tuple[str, int], float]:
        self.on = False
        return dict(self.seconds)


PHASES = PhaseClock()


def phase_bytes(container) -> dict[str, int]:
    """The weight bytes one decoded token reads in each of breakdown's phases, from the model's
    tensors by name: attention (every layer's attention block, whatever its kind), routing (the
    routers), dense_mlp (dense feed-forwards, shared experts), head (the output head, or the
    tied embedding it reads) and routed_experts (the top-k experts of every MoE layer). Norms and
    the embedding's one row are left out: a few KB."""
    out = dict.fromkeys(("attention", "dense_mlp", "routing", "routed_experts", "head"), 0)
    names = container.manifest["tensors"]
    for name in names:
        if "norm" in name or "embed_tokens" in name:
            continue
        phase = ("head" if name.startswith("lm_head") else
                 "routing" if ".mlp.gate." in name or ".mlp.router." in name else
                 "attention" if "attn" in name else
                 "dense_mlp" if ".mlp." in name else None)
        if phase:
            out[phase] += container.tensor_bytes(name)
    if "lm_head.weight" not in names:
        out["head"] += container.tensor_bytes("model.embed_tokens.weight")
    top_k = int(container.config.get("num_experts_per_tok") or 0)
    out["routed_experts"] = top_k * sum(layout.blob_bytes for layout in container.expert_layouts.values())
    return out


def breakdown(seconds: dict[tuple[str, int], float], total_s: float, tokens: int, disk_wait_s: float,
              layer_kinds: list[str], full_kinds: list[str] | None = None,
              weight_bytes: dict[str, int] | None = None) -> dict:
    """Per-token seconds by phase, per-layer means by layer kind, and, when `full_kinds` (the
    whole model's layer kinds, "dense" or "moe") is longer than the measured `layer_kinds`, the
    projected seconds per token of the whole model: the embedding, head and glue once, every
    layer at the measured mean of its kind. With `weight_bytes` (phase_bytes), each phase's
    weights read per second ("gb_per_s"): against the machine's read bandwidth, how far each
    phase is from the memory roof."""
    def total(phase, layers=None):
        return sum(s for (p, l), s in seconds.items() if p == phase and (layers is None or l in layers))

    dense = {i for i, k in enumerate(layer_kinds) if k == "dense"}
    moe = {i for i, k in enumerate(layer_kinds) if k == "moe"}
    per_tok = {
        "attention": total("attention"),
        "dense_mlp": total("ffn", dense) + total("shared_experts"),
        "routing": total("router"),
        "routed_experts": max(0.0, total("routed_experts") - disk_wait_s),
        "disk_wait": disk_wait_s,
        "head": total("head") + total("embed"),
    }
    # The rest: glue inside MoE blocks (weights, sums) and between layers, the cache's upkeep.
    per_tok["other"] = max(0.0, total_s - sum(per_tok.values()))
    per_tok = {k: v / tokens for k, v in per_tok.items()}
    layer = {"attention": total("attention") / tokens / max(1, len(layer_kinds))}
    if dense:
        layer["dense_ffn"] = total("ffn", dense) / tokens / len(dense)
    if moe:
        layer["moe_ffn"] = total("ffn", moe) / tokens / len(moe)
    out = {"per_token_s": per_tok, "total_s": total_s / tokens, "per_layer_s": layer}
    if weight_bytes:
        out["gb_per_s"] = {p: n / 1e9 / per_tok[p] for p, n in weight_bytes.items() if n and per_tok.get(p)}
    if full_kinds and len(full_kinds) > len(layer_kinds):
        outside = total_s / tokens - sum(
            layer["attention"] + layer.get("dense_ffn" if k == "dense" else "moe_ffn", 0.0) for k in layer_kinds)
        full = outside + sum(layer["attention"] + layer.get("dense_ffn" if k == "dense" else "moe_ffn", 0.0)
                             for k in full_kinds)
        out["projection"] = {"layers_measured": len(layer_kinds), "layers_full": len(full_kinds),
                             "seconds_per_token": full, "tok_s": 1.0 / full if full > 0 else None,
                             "note": "projected: each layer of the full model at the measured mean of its "
                                     "kind, the same hit rate in every MoE layer"}
    return out
