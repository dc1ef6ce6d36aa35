"""`colibri plan`: how to place a model over VRAM, RAM and disk on this machine, and what speed
to expect. After the original's resource_plan.py (seeds/serving-and-toolchain.zh.txt, section 3):
it reads only safetensors headers, config.json and the manifest (never a tensor), the machine's
memory, cores and GPUs, and a short disk-read probe, and returns a versioned plan (a dict that
`--json` prints as is). It does not depend on the expert store: `engine_options` turns a plan
into Engine.load options (`ram_gb`), which `--auto-tier` applies where the user gave none.

Placement policy (one rule, so a plan is reproducible):
- RAM limit = the user's --ram-gb, else what is available (MemAvailable, or the memory cgroup's
  room when that is smaller) minus headroom (12%, at least 512 MiB); a plan never uses more.
- Dense weights stay resident: on the first GPU when it holds them with the KV cache, else in RAM.
  The KV cache (max context), expert staging buffers and the runtime's own memory come next.
- What is left of each tier becomes expert cache slots, the same number in every MoE layer:
  VRAM slots first, then RAM slots for experts not already in VRAM. Every expert stays on disk.
- Projection per decoded token: misses read from disk (expert-sized reads at the probed rate),
  the touched weights read from memory, the int4 kernels' speed per core, and the per-layer
  Python overhead. The hit-rate range runs from uniform routing (slots / experts) to a Zipf(1)
  heat (the share of the hottest `slots` experts); the tok/s range from "no overlap, low hit
  rate, CPU 30% slower than estimated" to "reads fully overlapped with compute, high hit rate, CPU
20% faster".
"""
from __future__ import annotations

import json
import mmap
import os
import random
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from colibri.errors import ColibriError
from colibri.workspace import prefill_workspace_bytes

PLAN_VERSION = 1
GiB = 1 << 30
MiB = 1 << 20

DEFAULT_MAX_CONTEXT = 8192   # the Engine's default cap on the context (engine.DEFAULT_MAX_CONTEXT)
_ALIGN = 4096


# ----------------------------------------------------------------------------- policy

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
    kernel_gbs_per_core: float = 3.5             # int4 matvec, GB of weights/s per core (DESIGN.md section 6)
    gpu_bandwidth_gbs: float = 500.0             # assumed when the machine description has none
    slow_disk_gbs: float = 0.5
    cpu_slow_factor: float = 1.3                 # the spread of the CPU-side estimate (kernel speed,
    cpu_fast_factor: float = 0.8                 # per-layer overhead, a busy machine)


# ----------------------------------------------------------------------------- the model

@dataclass
class ExpertLayer:
    prefix: str
    num_experts: int
    expert_bytes: int  # one expert's blob: what one read fetches


@dataclass
class ModelFacts:
    dir: str
    kind: str                      # "container" or "hf" (sizes estimated for `colibri convert --bits 4`)
    model_type: str
    num_layers: int
    dense_bytes: int
    dense_bytes_per_token: int     # dense bytes one decode step reads (an untied embedding: one row)
    expert_layers: list[ExpertLayer]
    top_k: int
    kv_bytes_per_token: int        # float32 KV cache, all layers
    model_max_context: int
    disk_bytes: int                # every file of the model directory
    probe_files: list[str] = field(default_factory=list)  # where the disk probe reads
    config: dict = field(default_factory=dict)             # config.json (shapes for the prefill workspace)

    @property
    def expert_count(self) -> int:
        return sum(layer.num_experts for layer in self.expert_layers)

    @property
    def expert_bytes(self) -> int:
        return sum(layer.num_experts * layer.expert_bytes for layer in self.expert_layers)

    @property
    def one_expert_per_layer_bytes(self) -> int:
        return sum(layer.expert_bytes for layer in self.expert_layers)

    @property
    def active_expert_bytes(self) -> int:
        """Routed-expert bytes one token uses: top_k experts in every MoE layer."""
        return sum(min(self.top_k, layer.num_experts) * layer.expert_bytes for layer in self.expert_layers)


def _top_k(config: dict) -> int:
    for key in ("num_experts_per_tok", "moe_top_k", "num_experts_per_token", "top_k"):
        if config.get(key):
            return int(config[key])
    return 0


def _kv_bytes_per_token(config: dict) -> int:
    layers = int(config.get("num_hidden_layers") or 0)
    if config.get("kv_lora_rank"):  # MLA caches the compressed latent plus the rope dims
        return layers * (int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)) * 4
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size") or 0) // heads))
    return layers * kv_heads * head_dim * 2 * 4


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


