"""The constants of the placement rule (colibri/plan/__init__.py states the rule) and the units
the planner speaks: sizes in binary units, as --ram-gb and the engine's messages use them."""
from __future__ import annotations

from dataclasses import dataclass

PLAN_VERSION = 1
GiB = 1 << 30
MiB = 1 << 20

DEFAULT_MAX_CONTEXT = 8192   # the Engine's default cap on the context (engine.DEFAULT_MAX_CONTEXT)
ALIGN = 4096                 # expert blobs and O_DIRECT reads are aligned to this


@dataclass
class Policy:
    """The constants of the placement rule; tests scale them down with small models."""

    ram_headroom_fraction: float = 0.12
    ram_headroom_min_bytes: int = 512 * MiB
    vram_headroom_fraction: float = 0.10
    vram_headroom_min_bytes: int = 2 * GiB       # the original keeps 2 GB free per GPU
    runtime_bytes: int = 384 * MiB               # interpreter, numba, decode temporaries
    prefill_chunk: int = 512                     # the engine's default: a prompt's working memory (workspace.py)
    kv_slots: int = 1
    overhead_per_layer_s: float = 1e-3           # Python work per decoder layer per token (measured ~1 ms)
    kernel_gbs_per_core: float = 3.5             # int4 matvec, GB of weights/s per core (docs/design.md section 6)
    gpu_bandwidth_gbs: float = 500.0             # assumed when the machine description has none
    disk_gbs: float = 0.5                        # assumed when the disk was not measured
    mem_gbs: float = 10.0                        # assumed when memory was not measured (one thread's rate)
    slow_disk_gbs: float = 0.5
    cpu_slow_factor: float = 1.3                 # the spread of the CPU-side estimate (kernel speed,
    cpu_fast_factor: float = 0.8                 # per-layer overhead, a busy machine)


def round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def size_text(n: int | float | None) -> str:
    """Binary units, as --ram-gb and the engine's messages use them."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
