"""The Engine facade: one loaded model (container, tokenizer, model, expert source) and its KV
slots, answering `stream` / `generate`, scoring, and the facts its users show.

CLI commands and the server build one Engine and call `generate` / `stream`; nothing outside
reaches into the model: what callers show about it (its layers, the GPU tier) has an accessor
here. The engine keeps its KV cache between calls and reuses the longest common token prefix,
so a conversation only prefills its new tokens.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri import generate as gen
from colibri import speculative as spec
from colibri.batching import StepBatcher
from colibri.engine import loader, slots
from colibri.engine.config import DEFAULT_MAX_CONTEXT, EngineConfig, check
from colibri.engine.slots import KVSlot
from colibri.engine.stats import store_stats, turn_stats
from colibri.engine.turn_profile import TurnRecorder
from colibri.errors import ColibriError
from colibri.generate import TokenEvent
from colibri.io.container import Container
from colibri.io.expert_store import ExpertStore
from colibri.threads import ThreadPolicy
from colibri.tokenizer import Tokenizer


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
    profile: dict | None = None         # the turn's profile (engine/turn_profile.py, TurnProfile.as_dict)

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
        config.validate()
        model.activations = config.activations
        model.kv_cache = config.kv_cache
        self.slots = slots.new_slots(model, config.kv_slots, self.max_context)
        if getattr(self.slots[0].cache, "dtype", "f32") != config.kv_cache:
            raise ColibriError(f"--kv-cache {config.kv_cache} covers grouped-query attention on the CPU; "
                               f"this model's cache ({type(self.slots[0].cache).__name__}) is float32 only")
        self._local = threading.local()  # `last`, per thread: concurrent streams (batching) each see their own
        self._threads = ThreadPolicy(config.threads)  # kernel threads: explicit, else adapted to the machine's load
        self._passes = gen.Passes(model, self._threads.apply)  # batched while start_batching holds
        phases = config.profile_phases
        if phases is None:
            phases = isinstance(experts, ExpertStore) or config.cluster is not None
        self._recorder = TurnRecorder(experts, self.vram_tier, phases, self._layer_kinds())

    @classmethod
    def load(cls, model_dir: str | Path | None = None, progress: bool = False, **options) -> "Engine":
        """Load a container directory; with no directory, the embedded default model
        (converted into the user's cache directory on first use). `options` are EngineConfig fields."""
        t0 = time.perf_counter()
        if model_dir is None:
            from colibri.default_model import default_model_dir

            model_dir = default_model_dir(progress=progress)
        config = EngineConfig.from_options(options).validate()
        container, tokenizer, model, experts = loader.load(model_dir, config, progress)
        return cls(container, tokenizer, model, config, load_s=time.perf_counter() - t0, experts=experts)

    def close(self) -> None:
        """Stop what runs on after an answer: resident experts still loading in the background
        (the reads in flight finish). The engine still answers: an expert not read yet is read
        by the forward that needs it."""
        cancel = getattr(self.experts, "cancel", None)
        if cancel is not None:
            cancel()

    @property
    def last(self) -> Generation | None:
        """The Generation the last stream finished on this thread."""
        return getattr(self._local, "last", None)

    @last.setter
    def last(self, g: Generation | None) -> None:
        self._local.last = g

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
    def model_args(self):
        """The model's ModelArgs (its shapes and per-layer kinds, as the container's config gives them)."""
        return self.model.args

    @property
    def num_layers(self) -> int:
        """Decoder layers this engine runs (a `--layers` slice holds fewer than its full model)."""
        return len(self.model.layers)

    @property
    def decodes_in_one_call(self) -> bool:
        """True when a decoded token runs every layer in one compiled call (dense int4 models):
        no phase can be timed inside it."""
        # The model's public name for it, once the models package gives it one; until then its own.
        program = getattr(self.model, "token_program", None) or getattr(self.model, "_token_program", None)
        return program is not None and program() is not None

    def _layer_kinds(self) -> list[str]:
        """"dense" or "moe" per decoder layer (the phase split's dense MLP counts the dense
        layers' feed-forward); empty for a model without per-layer kinds."""
        try:
            return [self.model.args.mlp_kind(i) for i in range(len(self.model.layers))]
        except (AttributeError, IndexError, TypeError):
            return []

    @property
    def profile_phases(self) -> bool:
        """Whether turns time their phases for their profiles (EngineConfig.profile_phases, resolved)."""
        return self._recorder.phases

    def profiles(self) -> list[dict]:
        """The profiles of the last turns (at most turn_profile.PROFILES_KEPT), oldest first."""
        return self._recorder.profiles()

    @property
    def device_bytes(self) -> int | None:
        """Bytes of dense weights in GPU memory with --device cuda; None on the CPU."""
        return getattr(self.model, "device_bytes", None)

    @property
    def vram_tier(self):
        """The routed experts' VRAM tier with --device cuda (colibri/placement/vram_experts.py), else None."""
        return getattr(self.model, "vram", None)

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

    # ------------------------------------------------------------------ slots (colibri/engine/slots.py)
    def ensure_slots(self, n: int) -> None:
        """At least n KV slots (the server sizes its batch after loading); new slots start empty."""
        check("kv_slots", n)
        while len(self.slots) < n:
            self.slots.append(KVSlot(self.model.new_cache(self.max_context)))

    def pick_slot(self, ids: list[int], exclude: set[int] = frozenset()) -> int:
        """The slot sharing the longest token prefix with `ids`, else the least recently used;
        never one in `exclude` (slots other generations are using)."""
        return slots.pick_slot(self.slots, ids, exclude)

    def reusable_prefix(self, slot: int, ids: list[int]) -> int:
        """How many of `ids` a generation in `slot` would take from the KV cache (not prefill)."""
        return slots.reusable_prefix(self.slots[slot], ids)

    def reset(self, slot: int | None = None) -> None:
        for s in self.slots if slot is None else [self.slots[slot]]:
            slots.clear(s)

    def save_slot(self, slot: int, path: str | Path) -> None:
        slots.save(self.slots[slot], path, self.model_id)

    def load_slot(self, slot: int, path: str | Path) -> int:
        """Restore a slot saved by save_slot; returns how many tokens it holds."""
        return slots.load(self.slots[slot], path, self.model_id)

    # ------------------------------------------------------------------ batching
    def start_batching(self) -> None:
        """From now on, streams running at the same time on different threads (and different
        slots) share forward passes (colibri/batching.py); each one's tokens stay exactly
        what it would produce alone."""
        if self._passes.batcher is None:
            self._passes.batcher = StepBatcher(self.model, self._threads.apply)

    def stop_batching(self) -> None:
        if self._passes.batcher is not None:
            self._passes.batcher.stop()
            self._passes.batcher = None

    @property
    def _batcher(self) -> StepBatcher | None:
        return self._passes.batcher

    @property
    def batch_stats(self) -> dict | None:
        b = self._passes.batcher
        return None if b is None else {"steps": b.steps, "rows": b.rows_run,
                                       "mean_rows": round(b.rows_run / b.steps, 3) if b.steps else 0.0}

    def _speculator(self, ids: list[int], mode: str, draft_tokens: int) -> spec.Speculator:
        """Drafts from the model's MTP layer for "mtp" (and "auto" where there is one), else by
        prompt lookup. Batched or not: the batcher hands each generation its own rows' hidden
        states and runs its MTP passes on its own thread, between steps."""
        has_mtp = getattr(self.model, "has_mtp", False)
        if mode == "mtp" and not has_mtp:
            raise ColibriError("speculative 'mtp' needs a model with a multi-token-prediction layer "
                               "(num_nextn_predict_layers or mtp_num_hidden_layers, with its weights in the "
                               "container); this one has none: use 'ngram' or 'auto'")
        mtp = spec.MTPDrafter(self.model, ids, self.max_context) if mode in ("mtp", "auto") and has_mtp else None
        return spec.Speculator(self._passes.drafted_rows, ids, mode, draft_tokens, mtp=mtp)

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
        shift = penalties if penalties is not None and penalties.active else None
        if shift is not None and shift.logit_bias:
            bad = [t for t in shift.logit_bias if not 0 <= t < self.vocab_size]
            if bad:
                raise ColibriError(f"logit_bias names token {bad[0]}, outside the vocabulary (0..{self.vocab_size - 1})")
        turn = gen.Turn(
            passes=self._passes, kv=kv, ids=ids, max_tokens=max_tokens, prefill_chunk=self.config.prefill_chunk,
            model_id=self.model_id, started=t_start, params=gen.SamplingParams(temperature, top_p, top_k, seed, min_p),
            rng=np.random.default_rng(seed), stops=gen.StopMatcher(stop or []),
            eos=self.tokenizer.eos_token_ids if (self.tokenizer and stop_at_eos) else set(),
            decoder=self.tokenizer.stream_decoder() if self.tokenizer else None, shift=shift, constraint=constraint,
            cancel=cancel, logprobs=logprobs, scored=[] if prompt_logprobs is not None else None,
            prompt_top=prompt_logprobs)

        reused = slots.reuse_prefix(kv, ids, keep=turn.scored is None)
        # Room for the whole generation before prefill: one allocation, where growing on demand
        # doubled the cache (copying all of it) inside the prompt and again inside the answer.
        # Untouched rows cost no memory (np.zeros maps zero pages lazily).
        kv.cache.reserve(min(len(ids) + max_tokens, self.max_context))
        t_prefill0 = time.perf_counter()
        prefill_s = 0.0
        t_decode0 = t_prefill0
        turn.drafts = self._speculator(ids, speculative, draft_tokens) if speculative != "off" else None
        batcher = self._passes.batcher
        recording = self._recorder.begin()
        if batcher is not None:
            batcher.join()
        try:
            if max_tokens > 0 or turn.scored is not None:
                logits = gen.prefill_prompt(turn, reused)
                prefill_s = time.perf_counter() - t_prefill0
                t_decode0 = time.perf_counter()
                if logits is None:
                    turn.finish = "cancelled"
                else:
                    if turn.scored is not None:
                        yield TokenEvent(None, "", prompt_logprobs=turn.scored)
                    yield from gen.decode_n_tokens(turn, logits)
            yield from gen.flush_text(turn)
        finally:
            recording.finish()  # (lets the phase clock go, also when the turn failed or was left)
            # The cache holds exactly the tokens in kv.ids (no drafts past them), also when the
            # consumer stops early.
            if batcher is not None:
                batcher.leave()
            if turn.drafts is not None:
                turn.drafts.finish(kv.cache, len(kv.ids))
            kv.cache.truncate(len(kv.ids))
            kv.ids = kv.ids[: kv.cache.length]  # (a recurrent state that failed mid-pass went back further)
        decode_s = time.perf_counter() - t_decode0
        profile = recording.profile(len(ids), reused, len(turn.out), prefill_s, decode_s, turn.finish, slot)
        self.last = Generation(turn.out, "".join(turn.text), turn.finish, len(ids), reused, turn.ttft, prefill_s,
                               decode_s, slot, turn_stats(recording.start.store, recording.end.store),
                               turn.scored, constraint.mask_seconds if constraint is not None else 0.0,
                               turn.drafts.stats.as_dict() if turn.drafts is not None else None, profile)
        if hasattr(self.experts, "save_history"):  # a streaming store, or the cluster's head
            self.experts.save_history()

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> Generation:
        for _ in self.stream(prompt, max_tokens=max_tokens, **kwargs):
            pass
        return self.last

    def feed(self, ids: list[int], slot: int = 0) -> list[float]:
        """Teacher-forced decode: append `ids` to a slot one token at a time, as decode does.
        Returns seconds per token. Benchmarks use it for realistic routing: greedy text from
        random weights repeats one token and would flatter every cache."""
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

    # ------------------------------------------------------------------ scoring
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
            yield a, gen.finite(rows, a, self.model_id)

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

    # ------------------------------------------------------------------ telemetry
    def _store_stats(self) -> dict | None:
        return store_stats(self.experts, self.vram_tier)

    @property
    def expert_stats(self) -> dict | None:
        """Cumulative expert-cache figures (hit rate, bytes read, disk wait) when streaming."""
        return self._store_stats()
