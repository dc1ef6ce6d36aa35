"""The one in-process Engine: container + tokenizer + model + expert source + KV cache.

CLI commands and the server build one Engine and call `generate` / `stream`; nothing outside
reaches into the model. The engine keeps its KV cache between calls and reuses the longest
common token prefix, so a conversation only prefills its new tokens.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from colibri import generate as gen
from colibri import speculative as spec
from colibri.batching import StepBatcher
from colibri.errors import ColibriError, EngineFault
from colibri.io.container import Container
from colibri.kernels.idot import ACTIVATIONS
from colibri.io.expert_store import ExpertStore, load_history, shown
from colibri.io.experts import ResidentExperts, experts_fit, open_experts, verify_reads
from colibri.models import family
from colibri.models.common import KV_CACHE_TYPES
from colibri.threads import ThreadPolicy, run_apart
from colibri.tokenizer import Tokenizer
from colibri.warmup import compile_kernels


@dataclass
class EngineConfig:
    """Runtime knobs (never mixed into a model's ModelArgs)."""

    max_context: int | None = None  # tokens; default: the model's, capped at DEFAULT_MAX_CONTEXT
    kv_slots: int = 1               # independent conversations kept warm (1-16)
    ram_gb: float | None = None     # budget for resident weights (dense + cached experts); None = planned
    expert_io: str = "pread"        # how missed experts are read: pread | direct (O_DIRECT) | mmap
    stream_experts: bool | None = None  # None: stream only when the experts do not fit the budget
    # Read the next layer's predicted experts ahead. Off by default: measured on the synthetic
    # OLMoE under a 2 GiB limit it lost (mispredictions evict useful experts; README A/B).
    prefetch: bool = False
    hot_set: bool = True            # pin each layer's historically hottest experts
    read_threads: int = 2           # readahead threads
    threads: int | None = None      # kernel threads (default: all cores; 1 when cores are busy elsewhere)
    verify_experts: bool = True     # check each expert read from disk against the container's checksum
    # Resident experts (all in RAM): False, load() returns when every expert is in (shown); True,
    # load() returns once the dense weights are in and the experts go on loading in the
    # background, an answer waiting only for the experts its tokens route to (ResidentExperts:
    # `colibri serve` answers /health and queues requests meanwhile; `run` and `chat` too,
    # unless --wait-for-experts). On Qwen3-30B-A3B's shapes, cold, the first token came 9.3-9.9 s
    # after launch against 18-21 s waiting for every expert (README, 2026-12-02). Off here, for
    # the library and `colibri bench`: a load that returns with every expert in, then answers
    # at full speed.
    experts_in_background: bool = False
    # Prompt tokens per forward pass. Bounds a prompt's working memory (activations, MoE token
    # groups, attention score blocks) by O(chunk x context) instead of O(prompt x context), and is
    # where a prefill can be cancelled. 512 keeps the weights' reads amortized over many tokens.
    prefill_chunk: int = 512
    # Draft tokens and check them in one pass (colibri/speculative.py): "off" | "ngram" | "auto".
    # Never changes the output; stream(speculative=...) overrides it per request.
    speculative: str = "off"
    draft_tokens: int = spec.DEFAULT_DRAFT_TOKENS
    # int4 matrices' activations: "f32" (exact: the reference's function) or "int8" (rounded to
    # int8 per weight group and dotted in integer arithmetic: faster where the CPU is the
    # bottleneck, at the fidelity cost the README measures; colibri/kernels/idot.py).
    activations: str = "f32"
    # int4 and q8_0 matrices' layout in RAM: "interleaved" (each block of 2 or 8 rows read as
    # one run of bytes by the decode kernels: 18 -> 24-28 GB/s from DRAM on a Zen 4 VM;
    # quant.py, Layout) or "rows" (row-major, as stored). The same bits either way.
    weight_layout: str = "interleaved"
    # The KV cache's element type: "f32" (exact) or "f16" (half the bytes decode attention
    # reads per token at long contexts, as llama.cpp's default cache; K and V rounded to
    # float16). GQA attention on the CPU; MLA's latent cache and the GPU path stay float32.
    kv_cache: str = "f32"
    # Where the dense forward runs: "cpu", "cuda" (weights and KV cache in GPU memory,
    # colibri/models/device.py; an error without a GPU or for a model it does not cover) or
    # "auto" (cuda when a GPU is there and covers the model, else cpu).
    device: str = "cpu"
    # With --device cuda, the VRAM tier's budget for routed experts (colibri/io/vram_experts.py);
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


DEFAULT_MAX_CONTEXT = 8192


@dataclass
class TokenEvent:
    token_id: int | None  # None: a final event carrying only held-back text
    text: str  # text this token completes (may be "" while a UTF-8 character or a possible stop string is pending)
    logprob: float | None = None                        # log p(token) when logprobs were asked for
    top_logprobs: list[tuple[int, float]] | None = None  # the most likely alternatives, best first
    # Only on the event a generation with prompt_logprobs starts with (token_id None, no text):
    # the prompt's scores, as Generation.prompt_logprobs, for streams that show them first.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # The end-of-sequence token that ended the generation, sent only when logprobs were asked
    # for (scoring clients such as lm-eval read its logprob); it has no text and is not one of
    # Generation.token_ids.
    end: bool = False


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str                  # "stop" (end-of-sequence token or stop string), "length" or "cancelled"
    prompt_tokens: int
    prompt_tokens_reused: int           # served from the KV cache, not prefilled
    ttft_s: float                       # request start -> first token sampled
    prefill_s: float
    decode_s: float
    slot: int = 0
    experts: dict | None = None         # this turn's expert-cache figures when experts stream
    # With prompt_logprobs: for each prompt token after the first, (log p(token | the tokens
    # before it), the most likely alternatives there, best first).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    grammar_s: float = 0.0              # time spent masking logits with a grammar
    speculative: dict | None = None     # drafted passes, drafted and accepted tokens (when drafting)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.prompt_tokens_reused
        return n / self.prefill_s if self.prefill_s > 0 else 0.0


@dataclass
class KVSlot:
    """One conversation's context: its KV cache and exactly the token ids it holds."""

    cache: object
    ids: list[int] = field(default_factory=list)
    last_used: float = 0.0


def _build_dense(container: Container, module, experts, show):
    """The family's model over `experts`, its dense weights read now (shown when large)."""
    with shown(show, f"reading the dense weights of {container.dir.name}", container.dense_bytes) as reading:
        container.on_read = reading.add if reading else None
        try:
            return module.build(container.config, container, experts)
        finally:
            container.on_read = None


def _load_resident(container: Container, config: EngineConfig, module, show):
    """(model, ResidentExperts): every expert read into RAM by background readers while this
    thread reads and builds the dense weights. Then either return at once, the experts loading
    on (config.experts_in_background: a forward reads or waits for the experts it needs), or
    wait for them, still shown. A build error cancels the reads; with the wait, a read error
    surfaces once the build is done."""
    # Answering while the experts load, the readers start once the dense weights are in, and
    # the first forward's own reads of the experts it routes to then meet a disk with less
    # else in flight: Qwen3-30B-A3B's shapes, first token 9.3 / 9.9 s from launch against
    # 11.5 / 12.1 s with the readers started at once (bench/startup.py --back-memory 18).
    # Waiting for all, the readers start at once and the dense build overlaps them.
    experts = ResidentExperts(container, verify=verify_reads(config), background=True,
                              start=not config.experts_in_background)
    try:
        model = _build_dense(container, module, experts, show)
    except BaseException:
        experts.cancel()
        raise
    experts.start()
    if config.experts_in_background:
        if show is not None and not experts.complete and hasattr(show, "note"):
            show.note(f"the experts of {container.dir.name} ({container.expert_bytes / 1e9:.1f} GB) go on loading in "
                      "the background: an answer waits only for the experts it routes to")
    else:
        left = container.expert_bytes - experts.loaded_bytes
        with shown(show, f"reading the experts of {container.dir.name}", left) as reading:
            experts.on_read = reading.add if reading else None
            try:
                experts.wait()
            finally:
                experts.on_read = None
    return model, experts


WEIGHT_LAYOUTS = ("interleaved", "rows")


def _check_kv_cache(kind: str) -> None:
    if kind not in KV_CACHE_TYPES:
        raise ColibriError(f"kv_cache must be one of {', '.join(KV_CACHE_TYPES)}, not {kind!r}")


def _check_activations(mode: str) -> None:
    if mode not in ACTIVATIONS:
        raise ColibriError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {mode!r}")


class Engine:
    def __init__(self, container: Container, tokenizer: Tokenizer | None, model, config: EngineConfig,
                 load_s: float = 0.0, experts=None):
        self.container = container
        self.experts = experts
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.load_s = load_s
        model_max = int(container.config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
        self.max_context = config.max_context or min(model_max, DEFAULT_MAX_CONTEXT)
        if self.max_context < 1:
            raise ColibriError(f"max_context must be at least 1, not {self.max_context}")
        if not 1 <= config.kv_slots <= 16:
            raise ColibriError(f"kv_slots must be between 1 and 16, not {config.kv_slots}")
        if config.prefill_chunk < 1:
            raise ColibriError(f"prefill_chunk must be at least 1, not {config.prefill_chunk}")
        spec.check_mode(config.speculative, config.draft_tokens)
        _check_activations(config.activations)
        model.activations = config.activations
        _check_kv_cache(config.kv_cache)
        model.kv_cache = config.kv_cache
        self.slots = [KVSlot(model.new_cache(self.max_context)) for _ in range(config.kv_slots)]
        if getattr(self.slots[0].cache, "dtype", "f32") != config.kv_cache:
            raise ColibriError(f"--kv-cache {config.kv_cache} covers grouped-query attention on the CPU; "
                               f"this model's cache ({type(self.slots[0].cache).__name__}) is float32 only")
        self._local = threading.local()  # `last`, per thread: concurrent streams (batching) each see their own
        self._threads = ThreadPolicy(config.threads)  # kernel threads: explicit, else adapted to the machine's load
        self._batcher: StepBatcher | None = None

    def close(self) -> None:
        """Stop what runs on after an answer: resident experts still loading in the background
        (the reads in flight finish). The engine still answers: an expert not read yet is read
        by the forward that needs it."""
        cancel = getattr(self.experts, "cancel", None)
        if cancel is not None:
            cancel()

    def ensure_slots(self, n: int) -> None:
        """At least n KV slots (the server sizes its batch after loading); new slots start empty."""
        if not 1 <= n <= 16:
            raise ColibriError(f"kv_slots must be between 1 and 16, not {n}")
        while len(self.slots) < n:
            self.slots.append(KVSlot(self.model.new_cache(self.max_context)))

    @property
    def last(self) -> Generation | None:
        """The Generation the last stream finished on this thread."""
        return getattr(self._local, "last", None)

    @last.setter
    def last(self, g: Generation | None) -> None:
        self._local.last = g

    # ------------------------------------------------------------------ batching
    def start_batching(self) -> None:
        """From now on, streams running at the same time on different threads (and different
        slots) share forward passes (colibri/batching.py); each one's tokens stay exactly
        what it would produce alone."""
        if self._batcher is None:
            self._batcher = StepBatcher(self.model, self._threads.apply)

    def stop_batching(self) -> None:
        if self._batcher is not None:
            self._batcher.stop()
            self._batcher = None

    @property
    def batch_stats(self) -> dict | None:
        b = self._batcher
        return None if b is None else {"steps": b.steps, "rows": b.rows_run,
                                       "mean_rows": round(b.rows_run / b.steps, 3) if b.steps else 0.0}

    def _speculator(self, ids: list[int], mode: str, draft_tokens: int) -> spec.Speculator:
        """Drafts from the model's MTP layer for "mtp" (and "auto" where there is one), else by
        prompt lookup. Batched or not: the batcher hands each generation its own rows' hidden
        states and runs its MTP passes on its own thread, between steps."""
        has_mtp = getattr(self.model, "has_mtp", False)
        if mode == "mtp" and not has_mtp:
            raise ColibriError("speculative 'mtp' needs a model with a multi-token-prediction layer "
                               "(num_nextn_predict_layers, with its weights in the container); this one has "
                               "none: use 'ngram' or 'auto'")
        mtp = spec.MTPDrafter(self.model, ids, self.max_context) if mode in ("mtp", "auto") and has_mtp else None
        return spec.Speculator(self._drafted_rows, ids, mode, draft_tokens, mtp=mtp)

    def _drafted_rows(self, tok: int, cache, draft) -> tuple[list[int], np.ndarray, np.ndarray]:
        """draft(), then forward_rows over [tok, *drafts] in one cache -> (drafts, logits rows,
        final hidden states); through the batcher when batching (both on its thread, the pass
        shared with other streams)."""
        if self._batcher is not None:
            return self._batcher.drafted_rows(tok, cache, draft)
        drafts = draft()
        rows = self.model.forward_rows([tok, *drafts], [cache] * (len(drafts) + 1))
        return drafts, rows, self.model.rows_hidden

    def _decode(self, cache, tok: int) -> np.ndarray:
        if self._batcher is not None:
            return self._batcher.rows([tok], [cache])[0]
        return gen.decode_one(self.model, cache, tok)

    def _chunk(self, cache, piece: list[int], all_logits: bool = False) -> np.ndarray:
        if self._batcher is not None:
            return self._batcher.chunk(piece, cache, all_logits)
        return self.model.forward(np.asarray(piece, dtype=np.int64), cache, all_logits=all_logits)

    @classmethod
    def load(cls, model_dir: str | Path | None = None, progress: bool = False, **options) -> "Engine":
        """Load a container directory; with no directory, the embedded default model
        (converted into the user's cache directory on first use). `options` are EngineConfig fields."""
        t0 = time.perf_counter()
        if model_dir is None:
            from colibri.default_model import default_model_dir

            model_dir = default_model_dir(progress=progress)
        unknown = set(options) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown Engine option(s): {', '.join(sorted(unknown))}")
        config = EngineConfig(**{k: v for k, v in options.items() if v is not None})
        _check_activations(config.activations)
        if config.vram_gb is not None and config.vram_gb < 0:
            raise ColibriError(f"--vram-gb must be >= 0, not {config.vram_gb:g}")
        if config.gpu_layers is not None and config.gpu_layers < 0:
            raise ColibriError(f"--gpu-layers must be >= 0, not {config.gpu_layers}")
        if config.device != "cpu":
            from colibri.models.device import check

            check(config.device)
        # numpy's BLAS (OpenBLAS) serves prefill attention and MLA; its threads keep spinning
        # for a while after each call, and on the cores the numba kernels run on they took about
        # half the CPU (bench/decode_vs_peers.py: SmolLM2 prefill 351 -> 630 tok/s with one thread).
        threadpool_limits(limits=1, user_api="blas")
        if config.threads is not None:
            from colibri.kernels import set_threads

            set_threads(config.threads)
        container = Container(model_dir)
        if config.weight_layout not in WEIGHT_LAYOUTS:
            raise ColibriError(f"weight_layout must be one of {', '.join(WEIGHT_LAYOUTS)}, "
                               f"not {config.weight_layout!r}")
        container.interleave_rows = config.weight_layout == "interleaved"
        module = family(container.config.get("model_type"))
        from colibri.default_model import history_path

        show = None  # a display for the reads that take over a second (experts, hot set, dense weights)
        if progress:
            from colibri.progress import ByteProgress as show
        if config.cluster:  # routed experts on Ray workers; the head keeps the dense weights
            import sys

            from colibri.cluster import open_cluster_experts

            experts = open_cluster_experts(container, config, history_file=history_path(container.dir),
                                           out=sys.stderr if progress else None)
            model = _build_dense(container, module, experts, show)
        elif experts_fit(container, config):  # every expert in RAM, read beside the dense weights
            model, experts = _load_resident(container, config, module, show)
        else:
            experts = open_experts(container, config, show=show, history_file=history_path(container.dir))
            model = _build_dense(container, module, experts, show)
        # Prefetch: the store's readahead when asked for; resident experts still loading take a
        # layer's coming experts first (RoutedMoE.wants_prefetch stops it once all are in).
        model.prefetch = (isinstance(experts, ExpertStore) and config.prefetch) or (
            isinstance(experts, ResidentExperts) and not experts.complete)
        if config.device != "cpu":
            from colibri.models.device import place

            vram = None if config.vram_gb is None else int(config.vram_gb * (1 << 30))
            model = place(model, config.device, container, experts, vram,
                          load_history(history_path(container.dir)), config.gpu_layers)
        model.activations = config.activations  # before the warm-up compiles its kernels
        _check_kv_cache(config.kv_cache)
        model.kv_cache = config.kv_cache
        if progress:  # in a thread of its own: see run_apart (the server generates on another thread)
            # The several-rows kernels too where this engine will run them: drafting, or the
            # KV slots a server batches generations over.
            rows = config.speculative != "off" or config.kv_slots > 1
            run_apart(compile_kernels, model, model_dir=container.dir, rows=rows)
        tok_path = Path(model_dir) / "tokenizer.json"
        tokenizer = Tokenizer.from_dir(model_dir) if tok_path.exists() else None
        return cls(container, tokenizer, model, config, load_s=time.perf_counter() - t0, experts=experts)

    # ------------------------------------------------------------------ facts
    @property
    def model_type(self) -> str:
        return self.container.config.get("model_type", "?")

    @property
    def model_id(self) -> str:
        return self.container.dir.name

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def cache(self):
        """Slot 0's KV cache (single-conversation callers)."""
        return self.slots[0].cache

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: str | list[int] | list[dict], raw: bool = False,
                      system: str | None = None, **template_kwargs) -> list[int]:
        """str -> chat template (unless raw) -> ids; list[dict] -> messages; list[int] -> as is."""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ColibriError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
            return ids
        if self.tokenizer is None:
            raise ColibriError("this model directory has no tokenizer.json; pass token ids instead of text")
        if isinstance(prompt, str) and raw:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ slots
    def pick_slot(self, ids: list[int], exclude: set[int] = frozenset()) -> int:
        """The slot sharing the longest token prefix with `ids`, else the least recently used;
        never one in `exclude` (slots other generations are using)."""
        free = [i for i in range(len(self.slots)) if i not in exclude]
        if not free:
            raise ColibriError("every KV slot is in use")
        best, best_len = None, 0
        for i in free:
            n = _common_prefix(self.slots[i].ids, ids)
            if n > best_len:
                best, best_len = i, n
        if best is not None:
            return best
        return min(free, key=lambda i: self.slots[i].last_used)

    def reusable_prefix(self, slot: int, ids: list[int]) -> int:
        """How many of `ids` a generation in `slot` would take from the KV cache (not prefill)."""
        return min(_common_prefix(self.slots[slot].ids, ids), len(ids) - 1)

    def reset(self, slot: int | None = None) -> None:
        for s in self.slots if slot is None else [self.slots[slot]]:
            s.cache.truncate(0)
            s.ids = []

    def save_slot(self, slot: int, path: str | Path) -> None:
        from colibri.io.kv_store import save_kv

        s = self.slots[slot]
        save_kv(path, s.ids, s.cache, self.model_id)

    def load_slot(self, slot: int, path: str | Path) -> int:
        """Restore a slot saved by save_slot; returns how many tokens it holds."""
        from colibri.io.kv_store import load_kv

        s = self.slots[slot]
        try:
            s.ids = load_kv(path, s.cache, self.model_id)
        except ColibriError:
            self.reset(slot)
            raise
        s.last_used = time.time()
        return len(s.ids)

    # ------------------------------------------------------------------ generation
    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, raw: bool = False, system: str | None = None,
               stop: list[str] | None = None, logprobs: int | None = None, slot: int | None = None,
               stop_at_eos: bool = True, cancel: Callable[[], bool] | None = None,
               min_p: float = 0.0, penalties: gen.Penalties | None = None, constraint=None,
               prompt_logprobs: int | None = None, speculative: str | None = None,
               draft_tokens: int | None = None, **template_kwargs) -> Iterator[TokenEvent]:
        """Yield tokens as they are produced. When the iterator is exhausted, `self.last` holds
        the finished Generation. Closing the iterator early (a client went away) leaves the
        slot holding exactly the tokens computed so far. `cancel` is polled between prefill
        chunks and between tokens; when it returns True the generation ends with finish_reason
        "cancelled" (a long prompt stops within one chunk, and the chunks already prefilled
        stay in the slot for a retry to reuse).

        The texts of the events concatenate to the generation's text. Text held back until the
        end (the start of a stop string that never completed, a split UTF-8 character) comes
        in a last event whose token_id is None.

        `penalties` shift the logits before sampling; `constraint` (a colibri.grammar.Matcher)
        masks every token its grammar forbids: the generation ends ("stop") when the grammar is
        complete, and with finish_reason "grammar_dead_end" if no token is allowed. Reported
        logprobs are the model's own, before either. `prompt_logprobs` (0..20 alternatives)
        scores every prompt token (Generation.prompt_logprobs); the prompt is then prefilled
        afresh, as the cached positions have no logits kept. `max_tokens` 0 only scores.
        `speculative` / `draft_tokens` (default: the engine's config) draft tokens and check them
        in one pass; the output is the same either way (colibri/speculative.py)."""
        if max_tokens < 0:
            raise ColibriError(f"max_tokens must be >= 0, not {max_tokens}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ColibriError("sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and not 0 <= value <= 20:
                raise ColibriError(f"{name} must be between 0 and 20, not {value}")
        if not 0.0 <= min_p <= 1.0:
            raise ColibriError(f"min_p must be between 0 and 1, not {min_p}")
        if penalties is not None and penalties.repetition <= 0:
            raise ColibriError(f"the repetition penalty must be > 0, not {penalties.repetition}")
        speculative = self.config.speculative if speculative is None else speculative
        draft_tokens = self.config.draft_tokens if draft_tokens is None else draft_tokens
        spec.check_mode(speculative, draft_tokens)
        t_start = time.perf_counter()
        ids = self.encode_prompt(prompt, raw=raw, system=system, **template_kwargs)
        if not ids:
            raise ColibriError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise ColibriError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context}")
        max_tokens = min(max_tokens, self.max_context - len(ids))
        if slot is None:
            slot = self.pick_slot(ids)
        elif not 0 <= slot < len(self.slots):
            raise ColibriError(f"slot {slot} does not exist (this engine has {len(self.slots)})")
        kv = self.slots[slot]
        kv.last_used = time.time()
        params = gen.SamplingParams(temperature, top_p, top_k, seed, min_p)
        shift = penalties if penalties is not None and penalties.active else None
        if shift is not None and shift.logit_bias:
            bad = [t for t in shift.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise ColibriError(f"logit_bias names token {bad[0]}, outside the vocabulary (0..{self.vocab_size - 1})")
        rng = np.random.default_rng(seed)
        eos = self.tokenizer.eos_token_ids if (self.tokenizer and stop_at_eos) else set()
        decoder = self.tokenizer.stream_decoder() if self.tokenizer else None
        stops = gen.StopMatcher(stop or [])

        stats0 = self._store_stats()
        scored: list | None = [] if prompt_logprobs is not None else None
        reused = self._reuse_prefix(kv, ids, keep=scored is None)
        # Room for the whole generation before prefill: one allocation, where growing on demand
        # doubled the cache (copying all of it) inside the prompt and again inside the answer,
        # a stall of a few hundred ms at 4k tokens. Untouched rows cost no memory (np.zeros
        # maps zero pages lazily).
        kv.cache.reserve(min(len(ids) + max_tokens, self.max_context))
        out: list[int] = []
        text_parts: list[str] = []
        finish = "length"
        hit = False
        t_prefill0 = time.perf_counter()
        ttft = prefill_s = 0.0
        t_decode0 = t_prefill0
        drafts = self._speculator(ids, speculative, draft_tokens) if speculative != "off" else None
        batcher = self._batcher
        if batcher is not None:
            batcher.join()
        try:
            if max_tokens > 0 or scored is not None:
                logits = self._prefill(kv, ids, reused, cancel, scored, prompt_logprobs)
                prefill_s = time.perf_counter() - t_prefill0
                t_decode0 = time.perf_counter()
                cancelled = logits is None
                if scored is not None and not cancelled:
                    yield TokenEvent(None, "", prompt_logprobs=scored)
                while logits is not None and max_tokens > 0:  # (0: the prompt is only scored)
                    z = shift.apply(logits, ids, out) if shift is not None else logits
                    if constraint is not None:
                        if z is logits:
                            z = logits.copy()
                        constraint.mask(z)
                        if constraint.dead:
                            finish = "grammar_dead_end"
                            break
                    tok = gen.sample(z, params, rng)
                    if not out:
                        ttft = time.perf_counter() - t_start
                    if tok in eos:
                        finish = "stop"
                        if logprobs is not None:
                            ev = self._event(tok, "", logits, logprobs)
                            ev.end = True
                            yield ev
                        break
                    if constraint is not None:
                        constraint.accept(tok)
                    out.append(tok)
                    piece, hit = stops.feed(decoder.feed(tok) if decoder else "")
                    text_parts.append(piece)
                    yield self._event(tok, piece, logits, logprobs)
                    if hit or (constraint is not None and constraint.done):  # a stop string; a complete grammar
                        finish = "stop"
                        break
                    if len(out) >= max_tokens:
                        break
                    if cancel is not None and cancel():
                        cancelled = True
                        break
                    self._threads.apply()
                    if drafts is None:
                        logits = self._decode(kv.cache, tok)
                    else:
                        logits = drafts.step(kv.cache, len(kv.ids), tok, max_tokens - len(out) - 1)
                    logits = _finite(logits, len(kv.ids), self.model_id)
                    kv.ids.append(tok)
                if cancelled:
                    finish = "cancelled"
            if not hit:  # text held back for a possible stop string (or a split character) is real
                tail = stops.feed(decoder.flush() if decoder else "")[0] + stops.flush()
                if tail:
                    text_parts.append(tail)
                    yield TokenEvent(None, tail)
        finally:
            # The cache holds exactly the tokens in kv.ids (no drafts past them), also when the
            # consumer stops early.
            if batcher is not None:
                batcher.leave()
            if drafts is not None:
                drafts.finish(kv.cache, len(kv.ids))
            kv.cache.truncate(len(kv.ids))
        self.last = Generation(out, "".join(text_parts), finish, len(ids), reused, ttft, prefill_s,
                               time.perf_counter() - t_decode0, slot, _turn_stats(stats0, self._store_stats()),
                               scored, constraint.mask_seconds if constraint is not None else 0.0,
                               drafts.stats.as_dict() if drafts is not None else None)
        if hasattr(self.experts, "save_history"):  # a streaming store, or the cluster's head
            self.experts.save_history()

    def _prefill(self, kv: KVSlot, ids: list[int], start: int, cancel, scored: list | None = None,
                 top: int = 0) -> np.ndarray | None:
        """Prefill ids[start:] in chunks of `prefill_chunk` tokens; the last position's logits,
        or None when cancelled between chunks. kv.ids follows every chunk, so the slot always
        names exactly what its cache holds. With `scored` (a list, start 0), every position's
        logits are kept long enough to append (log p(next prompt token), `top` best) to it."""
        chunk = self.config.prefill_chunk
        logits = None
        for a in range(start, len(ids), chunk):
            if cancel is not None and cancel():
                return None
            self._threads.apply()
            piece = ids[a : a + chunk]
            if scored is None:
                logits = self._chunk(kv.cache, piece)[-1]
            else:
                rows = self._chunk(kv.cache, piece, all_logits=True)
                _finite(rows, a, self.model_id)
                scored.extend(gen.score_next(rows[: len(ids) - 1 - a], ids[a + 1 : a + 1 + len(piece)], top))
                logits = rows[-1]
            kv.ids = ids[: a + len(piece)]
        return _finite(logits, len(ids) - 1, self.model_id)

    @staticmethod
    def _event(tok: int, text: str, logits: np.ndarray, logprobs: int | None) -> TokenEvent:
        if logprobs is None:
            return TokenEvent(tok, text)
        lp = gen.log_softmax(logits)
        top = np.argsort(-lp, kind="stable")[:logprobs] if logprobs else []
        return TokenEvent(tok, text, float(lp[tok]), [(int(i), float(lp[i])) for i in top])

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> Generation:
        for _ in self.stream(prompt, max_tokens=max_tokens, **kwargs):
            pass
        return self.last

    @staticmethod
    def _reuse_prefix(kv: KVSlot, ids: list[int], keep: bool = True) -> int:
        """Keep the cached tokens shared with `ids` (at least one token is left to prefill,
        since its logits are needed; none unless `keep`); returns how many were reused."""
        n = min(_common_prefix(kv.ids, ids), len(ids) - 1) if keep else 0  # as reusable_prefix
        kv.cache.truncate(n)
        kv.ids = kv.ids[:n]
        return n

    # ------------------------------------------------------------------ telemetry
    def _store_stats(self) -> dict | None:
        if hasattr(self.experts, "store_stats"):  # --cluster: the workers' stores, summed
            return self.experts.store_stats()
        stats = self.experts.stats.as_dict() if isinstance(self.experts, ExpertStore) else None
        vram = getattr(self.model, "vram", None)
        if vram is not None:  # --device cuda: the VRAM tier above the RAM tier
            v = vram.stats.as_dict()
            if stats is None:  # every expert resident in RAM: each VRAM miss was a RAM hit
                stats = {"hits": v["vram_misses"], "misses": 0, "prefetch_hits": 0, "bytes_read": 0, "reads": 0,
                         "wait_s": 0.0, "hit_rate": 1.0 if v["vram_misses"] else 0.0}
            stats.update(v)
        return stats

    @property
    def expert_stats(self) -> dict | None:
        """Cumulative expert-cache figures (hit rate, bytes read, disk wait) when streaming."""
        return self._store_stats()

    def feed(self, ids: list[int], slot: int = 0) -> list[float]:
        """Teacher-forced decode: append `ids` to a slot one token at a time, as decode does.
        Returns seconds per token. Benchmarks use it for realistic routing: greedy text from
        random weights repeats one token and would flatter every cache (BENCHMARKS.md 7)."""
        kv = self.slots[slot]
        times = []
        for tok in ids:
            t0 = time.perf_counter()
            self._threads.apply()
            gen.decode_one(self.model, kv.cache, int(tok))
            kv.ids.append(int(tok))
            times.append(time.perf_counter() - t0)
        if hasattr(self.experts, "save_history"):  # a streaming store, or the cluster's head
            self.experts.save_history()
        return times

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits [L, V] for every position of `ids` in a fresh context (tests, scoring)."""
        cache = self.model.new_cache(max(len(ids), 1))
        return self.model.forward(np.asarray(ids, dtype=np.int64), cache, all_logits=True)

    def logit_rows(self, ids: list[int]) -> Iterator[tuple[int, np.ndarray]]:
        """Every position's logits for `ids` in a fresh context (no KV slot is touched), one
        prefill chunk at a time: (the chunk's first position, its rows [n, V]). Memory stays
        O(chunk x vocabulary) however long `ids` is."""
        if len(ids) > self.max_context:
            raise ColibriError(f"{len(ids)} tokens do not fit the context ({self.max_context})")
        cache = self.model.new_cache(max(len(ids), 1))
        chunk = self.config.prefill_chunk
        for a in range(0, len(ids), chunk):
            self._threads.apply()
            rows = self.model.forward(np.asarray(ids[a : a + chunk], dtype=np.int64), cache, all_logits=True)
            yield a, _finite(rows, a, self.model_id)

    def score(self, prompt: str | list[int], top: int = 0) -> list[tuple[float, list[tuple[int, float]]]]:
        """log p(token | the tokens before it) for every token after the first, in a fresh
        context (text is tokenized as is, with the tokenizer's special tokens, no chat template),
        each with the `top` most likely tokens there. The same computation as a generation's
        prompt_logprobs and the server's `echo` + `logprobs`."""
        ids = self.encode_prompt(prompt, raw=True)
        if len(ids) < 2:
            raise ColibriError("scoring needs at least 2 tokens")
        out: list = []
        for a, rows in self.logit_rows(ids):
            out.extend(gen.score_next(rows[: len(ids) - 1 - a], ids[a + 1 : a + 1 + rows.shape[0]], top))
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _finite(logits: np.ndarray, position: int, model_id: str) -> np.ndarray:
    """The guard against damaged weights that no checksum caught (a dense tensor, a container
    without checksums): NaN or infinite logits would otherwise sample token 0 forever."""
    if not np.isfinite(logits).all():
        raise EngineFault(f"non-finite logits at position {position} of {model_id}: a weight file is damaged "
                          "(run `colibri info` on the model, re-convert it or restore its files)")
    return logits


def _turn_stats(before: dict | None, after: dict | None) -> dict | None:
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
