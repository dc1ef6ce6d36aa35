"""The placement plan: budgets per tier, expert cache slots, the projected speed and its bound,
for one model on one machine (the rule: colibri/plan/__init__.py), and the Engine.load options
`--auto-tier` takes from it."""
from __future__ import annotations

import os

from colibri.errors import ColibriError
from colibri.plan.facts import ExpertLayer, ModelFacts, analyze_model
from colibri.plan.machine import Machine, probe_machine
from colibri.plan.policy import DEFAULT_MAX_CONTEXT, PLAN_VERSION, GiB, Policy, size_text
from colibri.workspace import prefill_workspace_bytes

# Suggest `--kv-cache f16` when one conversation's cache at full context is at least this share
# of the dense weights: a token at that length reads the cache on top of the weights, so the
# cache's element type then moves decode speed (and memory) as much as the weights' do.
KV_F16_HINT_SHARE = 0.5


def _slots_bytes(layers: list[ExpertLayer], slots: int, taken: list[int] | None = None) -> int:
    return sum(min(slots, layer.num_experts - (taken[i] if taken else 0)) * layer.expert_bytes
               for i, layer in enumerate(layers))


def _max_slots(layers: list[ExpertLayer], budget: int, taken: list[int] | None = None) -> int:
    """The most slots per layer whose experts fit in `budget` bytes (bisection: bytes grow with slots)."""
    if not layers or budget <= 0:
        return 0
    lo, hi = 0, max(layer.num_experts for layer in layers)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _slots_bytes(layers, mid, taken) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _harmonic(n: int) -> float:
    return sum(1.0 / i for i in range(1, n + 1))


def _hit_range(layers: list[ExpertLayer], cached: list[int]) -> tuple[float, float]:
    """(uniform routing, Zipf(1) routing) share of expert uses served from the cache."""
    if not layers:
        return 1.0, 1.0
    lo = sum(min(c, layer.num_experts) / layer.num_experts for c, layer in zip(cached, layers)) / len(layers)
    hi = sum(_harmonic(min(c, layer.num_experts)) / _harmonic(layer.num_experts)
             for c, layer in zip(cached, layers)) / len(layers)
    return lo, hi


