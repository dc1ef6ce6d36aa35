"""The one in-process Engine: container + tokenizer + model + expert source + KV cache.

CLI commands and the server build one Engine and call `generate` / `stream`; nothing outside
reaches into the model. The engine keeps its KV cache between calls and reuses the longest
common token prefix, so a conversation only prefills its new tokens.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri import generate as gen
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.experts import ResidentExperts
from colibri.models import family
from colibri.tokenizer import Tokenizer


@dataclass
class EngineConfig:
    """Runtime knobs (never mixed into a model's ModelArgs)."""

    max_context: int | None = None  # tokens; default: the model's, capped at DEFAULT_MAX_CONTEXT


DEFAULT_MAX_CONTEXT = 8192


@dataclass
class TokenEvent:
    token_id: int
    text: str  # the text this token completes (may be "" while a UTF-8 character is pending)


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str                  # "stop" (end-of-sequence token) or "length"
    prompt_tokens: int
    prompt_tokens_reused: int           # served from the KV cache, not prefilled
    ttft_s: float                       # request start -> first token sampled
    prefill_s: float
    decode_s: float
    timings: dict = field(default_factory=dict)

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
                 load_s: float = 0.0):
        self.container = container
        self.tokenizer = tokenizer
        self.model = model
        self.config = config
        self.load_s = load_s
        model_max = int(container.config.get("max_position_embeddings") or DEFAULT_MAX_CONTEXT)
        self.max_context = config.max_context or min(model_max, DEFAULT_MAX_CONTEXT)
        self.cache = model.new_cache(self.max_context)
        self.cached_ids: list[int] = []
        self.last: Generation | None = None

    @classmethod
    def load(cls, model_dir: str | Path | None = None, progress: bool = False, **options) -> "Engine":
        """Load a container directory; with no directory, the embedded default model
        (converted into the user's cache directory on first use)."""
        t0 = time.perf_counter()
        if model_dir is None:
            from colibri.default_model import default_model_dir

            model_dir = default_model_dir(progress=progress)
        config = EngineConfig(**options)
        container = Container(model_dir)
        module = family(container.config.get("model_type"))
        experts = ResidentExperts(container)
        model = module.build(container.config, container, experts)
        tok_path = Path(model_dir) / "tokenizer.json"
        tokenizer = Tokenizer.from_dir(model_dir) if tok_path.exists() else None
        return cls(container, tokenizer, model, config, load_s=time.perf_counter() - t0)

    # ------------------------------------------------------------------ prompts
    @property
    def model_type(self) -> str:
        return self.container.config.get("model_type", "?")

    def encode_prompt(self, prompt: str | list[int] | list[dict], raw: bool = False,
                      system: str | None = None, **template_kwargs) -> list[int]:
        """str -> chat template (unless raw) -> ids; list[dict] -> messages; list[int] -> as is."""
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in prompt]
            vocab = self.model.args.vocab_size
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

    # ------------------------------------------------------------------ generation
    def stream(self, prompt, max_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None, raw: bool = False, system: str | None = None,
               stop_at_eos: bool = True, **template_kwargs) -> Iterator[TokenEvent]:
        """Yield tokens as they are produced. When the iterator is exhausted, `self.last`
        holds the finished Generation (text, finish reason, timings)."""
        if max_tokens < 0:
            raise ColibriError(f"max_tokens must be >= 0, not {max_tokens}")
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ColibriError("sampling needs temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        t_start = time.perf_counter()
        ids = self.encode_prompt(prompt, raw=raw, system=system, **template_kwargs)
        if not ids:
            raise ColibriError("the prompt is empty")
        if len(ids) + max_tokens > self.max_context:
            if len(ids) >= self.max_context:
                raise ColibriError(f"the prompt has {len(ids)} tokens; the context holds {self.max_context}")
            max_tokens = self.max_context - len(ids)
        params = gen.SamplingParams(temperature, top_p, top_k, seed)
        rng = np.random.default_rng(seed)
        eos = self.tokenizer.eos_token_ids if (self.tokenizer and stop_at_eos) else set()
        decoder = self.tokenizer.stream_decoder() if self.tokenizer else None

        reused = self._reuse_prefix(ids)
        out: list[int] = []
        finish = "length"
        t_prefill0 = time.perf_counter()
        ttft = prefill_s = 0.0
        t_decode0 = t_prefill0
        try:
            if max_tokens > 0:
                logits = gen.prefill(self.model, self.cache, ids[reused:])
                self.cached_ids = list(ids)
                prefill_s = time.perf_counter() - t_prefill0
                t_decode0 = time.perf_counter()
                while True:
                    tok = gen.sample(logits, params, rng)
                    if not out:
                        ttft = time.perf_counter() - t_start
                    if tok in eos:
                        finish = "stop"
                        break
                    out.append(tok)
                    yield TokenEvent(tok, decoder.feed(tok) if decoder else "")
                    if len(out) >= max_tokens:
                        break
                    logits = gen.decode_one(self.model, self.cache, tok)
                    self.cached_ids.append(tok)
        finally:
            # The cache holds exactly the tokens in cached_ids, also when the consumer stops early.
            self.cache.truncate(len(self.cached_ids))
        text = self.tokenizer.decode(out) if self.tokenizer else ""
        self.last = Generation(out, text, finish, len(ids), reused, ttft, prefill_s,
                               time.perf_counter() - t_decode0)

    def generate(self, prompt, max_tokens: int = 256, **kwargs) -> Generation:
        for _ in self.stream(prompt, max_tokens=max_tokens, **kwargs):
            pass
        return self.last

    def _reuse_prefix(self, ids: list[int]) -> int:
        """Keep the cached tokens shared with `ids` (at least one token is left to prefill,
        since its logits are needed); returns how many were reused."""
        n = 0
        limit = min(len(self.cached_ids), len(ids) - 1)
        while n < limit and self.cached_ids[n] == ids[n]:
            n += 1
        self.cache.truncate(n)
        self.cached_ids = self.cached_ids[:n]
        return n

    def reset(self) -> None:
        self.cache.truncate(0)
        self.cached_ids = []

    def logits(self, ids: list[int]) -> np.ndarray:
        """Logits [L, V] for every position of `ids` in a fresh context (tests, scoring)."""
        cache = self.model.new_cache(max(len(ids), 1))
        return self.model.forward(np.asarray(ids, dtype=np.int64), cache, all_logits=True)
