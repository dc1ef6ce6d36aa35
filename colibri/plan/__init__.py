"""`colibri plan`: how to place a model over VRAM, RAM and disk on this machine (or on named
machines, machine_specs.py), and what speed to expect. After the original's resource_plan.py
(seeds/serving-and-toolchain.zh.txt, section 3): it reads only safetensors headers, config.json
and the manifest (never a tensor), the machine's memory, cores and GPUs, and a short disk-read
probe, and returns a versioned plan (a dict that `--json` prints as is). It does not depend on
the expert store: `engine_options` turns a plan into Engine.load options (`ram_gb`), which
`--auto-tier` applies where the user gave none.

Placement policy (one rule, so a plan is reproducible):
- RAM limit = the user's --ram-gb, else what is available (MemAvailable, or the memory cgroup's
  room when that is smaller) minus headroom (12%, at least 512 MiB); a plan never uses more.
- Dense weights stay resident: on the first GPU when it holds them with the KV cache, else in RAM.
  The KV cache (max context), expert staging buffers and the runtime's own memory come next.
- What is left of each tier becomes expert cache slots, the same number in every MoE layer:
  VRAM slots first, then RAM slots for experts not already in VRAM. Every expert stays on disk.
- Projection per decoded token: misses read from disk (expert-sized reads at the probed rate,
  times the identical drives the experts are striped over: `--drives`, `--mirror`),
  the touched weights read from memory, the int4 kernels' speed per core, and the per-layer
  Python overhead. The hit-rate range runs from uniform routing (slots / experts) to a Zipf(1)
  heat (the share of the hottest `slots` experts); the tok/s range from "no overlap, low hit
  rate, CPU 30% slower than estimated" to "reads fully overlapped with compute, high hit rate, CPU
  20% faster".

Modules, each importing only those above it: policy (the rule's constants, units), shapes (tensor
shapes a config.json implies), facts (ModelFacts from headers; slices projected to the full
model), machine (probes, Machine), machine_specs (named machines), build (build_plan,
engine_options), render (Rich output).
"""
from __future__ import annotations

from colibri.plan.build import (build_plan, check_fits, engine_options, machine_label, plan_for,
                                plan_machines)
from colibri.plan.facts import ExpertLayer, ModelFacts, analyze_model, experts_per_token
from colibri.plan.machine import (GPU, Machine, discover_gpus, probe_disk, probe_machine, probe_memory,
                                  read_machine_file)
from colibri.plan.machine_specs import (DEFAULT_FILE, named_machines, parse_machine_spec,
                                        read_machines)
from colibri.plan.policy import DEFAULT_MAX_CONTEXT, PLAN_VERSION, GiB, MiB, Policy, size_text
from colibri.plan.render import render_comparison, render_plan

__all__ = ["DEFAULT_FILE", "DEFAULT_MAX_CONTEXT", "GPU", "PLAN_VERSION", "ExpertLayer", "GiB", "Machine", "MiB",
           "ModelFacts", "Policy", "analyze_model", "build_plan", "check_fits", "discover_gpus", "engine_options",
           "experts_per_token", "machine_label", "named_machines", "parse_machine_spec", "plan_for", "plan_machines", "probe_disk",
           "probe_machine", "probe_memory", "read_machine_file", "read_machines", "render_comparison",
           "render_plan", "size_text"]