def build_plan(model: ModelFacts, machine: Machine, ram_gb: float | None = None, vram_gb: float | None = None,
               max_context: int | None = None, policy: Policy | None = None) -> dict:
    """The placement plan for `model` on `machine` (the rule: colibri/plan/__init__.py)."""
    p = policy or Policy()
    warnings: list[dict] = []

    def warn(level: str, message: str) -> None:
        warnings.append({"level": level, "message": message})

    context = max_context or min(model.model_max_context, DEFAULT_MAX_CONTEXT)
    layers = model.expert_layers
    state_bytes = model.state_bytes_per_slot * p.kv_slots  # a hybrid's recurrent state: per slot, not per token
    kv_bytes = model.kv_bytes_per_token * context * p.kv_slots + state_bytes
    max_blob = max((layer.expert_bytes for layer in layers), default=0)
    staging = 2 * min(model.top_k, max((layer.num_experts for layer in layers), default=0)) * max_blob

    # RAM limit: available minus headroom, or the user's figure (never above that).
    ram_avail = machine.ram_available_bytes
    ram_headroom = max(p.ram_headroom_min_bytes, int(ram_avail * p.ram_headroom_fraction))
    ram_limit = max(0, ram_avail - ram_headroom)
    # VRAM: each GPU's free memory minus headroom; dense weights go to the first GPU when they fit.
    gpu_usable = [max(0, g.free_bytes - max(p.vram_headroom_min_bytes, int(g.total_bytes * p.vram_headroom_fraction)))
                  for g in machine.gpus]
    vram_limit = sum(gpu_usable)
    if vram_gb is not None:
        vram_limit = min(vram_limit, int(vram_gb * GiB))
    dense_in_vram = bool(gpu_usable) and min(gpu_usable[0], vram_limit) >= model.dense_bytes + kv_bytes
    vram_dense = model.dense_bytes + kv_bytes if dense_in_vram else 0

    ram_dense = 0 if dense_in_vram else model.dense_bytes
    ram_kv = 0 if dense_in_vram else kv_bytes
    prefill = prefill_workspace_bytes(model.config, p.prefill_chunk, context, machine.cores)
    ram_runtime = p.runtime_bytes + staging + prefill
    ram_fixed = ram_dense + ram_kv + ram_runtime
    if ram_gb is not None:  # like the engine's --ram-gb: weights only (dense + cached experts)
        asked = int(ram_gb * GiB) + ram_kv + ram_runtime
        if asked > ram_limit:
            warn("warning", f"--ram-gb {ram_gb:g} plus KV cache and runtime is more than this machine can give "
                            f"({size_text(ram_limit)} available after {size_text(ram_headroom)} headroom); "
                            f"planning with {size_text(ram_limit)}")
        else:
            ram_limit = asked
    fits = ram_fixed <= ram_limit
    if not fits:
        warn("error", f"the dense part does not fit: dense weights {size_text(ram_dense)} + KV cache "
                      f"{size_text(ram_kv)} ({context} tokens) + runtime {size_text(ram_runtime)} need "
                      f"{size_text(ram_fixed)}, the RAM limit is {size_text(ram_limit)}; use a machine with more "
                      "memory (or a GPU), a shorter --max-context, or a smaller quantization")

    vram_slots = _max_slots(layers, vram_limit - vram_dense) if machine.gpus else 0
    vram_taken = [min(vram_slots, layer.num_experts) for layer in layers]
    ram_slots = _max_slots(layers, ram_limit - ram_fixed, vram_taken) if fits else 0
    ram_taken = [min(ram_slots, layer.num_experts - t) for layer, t in zip(layers, vram_taken)]
    vram_experts, ram_experts = sum(vram_taken), sum(ram_taken)
    vram_expert_bytes = sum(t * layer.expert_bytes for t, layer in zip(vram_taken, layers))
    ram_expert_bytes = sum(t * layer.expert_bytes for t, layer in zip(ram_taken, layers))
    cached = [a + b for a, b in zip(vram_taken, ram_taken)]

    # Projection for one decoded token.
    hit_lo, hit_hi = _hit_range(layers, cached)
    vram_share = _hit_range(layers, vram_taken)[0] if layers else 0.0
    # Striped over identical drives (--mirror), each expert is read from one of them and reads
    # are in flight on all at once: the drives' rates add up.
    drives = max(1, machine.drives)
    disk_gbs = (machine.disk_read_gbs or p.disk_gbs) * drives
    mem_gbs = machine.mem_read_gbs or p.mem_gbs
    active = model.active_expert_bytes
    miss_hi, miss_lo = active * (1 - hit_lo), active * (1 - hit_hi)   # bytes from disk per token
    cpu_bytes = (0 if dense_in_vram else model.dense_bytes_per_token) + active * (1 - vram_share)
    gpu_bytes = (model.dense_bytes_per_token if dense_in_vram else 0) + active * vram_share
    gpu_bw = next((g.bandwidth_gbs for g in machine.gpus if g.bandwidth_gbs), None) or p.gpu_bandwidth_gbs
    t_disk_lo, t_disk_hi = miss_lo / (disk_gbs * 1e9), miss_hi / (disk_gbs * 1e9)
    t_mem = cpu_bytes / (mem_gbs * 1e9)
    t_compute = cpu_bytes / (p.kernel_gbs_per_core * max(machine.cores, 1) * 1e9)
    t_gpu = gpu_bytes / (gpu_bw * 1e9)
    t_overhead = p.overhead_per_layer_s * max(model.num_layers, 1)
    t_cpu = max(t_mem, t_compute) + t_overhead + t_gpu
    tok_lo = 1.0 / (t_disk_hi + t_cpu * p.cpu_slow_factor)
    tok_hi = 1.0 / max(t_disk_lo, t_cpu * p.cpu_fast_factor)
    t_disk_mid = (t_disk_lo + t_disk_hi) / 2
    if not fits:
        bottleneck = "memory"
        why = "the dense part does not fit in RAM"
    else:
        costs = {"disk": t_disk_mid, "memory": t_mem, "compute": t_compute + t_overhead}
        bottleneck = max(costs, key=costs.get)
        striped = f" ({drives} drives)" if drives > 1 else ""
        why = {"disk": f"{size_text(int((miss_lo + miss_hi) / 2))} of expert misses per token at {disk_gbs:.2f} GB/s"
                       f"{striped}",
               "memory": f"{size_text(int(cpu_bytes))} of weights per token at {mem_gbs:.1f} GB/s",
               "compute": f"{size_text(int(cpu_bytes))} of weights per token through the kernels on "
                          f"{machine.cores} cores, plus {t_overhead * 1000:.0f} ms of per-layer overhead"}[bottleneck]

    # Advice.
    if not machine.gpus:
        warn("info", "no GPU found: dense weights and the expert cache stay in RAM")
    else:
        warn("info", "the GPU holds the plan's VRAM tier with --device cuda (or auto): dense weights, the KV "
                     "cache and routed experts up to --vram-gb (--auto-tier applies the plan's)")
    disk_only = model.expert_count - vram_experts - ram_experts
    if fits and disk_only and machine.disk_read_gbs is not None and machine.disk_read_gbs * drives < p.slow_disk_gbs:
        warn("warning", f"slow disk ({machine.disk_read_gbs * drives:.2f} GB/s): {disk_only} experts are read from "
                        "it on demand")
    if fits and layers and 0 < cached[0] < model.top_k:
        warn("warning", f"the cache holds {min(cached)} experts per layer, fewer than top-k ({model.top_k}): "
                        "most expert uses will read from disk")
    if fits and layers and disk_only == 0:
        warn("info", "every expert fits in memory: the disk leaves the decode path after warm-up")
    if fits and bottleneck == "compute":
        warn("info", "compute-bound: `--activations int8` does the int4 matrix products in integer arithmetic "
                     "(measured 1.13-1.24x faster decode on a 2-core AVX-512 VNNI machine and 1.16-1.41x on a "
                     "2-core AVX2-only AMD EPYC, docs/benchmarks.md: Quality, Qwen3-30B-A3B shapes), at a small "
                     "fidelity cost (SmolLM2: KL 1.8e-3 against the exact path, perplexity +0.2%) and slower "
                     "prefill; it changes tokens, so it stays opt-in")
    per_conversation = model.kv_bytes_per_token * context
    if (not model.config.get("kv_lora_rank") and not dense_in_vram
            and per_conversation >= KV_F16_HINT_SHARE * model.dense_bytes):
        # MLA's latent cache and the GPU path stay float32 (EngineConfig.kv_cache)
        warn("info", f"at {context} tokens of context one conversation's KV cache is {per_conversation / GiB:.2f} "
                     f"GiB ({per_conversation / max(model.dense_bytes, 1):.1f}x the dense weights), all of it read "
                     "for each token at that length: `--kv-cache f16` halves both (SmolLM2 at 8k tokens, measured: "
                     "decode 1.21x -> 1.88x llama.cpp, docs/benchmarks.md: Decode after long contexts); K and V are rounded "
                     "to float16, so it stays opt-in")
    if not layers:
        warn("info", "a dense model (no routed experts): nothing streams; it runs from memory")
    if model.kind == "hf":
        warn("info", "a Hugging Face checkpoint: sizes are estimated for `colibri convert --bits 4`; convert it to run it")
    if model.kind == "config":
        warn("info", "config.json alone: sizes are estimated from its shapes for `colibri convert --bits 4`")
    if model.slice_layers:
        warn("info", f"projected from a {model.slice_layers}-layer slice to the full model's {model.num_layers} "
                     "layers: this plan is for the full model, not for the slice on disk")

    ram_budget = ram_fixed + ram_expert_bytes if fits else ram_fixed
    return {
        "version": PLAN_VERSION,
        "model": {
            "dir": model.dir, "kind": model.kind, "model_type": model.model_type,
            "layers": model.num_layers, "moe_layers": len(layers), "dense_bytes": model.dense_bytes,
            "expert_bytes": model.expert_bytes, "expert_count": model.expert_count,
            "experts_per_layer": max((layer.num_experts for layer in layers), default=0),
            "expert_size_bytes": max_blob, "top_k": model.top_k,
            "active_bytes_per_token": model.dense_bytes_per_token + model.active_expert_bytes,
            "disk_bytes": model.disk_bytes, "context": context,
            # > 0: sizes projected to `layers` from a slice holding this many (tools/synthetic_moe.py --layers)
            "slice_layers": model.slice_layers,
            "synthetic": model.config.get("colibri_synthetic"),  # a synthetic model's preset, seed, width
        },
        "machine": machine.to_dict(),
        "tiers": {
            "vram": {"available_bytes": sum(g.free_bytes for g in machine.gpus), "limit_bytes": vram_limit,
                     "budget_bytes": vram_dense + vram_expert_bytes, "dense_bytes": vram_dense,
                     "expert_bytes": vram_expert_bytes, "experts": vram_experts, "slots_per_layer": vram_slots},
            "ram": {"available_bytes": ram_avail, "headroom_bytes": ram_headroom, "limit_bytes": ram_limit,
                    "budget_bytes": ram_budget, "dense_bytes": ram_dense, "kv_bytes": ram_kv,
                    "runtime_bytes": ram_runtime, "prefill_bytes": prefill, "expert_bytes": ram_expert_bytes,
                    "experts": ram_experts,
                    "slots_per_layer": ram_slots},
            "disk": {"bytes": model.disk_bytes, "expert_bytes": model.expert_bytes,
                     "experts": model.expert_count, "experts_disk_only": disk_only,
                     "read_gbs": machine.disk_read_gbs},
        },
        "cache_slots_per_layer": {"vram": vram_slots, "ram": ram_slots, "total": vram_slots + ram_slots},
        "dense_tier": "vram" if dense_in_vram else "ram",
        "kv_cache": {"bytes": kv_bytes, "tokens": context, "tier": "vram" if dense_in_vram else "ram",
                     "state_bytes": state_bytes},
        "fits": fits,
        "bottleneck": bottleneck,
        "bottleneck_reason": why,
        "projection": {
            "hit_rate": [round(hit_lo, 4), round(hit_hi, 4)],
            "tok_s": [round(tok_lo, 3), round(tok_hi, 3)] if fits else [0.0, 0.0],
            "disk_bytes_per_token": [int(miss_lo), int(miss_hi)],
            # the rates the projection used: the machine's, or the policy's assumption where it has none
            "disk_gbs": disk_gbs, "drives": drives, "mem_gbs": mem_gbs,
            "seconds_per_token": {"disk": [t_disk_lo, t_disk_hi], "memory": t_mem, "compute": t_compute,
                                  "overhead": t_overhead, "gpu": t_gpu},
        },
        "warnings": warnings,
        # The engine's --ram-gb covers weights (dense + cached experts), not the KV cache or runtime.
        "engine_options": ({"ram_gb": int((ram_limit - ram_kv - ram_runtime) / GiB * 100) / 100}
                           | ({"vram_gb": int(vram_expert_bytes / GiB * 100) / 100} if machine.gpus else {})
                           if fits else {}),
    }