_EMBED = re.compile(r"embed_tokens\.weight$")


def analyze_model(model_dir: str | os.PathLike) -> ModelFacts:
    """Facts about a colibri container or a Hugging Face checkpoint, from headers only."""
    from colibri.io.container import MANIFEST

    d = Path(model_dir)
    if not d.is_dir():
        raise ColibriError(f"model directory {d} does not exist")
    if (d / MANIFEST).exists():
        return _analyze_container(d)
    if (d / "config.json").exists() and any(d.glob("*.safetensors")):
        return _analyze_hf(d)
    raise ColibriError(f"{d} is neither a colibri model directory (no {MANIFEST}) nor a Hugging Face "
                       "checkpoint (config.json + *.safetensors); pass --model with one of those")


def _analyze_container(d: Path) -> ModelFacts:
    from colibri.io.container import Container

    c = Container(d)
    dense = sum(t.nbytes for t in c.dense.tensors.values())
    per_token = dense
    embed = [n for n in c.manifest["tensors"] if _EMBED.search(n)]
    if embed and c.has("lm_head.weight"):  # untied: decoding reads one embedding row, not the table
        name = embed[0]
        table = sum(c.dense.tensors[f"{name}.{p}"].nbytes for p in ("q", "scales", "mins")
                    if f"{name}.{p}" in c.dense.tensors)
        rows = c.manifest["tensors"][name]["shape"][0] or 1
        per_token -= table - table // rows
    layers = [ExpertLayer(prefix, lay.num_experts, lay.blob_bytes) for prefix, lay in c.expert_layouts.items()]
    files = [str(d / lay.file) for lay in c.expert_layouts.values()] or [str(c.dense.path)]
    return ModelFacts(str(d), "container", c.config.get("model_type", "?"),
                      int(c.config.get("num_hidden_layers") or 0), dense, per_token, layers,
                      _top_k(c.config), _kv_bytes_per_token(c.config),
                      int(c.config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT),
                      _dir_bytes(d), files, c.config)


# Bytes per weight after `colibri convert --bits 4` (convert.scheme_for): int4 g64 with f32
# scales, q8_0 (embeddings, lm_head) with f32 scales, f32 for routers and norms.
_BYTES_PER_WEIGHT = {"int4_g64": 0.5 + 4 / 64, "q8_0": 1 + 4 / 32, "f32": 4.0}


