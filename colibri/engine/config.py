"""EngineConfig: the runtime knobs of one Engine, and the one place they are checked.

`EngineConfig.validate` runs before a model loads (Engine.load) and again when an Engine is
built. The command line checks its options with the same rules (`check`, with `flag=True`
for messages that name the option as typed: `--kv-cache` rather than `kv_cache`). Importing
this module loads no kernels: the lists of choices owned by the kernels and the models are
read when a value is checked.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from colibri import speculative as spec
from colibri.errors import ColibriError

DEFAULT_MAX_CONTEXT = 8192
MAX_KV_SLOTS = 16
WEIGHT_LAYOUTS = ("interleaved", "rows")
DEVICES = ("cpu", "cuda", "auto")


@dataclass
class EngineConfig:
    """Runtime knobs (never mixed into a model's ModelArgs)."""

    max_context: int | None = None  # tokens; default: the model's, capped at DEFAULT_MAX_CONTEXT
    kv_slots: int = 1               # independent conversations kept warm (1-16)
    ram_gb: float | None = None     # budget for resident weights (dense + cached experts); None = planned
    expert_io: str = "pread"        # how missed experts are read: pread | direct (O_DIRECT) | mmap
    stream_experts: bool | None = None  # None: stream only when the experts do not fit the budget
    # Read the experts coming layers are predicted to use (io/expert_store.py, "Guesses").
    prefetch: bool = False
    prefetch_depth: int = 1         # guess layer i + depth's experts as layer i starts (0: at its own start)
    hot_set: bool = True            # pin the hottest experts (by the routing heat kept across runs)
    repin: bool = True              # the hot set follows the heat at turn ends (False: pinned once at start)
    read_threads: int = 2           # readahead threads
    threads: int | None = None      # kernel threads (default: all cores; 1 when cores are busy elsewhere)
    verify_experts: bool = True     # check each expert read from disk against the container's checksum
    # Copies of the model's expert files on other drives, "DIR" or "DIR:WEIGHT" (io/mirrors.py):
    # each expert is read from one drive, by weight, so N drives read about N times what one
    # does. primary_weight: the model directory's own drive's weight (None: 1, as a mirror's).
    mirrors: list[str] = field(default_factory=list)
    primary_weight: float | None = None
    # Resident experts (all in RAM): False, load() returns when every expert is in (shown); True,
    # load() returns once the dense weights are in and the experts go on loading in the
    # background, an answer waiting only for the experts its tokens route to (ResidentExperts:
    # `colibri serve` answers /health and queues requests meanwhile; `run` and `chat` too,
    # unless --wait-for-experts): a cold start's first token comes in about half the time. Off
    # here, for the library and `colibri bench`: a load that returns with every expert in, then
    # answers at full speed.
    experts_in_background: bool = False
    # Prompt tokens per forward pass. Bounds a prompt's working memory (activations, MoE token
    # groups, attention score blocks) by O(chunk x context) instead of O(prompt x context), and is
    # where a prefill can be cancelled. 512 keeps the weights' reads amortized over many tokens.
    prefill_chunk: int = 512
    # Draft tokens and check them in one pass (colibri/speculative.py): "off" | "ngram" | "mtp" |
    # "auto". Never changes the output; stream(speculative=...) overrides it per request.
    speculative: str = "off"
    draft_tokens: int = spec.DEFAULT_DRAFT_TOKENS
    # The quantized matrices' activations (int4, q8_0, GGUF blocks but Q5_1): "f32" (exact: the
    # reference's function) or "int8" (rounded to int8 per weight group and dotted in integer
    # arithmetic: faster where the CPU is the bottleneck, at a fidelity cost;
    # colibri/kernels/idot.py, block_idot.py).
    activations: str = "f32"
    # int4 and q8_0 matrices' layout in RAM: "interleaved" (each block of 2 or 8 rows read as
    # one run of bytes by the decode kernels, which streams faster from DRAM; formats/qtensor.py, Layout)
    # or "rows" (row-major, as stored). The same bits either way.
    weight_layout: str = "interleaved"
    # The KV cache's element type: "f32" (exact) or "f16" (half the bytes decode attention
    # reads per token at long contexts, as llama.cpp's default cache; K and V rounded to
    # float16). GQA attention on the CPU; MLA's latent cache and the GPU path stay float32.
    kv_cache: str = "f32"
    # Where the dense forward runs: "cpu", "cuda" (weights and KV cache in GPU memory; an error
    # without a GPU or for a model it does not cover) or "auto" (cuda when a GPU is there and
    # covers the model, else cpu).
    device: str = "cpu"
    # With --device cuda, the VRAM tier's budget for routed experts (colibri/placement/vram_experts.py);
    # None: the device's free memory after the dense weights, less headroom.
    vram_gb: float | None = None
    # With --device cuda, how many leading decoder layers run on the GPU; the rest and the head
    # run on the CPU (their KV cache in RAM). None: as many as the GPU's free memory holds.
    gpu_layers: int | None = None
    # Routed experts on Ray actors (colibri/cluster): a Ray address, or "local" for a Ray
    # instance on this machine bound to 127.0.0.1; None: in this process.
    cluster: str | None = None
    expert_workers: int = 2             # Ray actors holding the experts (--cluster)
    expert_placement: str = "contiguous"  # contiguous | balanced (by routing history)
    worker_ram_gb: float | None = None  # each worker's expert budget; None: its whole shard, resident
    # How a MoE layer's arrays reach the workers: "tcp" (one direct connection per worker,
    # colibri/cluster/wire.py) or "ray" (Ray actor calls: ~2 ms more per layer, for networks
    # that admit only Ray's own ports).
    cluster_wire: str = "tcp"
    # Time each turn's phases (attention, dense MLP, routing, routed experts, head) for its
    # profile (engine/turn_profile.py). None: on where experts stream from disk (an ExpertStore)
    # or run on a cluster, where a turn's time is worth splitting and the clock's cost (a clock
    # read per block) is noise; off otherwise, as a dense model then leaves its one-compiled-call
    # decode (DecoderModel._one_token) for layer-by-layer calls.
    profile_phases: bool | None = None

    @classmethod
    def from_options(cls, options: dict) -> "EngineConfig":
        """Engine.load's keyword options; None means the default, an unknown name is a TypeError."""
        unknown = set(options) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown Engine option(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in options.items() if v is not None})

    def validate(self) -> "EngineConfig":
        """Raise ColibriError on the first knob out of its range; returns self."""
        for name in CHECKED:
            check(name, getattr(self, name))
        spec.check_mode(self.speculative, self.draft_tokens)
        if self.mirrors and self.expert_io == "mmap":
            raise ColibriError("--expert-io mmap maps the model's own files and cannot read mirrors; "
                               "use --expert-io pread or direct with --mirror")
        return self