def plan_for(model_dir: str | os.PathLike, machine: Machine | None = None, project_slice: bool = True,
             **options) -> dict:
    """analyze_model + probe_machine (unless given) + build_plan."""
    facts = analyze_model(model_dir, project_slice)
    return build_plan(facts, machine or probe_machine(facts), **options)


def plan_machines(model: ModelFacts, machines: list[Machine], **options) -> dict[str, dict]:
    """One plan per machine, by machine name ("this machine" for a probed one), in order."""
    return {machine_label(m): build_plan(model, m, **options) for m in machines}


def machine_label(machine: Machine) -> str:
    return machine.name or "this machine"  # unnamed: probed here, or described for here (--machine FILE)


def check_fits(plan: dict) -> None:
    if not plan["fits"]:
        raise ColibriError(next(w["message"] for w in plan["warnings"] if w["level"] == "error"))


def engine_options(model_dir: str | os.PathLike | None, ram_gb: float | None, auto_tier: bool,
                   quiet: bool = False, machine: Machine | None = None) -> dict:
    """Engine.load options from --ram-gb / --auto-tier: an explicit --ram-gb wins; --auto-tier
    applies the plan's RAM limit. Options this engine build does not know yet are left out
    (with a note), so the flags work before and after the streaming store lands."""
    from colibri.engine import EngineConfig

    supported = set(EngineConfig.__dataclass_fields__)
    opts: dict = {}
    if ram_gb is not None:
        if ram_gb <= 0:
            raise ColibriError(f"--ram-gb must be positive, not {ram_gb:g}")
        opts["ram_gb"] = ram_gb
    elif auto_tier:
        if model_dir is None:
            from colibri.default_model import default_model_dir

            model_dir = default_model_dir(progress=not quiet)
        plan = plan_for(model_dir, machine, project_slice=False)  # the engine loads what is on disk
        check_fits(plan)
        opts.update(plan["engine_options"])
    missing = set(opts) - supported
    if missing:
        if ram_gb is not None:
            raise ColibriError("--ram-gb needs the expert streaming store, which this colibri build does not have yet")
        if not quiet:
            from rich.console import Console

            Console(stderr=True).print(f"[dim]auto-tier: plan gives {opts} (not applied: this engine "
                                       "keeps every expert resident)[/dim]", highlight=False)
        opts = {k: v for k, v in opts.items() if k in supported}
    elif auto_tier and ram_gb is None and opts and not quiet:
        from rich.console import Console

        Console(stderr=True).print(f"[dim]auto-tier: --ram-gb {opts['ram_gb']:g} from the plan[/dim]", highlight=False)
    return opts
