"""The two backends `colibri chat` talks to, and what a turn reports: EngineBackend drives an
in-process Engine, AttachBackend a running `colibri serve` over its OpenAI API (stdlib HTTP, SSE).
Both stream an answer's text for a conversation and leave the turn's figures in `stats`;
colibri/tui.py draws them."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from colibri.errors import ColibriError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # how reasoning models mark their reasoning


@dataclass
class TurnStats:
    completion_tokens: int
    finish_reason: str                   # "stop", "length" or "interrupted"
    elapsed_s: float
    prompt_tokens: int | None = None
    prompt_tokens_reused: int | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    prefill_tok_s: float | None = None
    hit_rate: float | None = None        # expert cache (RAM tier), when the engine reports one
    vram_hit_rate: float | None = None   # --device cuda: the VRAM tier above it
    rss_bytes: int | None = None
    experts_loaded: float | None = None  # resident experts still loading: the share in RAM after the turn

    @property
    def tok_s(self) -> float:
        if self.decode_tok_s:
            return self.decode_tok_s
        decode = self.elapsed_s - (self.ttft_s or 0.0)
        return (self.completion_tokens - 1) / decode if self.completion_tokens > 1 and decode > 0 else 0.0


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None



class EngineBackend:
    """A chat backend over an in-process Engine."""

    def __init__(self, engine, sampling: dict):
        self.engine = engine
        self.sampling = sampling
        self.stats: TurnStats | None = None

    def describe(self) -> dict:
        from colibri.info import describe, quant_summary

        info = describe(self.engine.container)
        return {"model": self.engine.model_id, "family": self.engine.model_type, "quant": quant_summary(info),
                "weights_bytes": info["disk"]["dense_bytes"] + info["disk"]["expert_bytes"],
                "streaming": self._expert_counts() is not None,
                "load_s": self.engine.load_s, "rss_bytes": rss_bytes()}

    def opens_in_reasoning(self, messages: list[dict], system: str | None) -> bool:
        """Whether the chat template already opened a reasoning block for the answer."""
        tok = self.engine.tokenizer
        if tok is None or not tok.has_chat_template:
            return False
        msgs = ([{"role": "system", "content": system}] if system else []) + messages
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        except ColibriError:
            return False
        tail = text.rstrip()
        return tail.endswith(THINK_OPEN) and THINK_CLOSE not in tail[-len(THINK_OPEN) - 2:]

    def stream(self, messages: list[dict], system: str | None, max_tokens: int) -> Iterator[str]:
        """Text pieces of the answer; self.stats holds the turn's figures afterwards (also when
        the consumer stops early: closing the engine's stream keeps its KV cache consistent)."""
        self.stats = None
        before = self._expert_counts()
        t0 = time.perf_counter()
        n, first, done = 0, None, False
        it = self.engine.stream(messages, max_tokens=max_tokens, system=system, **self.sampling)
        try:
            for ev in it:
                n += ev.token_id is not None  # the last event may carry only held-back text
                if first is None:
                    first = time.perf_counter() - t0
                if ev.text:
                    yield ev.text
            done = True
        finally:
            it.close()
            elapsed = time.perf_counter() - t0
            g = self.engine.last if done else None
            if g is not None:
                self.stats = TurnStats(g.completion_tokens, g.finish_reason, elapsed, g.prompt_tokens,
                                       g.prompt_tokens_reused, g.ttft_s, g.decode_tok_s, g.prefill_tok_s)
            else:
                self.stats = TurnStats(n, "interrupted", elapsed, ttft_s=first)
            self.stats.hit_rate = self._turn_hit_rate(before)
            self.stats.vram_hit_rate = self._turn_hit_rate(before, "vram_")
            self.stats.rss_bytes = rss_bytes()
            self.stats.experts_loaded = self.experts_loaded()

    def experts_loaded(self) -> float | None:
        """The share of the resident experts' bytes in RAM while they load in the background;
        None once all are in (or where experts are not all resident)."""
        experts = getattr(self.engine, "experts", None)
        total = self.engine.container.expert_bytes
        if experts is None or not total or getattr(experts, "complete", True) or not hasattr(experts, "loaded_bytes"):
            return None
        return experts.loaded_bytes / total

    def _expert_counts(self) -> dict | None:
        """The engine's cumulative expert-cache figures, when experts stream (else None)."""
        stats = getattr(self.engine, "expert_stats", None)
        if callable(stats):
            stats = stats()
        return dict(stats) if isinstance(stats, dict) else None

    def _turn_hit_rate(self, before: dict | None, tier: str = "") -> float | None:
        """This turn's hit rate of the RAM tier, or with tier="vram_" of the VRAM tier."""
        after = self._expert_counts()
        hits, misses, rate = f"{tier}hits", f"{tier}misses", f"{tier}hit_rate"
        if after is None or rate not in after:
            return None
        if before and {hits, misses} <= set(after) & set(before):  # this turn's share, not the session's
            h, m = after[hits] - before[hits], after[misses] - before[misses]
            return h / (h + m) if h + m else None
        return float(after[rate]) if after.get(rate) is not None else None

    def reset(self) -> None:
        self.engine.reset()