def _analyze_hf(d: Path) -> ModelFacts:
    from colibri.io.convert import _EXPERT, _FUSED_EXPERTS, _SKIP
    from colibri.io.safetensors_io import SafetensorsFile

    try:
        config = json.loads((d / "config.json").read_text())
    except ValueError as e:
        raise ColibriError(f"{d}/config.json is not valid JSON ({e})") from None
    dense = 0
    embed_table = embed_rows = 0
    shards = sorted(d.glob("*.safetensors"))
    headers = [SafetensorsFile(path) for path in shards]
    tied = not any("lm_head.weight" in f.tensors for f in headers)
    experts: dict[str, dict[int, float]] = {}
    for f in headers:
        for name, info in f.tensors.items():
            if _SKIP.search(name):
                continue
            shape = info.shape
            if m := _EXPERT.match(name):
                layer = experts.setdefault(m["prefix"], {})
                layer[int(m["e"])] = layer.get(int(m["e"]), 0) + _converted_bytes(name, shape)
            elif m := _FUSED_EXPERTS.match(name):  # [E, 2I, D] / [E, D, I]
                layer = experts.setdefault(m["prefix"], {})
                per = _converted_bytes(name, shape[1:])
                for e in range(shape[0]):
                    layer[e] = layer.get(e, 0) + per
            else:
                nbytes = int(_converted_bytes(name, shape))
                dense += nbytes
                if _EMBED.search(name):
                    embed_table, embed_rows = nbytes, shape[0]
    per_token = dense - (embed_table - embed_table // max(embed_rows, 1) if embed_table and not tied else 0)
    layers = []
    for prefix, per_expert in experts.items():
        blob = max(per_expert.values())
        layers.append(ExpertLayer(prefix, len(per_expert), _round_up(int(blob), _ALIGN)))
    disk = sum(layer.num_experts * layer.expert_bytes for layer in layers) + dense
    return ModelFacts(str(d), "hf", config.get("model_type", "?"), int(config.get("num_hidden_layers") or 0),
                      dense, per_token, layers, _top_k(config), _kv_bytes_per_token(config),
                      int(config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT), disk,
                      [str(p) for p in shards], config)


def _converted_bytes(name: str, shape: tuple[int, ...]) -> float:
    from colibri.io.convert import scheme_for

    n = 1
    for s in shape:
        n *= s
    if len(shape) == 1:
        return 4.0 * n
    return _BYTES_PER_WEIGHT[scheme_for(name, tuple(shape), 4)] * n


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ----------------------------------------------------------------------------- the machine

@dataclass
class GPU:
    name: str
    total_bytes: int
    free_bytes: int
    bandwidth_gbs: float | None = None


@dataclass
class Machine:
    cores: int
    ram_total_bytes: int
    ram_available_bytes: int          # MemAvailable, or the memory cgroup's room when smaller
    gpus: list[GPU] = field(default_factory=list)
    disk_read_gbs: float | None = None  # expert-sized reads, from the probe
    disk_probe: str = ""                # how the disk figure was measured
    mem_read_gbs: float | None = None   # one thread, from the probe
    source: str = "probed"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Machine":
        """A machine description (e.g. `colibri plan --machine FILE.json`); unknown keys are an error."""
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ColibriError(f"machine description: unknown field(s) {', '.join(sorted(unknown))}; "
                               f"known: {', '.join(sorted(names))}")
        try:
            gpus = [g if isinstance(g, GPU) else GPU(**g) for g in d.get("gpus", [])]
            m = cls(**{**d, "gpus": gpus})
        except TypeError as e:
            raise ColibriError(f"machine description: {e}") from None
        m.source = d.get("source", "file")
        return m


def read_machine_file(path: str | os.PathLike) -> Machine:
    try:
        return Machine.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:
        raise ColibriError(f"cannot read the machine description {path} ({e})") from None


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup still allows (page cache that could be reclaimed
    counts as room), or None when no limit applies."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        base = None
        if "memory" in controllers.split(","):  # cgroup v1
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit_f, usage_f, inactive_key = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        elif controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():  # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit_f, usage_f, inactive_key = "memory.max", "memory.current", "inactive_file"
        if base is None:
            continue
        try:
            raw = (base / limit_f).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            usage = int((base / usage_f).read_text())
            stat = dict(l.split() for l in (base / "memory.stat").read_text().splitlines() if " " in l)
            return max(0, int(raw) - usage + int(stat.get(inactive_key, 0)))
        except (OSError, ValueError):
            return None
    return None


def discover_gpus() -> list[GPU]:
    """NVIDIA GPUs through nvidia-smi; none when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            gpus.append(GPU(parts[0], int(float(parts[1])) * MiB, int(float(parts[2])) * MiB))
        except (IndexError, ValueError):
            continue
    return gpus


def probe_disk(files: list[str], block: int = 4 * MiB, max_bytes: int = 64 * MiB,
               max_s: float = 0.5) -> tuple[float | None, str]:
    """Read random `block`-sized, 4096-aligned ranges of `files` for at most `max_s` seconds
    and `max_bytes`; O_DIRECT where the filesystem allows it (the page cache would report RAM
    speed), else buffered reads after dropping the ranges from the page cache."""
    block = max(_ALIGN, _round_up(block, _ALIGN))
    targets = [(f, os.path.getsize(f)) for f in files if os.path.isfile(f) and os.path.getsize(f) >= _ALIGN]
    if not targets:
        return None, "no model files to read"
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    rng = random.Random(0)
    total = reads = 0
    direct = hasattr(os, "O_DIRECT")
    t0 = time.perf_counter()
    try:
        while total < max_bytes and time.perf_counter() - t0 < max_s:
            path, size = rng.choice(targets)
            span = min(block, size // _ALIGN * _ALIGN)
            off = rng.randrange(0, max(1, (size - span) // _ALIGN + 1)) * _ALIGN
            n = _read_range(path, off, span, buf, direct)
            if n is None and direct:
                direct = False  # this filesystem refuses O_DIRECT
                n = _read_range(path, off, span, buf, False)
            total += n or 0
            reads += 1
    finally:
        buf.close()
    elapsed = time.perf_counter() - t0
    if total == 0 or elapsed <= 0:
        return None, "the probe read nothing"
    how = "O_DIRECT" if direct else "buffered, cache dropped"
    return total / elapsed / 1e9, f"{how}: {total / MiB:.0f} MiB in {reads} reads of {block // 1024} KiB"


def _read_range(path: str, off: int, n: int, buf: mmap.mmap, direct: bool) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:
        return None
    try:
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        view = memoryview(buf)[:n]
        try:
            return os.preadv(fd, [view], off)
        except OSError:
            return None
        finally:
            view.release()
    finally:
        os.close(fd)


def probe_memory(nbytes: int = 128 * MiB) -> float | None:
    """One thread's read bandwidth (numpy sum over a large array), best of three."""
    import numpy as np

    try:
        a = np.ones(nbytes // 8, dtype=np.float64)
    except MemoryError:
        return None
    best = None
    for _ in range(3):
        t0 = time.perf_counter()
        a.sum()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return a.nbytes / best / 1e9 if best else None


def probe_machine(model: ModelFacts | None = None, disk: bool = True) -> Machine:
    info = _meminfo()
    total = info.get("MemTotal", 0)
    avail = info.get("MemAvailable", info.get("MemFree", 0))
    room = _cgroup_room()
    if room is not None:
        avail = min(avail, room)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    disk_gbs, how = (None, "not measured")
    if disk and model is not None:
        sizes = [layer.expert_bytes for layer in model.expert_layers]
        block = sorted(sizes)[len(sizes) // 2] if sizes else 4 * MiB
        disk_gbs, how = probe_disk(model.probe_files, block=min(max(block, 256 * 1024), 8 * MiB))
    return Machine(cores, total, avail, discover_gpus(), disk_gbs, how, probe_memory())


# ----------------------------------------------------------------------------- the plan

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
    """The placement plan for `model` on `machine` (see the module docstring for the rule)."""
    p = policy or Policy()
    warnings: list[dict] = []

    def warn(level: str, message: str) -> None:
        warnings.append({"level": level, "message": message})

    context = max_context or min(model.model_max_context, DEFAULT_MAX_CONTEXT)
    layers = model.expert_layers
    kv_bytes = model.kv_bytes_per_token * context * p.kv_slots
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
                            f"({_size(ram_limit)} available after {_size(ram_headroom)} headroom); "
                            f"planning with {_size(ram_limit)}")
        else:
            ram_limit = asked
    fits = ram_fixed <= ram_limit
    if not fits:
        warn("error", f"the dense part does not fit: dense weights {_size(ram_dense)} + KV cache "
                      f"{_size(ram_kv)} ({context} tokens) + runtime {_size(ram_runtime)} need "
                      f"{_size(ram_fixed)}, the RAM limit is {_size(ram_limit)}; use a machine with more "
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
    disk_gbs = machine.disk_read_gbs or 0.5
    mem_gbs = machine.mem_read_gbs or 10.0
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
        why = {"disk": f"{_size(int((miss_lo + miss_hi) / 2))} of expert misses per token at {disk_gbs:.2f} GB/s",
               "memory": f"{_size(int(cpu_bytes))} of weights per token at {mem_gbs:.1f} GB/s",
               "compute": f"{_size(int(cpu_bytes))} of weights per token through the kernels on "
                          f"{machine.cores} cores, plus {t_overhead * 1000:.0f} ms of per-layer overhead"}[bottleneck]

    # Advice.
    if not machine.gpus:
        warn("info", "no GPU found: dense weights and the expert cache stay in RAM")
    else:
        import importlib.util

        if importlib.util.find_spec("colibri.kernels.cuda") is None:
            warn("warning", "this colibri build has no CUDA kernels yet: the VRAM tier is planned but runs on the CPU")
    disk_only = model.expert_count - vram_experts - ram_experts
    if fits and disk_only and machine.disk_read_gbs is not None and machine.disk_read_gbs < p.slow_disk_gbs:
        warn("warning", f"slow disk ({machine.disk_read_gbs:.2f} GB/s): {disk_only} experts are read from it on demand")
    if fits and layers and 0 < cached[0] < model.top_k:
        warn("warning", f"the cache holds {min(cached)} experts per layer, fewer than top-k ({model.top_k}): "
                        "most expert uses will read from disk")
    if fits and layers and disk_only == 0:
        warn("info", "every expert fits in memory: the disk leaves the decode path after warm-up")
    if not layers:
        warn("info", "a dense model (no routed experts): nothing streams; it runs from memory")
    if model.kind == "hf":
        warn("info", "a Hugging Face checkpoint: sizes are estimated for `colibri convert --bits 4`; convert it to run it")

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
        "fits": fits,
        "bottleneck": bottleneck,
        "bottleneck_reason": why,
        "projection": {
            "hit_rate": [round(hit_lo, 4), round(hit_hi, 4)],
            "tok_s": [round(tok_lo, 3), round(tok_hi, 3)] if fits else [0.0, 0.0],
            "disk_bytes_per_token": [int(miss_lo), int(miss_hi)],
            "seconds_per_token": {"disk": [t_disk_lo, t_disk_hi], "memory": t_mem, "compute": t_compute,
                                  "overhead": t_overhead, "gpu": t_gpu},
        },
        "warnings": warnings,
        # The engine's --ram-gb covers weights (dense + cached experts), not the KV cache or runtime.
        "engine_options": {"ram_gb": int((ram_limit - ram_kv - ram_runtime) / GiB * 100) / 100} if fits else {},
    }


def plan_for(model_dir: str | os.PathLike, machine: Machine | None = None, **options) -> dict:
    """analyze_model + probe_machine (unless given) + build_plan."""
    facts = analyze_model(model_dir)
    return build_plan(facts, machine or probe_machine(facts), **options)


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
        plan = plan_for(model_dir, machine)
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


# ----------------------------------------------------------------------------- display

def _size(n: int | float | None) -> str:
    """Binary units, as --ram-gb and the engine's messages use them."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def render_plan(plan: dict, console) -> None:
    """The plan as Rich tables."""
    from rich.table import Table

    m, t, pr = plan["model"], plan["tiers"], plan["projection"]
    mach = plan["machine"]
    console.print(f"[bold]colibri plan[/bold] v{plan['version']} for {m['dir']} ({m['model_type']}, {m['kind']})",
                  highlight=False)
    gpus = ", ".join(f"{g['name']} {_size(g['free_bytes'])} free" for g in mach["gpus"]) or "no GPU"
    disk = f"{mach['disk_read_gbs']:.2f} GB/s" if mach.get("disk_read_gbs") else "not measured"
    console.print(f"machine: {mach['cores']} cores, {_size(mach['ram_available_bytes'])} of "
                  f"{_size(mach['ram_total_bytes'])} RAM available, {gpus}, disk {disk} ({mach.get('disk_probe', '')})",
                  highlight=False)
    console.print(f"model: dense {_size(m['dense_bytes'])}, {m['expert_count']} experts in {m['moe_layers']} layers "
                  f"({_size(m['expert_size_bytes'])} each, {_size(m['expert_bytes'])} in all), top-k {m['top_k']}, "
                  f"{_size(m['active_bytes_per_token'])} active per token", highlight=False)
    table = Table(title=None)
    for col in ("tier", "limit", "planned", "dense", "experts", "expert bytes", "slots"):
        table.add_column(col, justify="left" if col == "tier" else "right")
    table.add_row("VRAM", _size(t["vram"]["limit_bytes"]), _size(t["vram"]["budget_bytes"]),
                  _size(t["vram"]["dense_bytes"]), str(t["vram"]["experts"]), _size(t["vram"]["expert_bytes"]),
                  str(t["vram"]["slots_per_layer"]))
    table.add_row("RAM", _size(t["ram"]["limit_bytes"]), _size(t["ram"]["budget_bytes"]),
                  _size(t["ram"]["dense_bytes"]), str(t["ram"]["experts"]), _size(t["ram"]["expert_bytes"]),
                  str(t["ram"]["slots_per_layer"]))
    table.add_row("disk", "-", _size(t["disk"]["bytes"]), "-", f"{t['disk']['experts_disk_only']} only",
                  _size(t["disk"]["expert_bytes"]), "-")
    console.print(table)
    console.print("[dim]slots: expert cache slots per MoE layer; every expert also stays on disk[/dim]")
    lo, hi = pr["tok_s"]
    hlo, hhi = pr["hit_rate"]
    console.print(f"bottleneck: [bold]{plan['bottleneck']}[/bold] ({plan['bottleneck_reason']})", highlight=False)
    if plan["fits"]:
        console.print(f"projected: {lo:.1f}-{hi:.1f} tok/s, expert hit rate {hlo:.0%}-{hhi:.0%}", highlight=False)
    for w in plan["warnings"]:
        style = {"error": "bold red", "warning": "yellow"}.get(w["level"], "dim")
        console.print(f"[{style}]{w['level']}:[/{style}] {w['message']}", highlight=False)