def _choices(name: str) -> tuple:
    if name == "activations":
        from colibri.kernels.idot import ACTIVATIONS

        return tuple(ACTIVATIONS)
    if name == "kv_cache":
        from colibri.models.cache import KV_CACHE_TYPES

        return tuple(KV_CACHE_TYPES)
    return {"weight_layout": WEIGHT_LAYOUTS, "device": DEVICES}[name]


def check(name: str, value, flag: bool = False) -> None:
    """Raise ColibriError unless `value` is one EngineConfig.<name> takes. The message names the
    field (kv_cache), or with `flag` the command-line option (--kv-cache); the GPU options are
    named as options either way."""
    label = f"--{name.replace('_', '-')}" if flag or name in ("device", "vram_gb", "gpu_layers") else name
    if name in ("activations", "kv_cache", "weight_layout", "device"):
        choices = _choices(name)
        if value not in choices:
            raise ColibriError(f"{label} must be one of {', '.join(choices)}, not {value!r}")
    elif name == "kv_slots":
        if not 1 <= value <= MAX_KV_SLOTS:
            raise ColibriError(f"{label} must be between 1 and {MAX_KV_SLOTS}, not {value}")
    elif name == "mirrors":
        from colibri.io.mirrors import parse_mirrors

        parse_mirrors(value)  # (each message names --mirror and the directory)
    elif name == "primary_weight":
        if value is not None:
            from colibri.io.mirrors import check_weight

            check_weight(value, "--primary-weight")
    elif name == "prefill_chunk":
        if value < 1:
            raise ColibriError(f"{label} must be at least 1, not {value}")
    elif name == "prefetch_depth":
        if not 0 <= value <= 8:
            raise ColibriError(f"{label} must be between 0 and 8 layers, not {value}")
    elif name == "vram_gb":
        if value is not None and value < 0:
            raise ColibriError(f"{label} must be >= 0, not {value:g}")
    elif name == "gpu_layers":
        if value is not None and value < 0:
            raise ColibriError(f"{label} must be >= 0, not {value}")
    else:
        raise KeyError(name)


# What validate() checks, in this order (speculative and draft_tokens after, as a pair).
CHECKED = ("activations", "vram_gb", "gpu_layers", "device", "weight_layout", "kv_cache", "kv_slots",
           "prefill_chunk", "prefetch_depth", "mirrors", "primary_weight")