class AttachBackend:
    """A chat backend talking to a running `colibri serve` (or any OpenAI-compatible server)
    through POST /v1/chat/completions with stream=true; the server keeps the KV cache."""

    def __init__(self, url: str, sampling: dict, api_key: str | None = None):
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.sampling = sampling
        self.api_key = api_key or os.environ.get("COLIBRI_API_KEY")
        self.stats: TurnStats | None = None
        self.model = None

    def _request(self, path: str, body: dict | None = None, timeout: float = 600):
        import urllib.error
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.base + path, data=None if body is None else json.dumps(body).encode(),
                                     headers=headers, method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:300]
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise ColibriError(f"{self.base}{path}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ColibriError(f"cannot reach {self.base} ({reason}); is `colibri serve` running there?") from None

    def describe(self) -> dict:
        with self._request("/models", timeout=10) as r:
            models = json.loads(r.read()).get("data", [])
        self.model = models[0]["id"] if models else "default"
        return {"model": self.model, "family": f"attached to {self.base}", "quant": None,
                "weights_bytes": None, "load_s": None, "rss_bytes": None}

    def opens_in_reasoning(self, messages, system) -> bool:
        return False

    def stream(self, messages: list[dict], system: str | None, max_tokens: int) -> Iterator[str]:
        self.stats = None
        msgs = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": m["role"], "content": m["content"]} for m in messages]
        body = {"model": self.model or "default", "messages": msgs, "stream": True, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True},
                **{k: v for k, v in self.sampling.items() if v is not None and k != "top_k"}}
        t0 = time.perf_counter()
        n, first, finish, usage = 0, None, "interrupted", {}
        try:
            resp = self._request("/chat/completions", body)
        except ColibriError as e:  # a server that rejects the usage option still streams without it
            if "stream_options" not in str(e):
                raise
            body.pop("stream_options")
            resp = self._request("/chat/completions", body)
        try:
            for raw in resp:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    for key in ("reasoning_content", "content"):
                        text = delta.get(key)
                        if text:
                            n += 1
                            if first is None:
                                first = time.perf_counter() - t0
                            yield f"{THINK_OPEN}{text}{THINK_CLOSE}" if key == "reasoning_content" else text
                    finish = choice.get("finish_reason") or finish
        finally:
            resp.close()
            details = usage.get("prompt_tokens_details") or {}
            self.stats = TurnStats(usage.get("completion_tokens", n), finish, time.perf_counter() - t0,
                                   usage.get("prompt_tokens"), details.get("cached_tokens"), first)

    def reset(self) -> None:
        pass  # the server matches prefixes itself; a new conversation simply shares none
