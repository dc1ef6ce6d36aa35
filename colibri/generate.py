"""The token loop, gpt-fast style: each step a small named function.

    prefill_prompt    the prompt (less what the slot already holds), a chunk per forward pass
    next_token        penalties, the grammar's mask, then `sample`
    decode_n_tokens   the loop: a token, its event, the stop rules, `decode_one_token`
    decode_one_token  the forward pass after one sampled token (with drafts, the pass that checks them)

`Turn` holds one generation's state through them; Engine.stream builds it, and `Passes` runs
the forward passes (on the model, or through the engine's StepBatcher while it batches).

The hot path is the forward pass on one token (decode_one_token): per token it runs every
layer's kernels once, milliseconds at least; everything else here around it is O(vocabulary)
numpy at most, and the Python in between a few attribute reads. Keep it that way: no per-token
allocation proportional to the context, no per-token call into the tokenizer beyond its
streaming decoder.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from colibri.errors import EngineFault


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
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0  # keep tokens at least min_p x the most likely one's probability (0: off)


@dataclass
class Penalties:
    """What shifts the logits before sampling, in vLLM's order and definitions: logit_bias
    (added; OpenAI's -100..100), then repetition (divides a positive logit, multiplies a
    negative one, for every token of the prompt and the output; 1 = off), then frequency and
    presence (subtract count x frequency + presence for every token of the output so far)."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    def apply(self, logits: np.ndarray, prompt: list[int], out: list[int]) -> np.ndarray:
        """A shifted copy of `logits` [V] (the raw ones stay for reported logprobs)."""
        z = logits.astype(np.float32, copy=True)
        if self.logit_bias:
            ids = np.fromiter(self.logit_bias, dtype=np.int64)
            z[ids] += np.fromiter(self.logit_bias.values(), dtype=np.float32)
        if self.repetition != 1.0:
            seen = np.unique(np.asarray(prompt + out, dtype=np.int64))
            v = z[seen]
            z[seen] = np.where(v > 0, v / self.repetition, v * self.repetition)
        if (self.frequency or self.presence) and out:
            counts = Counter(out)
            ids = np.fromiter(counts, dtype=np.int64)
            n = np.fromiter(counts.values(), dtype=np.float32)
            z[ids] -= n * self.frequency + self.presence
        return z


def prefill(model, cache, ids: list[int]) -> np.ndarray:
    """Run the prompt as one matrix x matrix pass; returns the last position's logits [V]."""
    return model.forward(np.asarray(ids, dtype=np.int64), cache)[-1]


def decode_one(model, cache, token: int) -> np.ndarray:
    return model.forward(np.asarray([token], dtype=np.int64), cache)[-1]


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else one draw from the distribution of `candidates` (one
    uniform number per token, so a seed gives the same tokens)."""
    if p.temperature <= 0.0:
        return int(np.argmax(logits))
    ids, w = candidates(logits, p)
    c = np.cumsum(w)
    return int(ids[min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), ids.size - 1)])


# Candidates looked at first when top-p alone trims the vocabulary; grown 8x while their mass is
# short of top_p. Peaked (trained) distributions need a few dozen; a flat one ends in a full sort.
_TOP_P_FIRST = 512


def candidates(logits: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sampling may pick, best first (ties: lower id first), and their unnormalized
    probabilities, for temperature > 0: temperature, then top-k, then top-p (nucleus), then
    min-p, as transformers' logits warpers order them.

    Only the tokens that can survive are sorted: the top-k by a partial selection (O(V)), and
    for top-p without top-k the best few hundred, grown while their mass is short of top_p. A
    full sort of a 152k vocabulary took ~20 ms a token; this takes ~1 ms (docs/benchmarks.md: Kernels)."""
    z = np.asarray(logits, dtype=np.float32)
    V = z.size
    top = z.max()
    k = p.top_k if 0 < p.top_k < V else V
    if k == V and p.top_p >= 1.0:  # nothing trims by rank: no order needed (min-p is against the max, 1)
        w = np.exp((z - top) / np.float32(p.temperature))
        ids = np.arange(V) if p.min_p <= 0.0 else np.flatnonzero(w >= p.min_p)
        return ids, w[ids].astype(np.float64)
    if k == V and p.top_p < 1.0:  # top-p measures mass against the whole vocabulary
        total = float(np.exp((z - top) / np.float32(p.temperature)).sum(dtype=np.float64))
    m = k if k < V else min(V, _TOP_P_FIRST)
    while True:
        ids = np.argpartition(z, V - m)[V - m:] if m < V else np.arange(V)
        ids = ids[np.lexsort((ids, -z[ids]))]
        w = np.exp((z[ids].astype(np.float64) - float(top)) / p.temperature)
        if k < V:
            total = w.sum()
        if p.top_p >= 1.0:
            break
        cum = np.cumsum(w) / total
        n = int(np.count_nonzero(cum - w / total < p.top_p))  # always keeps the most likely token
        if n < m or m == V or k < V:
            ids, w = ids[:n], w[:n]
            break
        m = min(V, m * 8)  # every candidate was kept: the nucleus may reach further
    if p.min_p > 0.0:
        keep = w >= p.min_p * w[0]
        ids, w = ids[keep], w[keep]
    return ids, w


def score_next(rows: np.ndarray, targets: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """Row i of `rows` [n, V] scores targets[i]: (log p(target), the `top` most likely tokens
    with their log p, best first). Rows are taken a few at a time: a 512-token prefill chunk's
    log-softmax at a 150k vocabulary would otherwise be 600 MB of float64."""
    out = []
    for a in range(0, len(targets), 32):
        z = rows[a : a + 32].astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
        for i, t in enumerate(targets[a : a + 32]):
            best = _top(z[i], top)
            out.append((float(z[i, t]), [(int(j), float(z[i, j])) for j in best]))
    return out


def _top(z: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries, best first."""
    if k <= 0:
        return np.zeros(0, np.int64)
    cand = np.argpartition(-z, min(k, z.size - 1))[: k + 1] if k < z.size else np.arange(z.size)
    cand = np.sort(cand)
    return cand[np.argsort(-z[cand], kind="stable")][:k]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    m = z.max()
    return z - m - np.log(np.exp(z - m).sum())


class StopMatcher:
    """Finds stop strings in streamed text without ever emitting any part of one: text that
    could be the start of a stop string is held back until the next token decides it."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was hit)."""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# ---------------------------------------------------------------------- the token loop

class Passes:
    """The forward passes of an engine's generations: on the model, or through `batcher` (the
    engine's StepBatcher while it batches, else None; read at every pass, since batching starts
    and stops between generations). `before` runs before each pass the loop makes (the engine's
    kernel-thread policy)."""

    def __init__(self, model, before: Callable[[], None]):
        self.model = model
        self.before = before
        self.batcher = None

    def chunk(self, cache, piece: list[int], all_logits: bool = False) -> np.ndarray:
        """Logits of a prompt chunk after the cache's contents: the last row, or every row."""
        if self.batcher is not None:
            return self.batcher.chunk(piece, cache, all_logits)
        return self.model.forward(np.asarray(piece, dtype=np.int64), cache, all_logits=all_logits)

    def token(self, cache, tok: int) -> np.ndarray:
        """The next position's logits after one token."""
        if self.batcher is not None:
            return self.batcher.rows([tok], [cache])[0]
        return decode_one(self.model, cache, tok)

    def drafted_rows(self, tok: int, cache, draft) -> tuple[list[int], np.ndarray, np.ndarray]:
        """draft(), then forward_rows over [tok, *drafts] in one cache -> (drafts, logits rows,
        final hidden states); through the batcher when batching (both on its thread, the pass
        shared with other streams). speculative.Speculator's pass."""
        if self.batcher is not None:
            return self.batcher.drafted_rows(tok, cache, draft)
        drafts = draft()
        rows = self.model.forward_rows([tok, *drafts], [cache] * (len(drafts) + 1))
        return drafts, rows, self.model.rows_hidden


@dataclass
class Turn:
    """One generation's state through prefill and the token loop (Engine.stream builds it)."""

    passes: Passes
    kv: object                      # the KV slot (engine.slots.KVSlot): its cache and the ids it holds
    ids: list[int]                  # the prompt
    max_tokens: int
    prefill_chunk: int              # prompt tokens per forward pass
    model_id: str                   # named by the error damaged weights give
    started: float                  # perf_counter() when the request came: time to first token from here
    params: SamplingParams
    rng: np.random.Generator
    stops: StopMatcher
    eos: set[int] = field(default_factory=set)
    decoder: object | None = None   # the tokenizer's streaming decoder (None: token ids only, no text)
    shift: Penalties | None = None  # active penalties and logit bias
    constraint: object | None = None  # a colibri.grammar.Matcher
    drafts: object | None = None    # a speculative.Speculator
    cancel: Callable[[], bool] | None = None  # polled between prefill chunks and between tokens
    logprobs: int | None = None     # alternatives reported with each token (None: no logprobs)
    scored: list | None = None      # with prompt_logprobs: the prompt's scores, filled by prefill_prompt
    prompt_top: int | None = None   # alternatives reported with each prompt token
    # What it produced.
    out: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish: str = "length"
    hit: bool = False               # a stop string ended it
    ttft: float = 0.0


def prefill_prompt(turn: Turn, start: int) -> np.ndarray | None:
    """Prefill ids[start:] in chunks of `prefill_chunk` tokens; the last position's logits,
    or None when cancelled between chunks. kv.ids follows every chunk, so the slot always
    names exactly what its cache holds. With `scored` (a list, start 0), every position's
    logits are kept long enough to append (log p(next prompt token), `prompt_top` best) to it."""
    kv, ids, chunk, passes = turn.kv, turn.ids, turn.prefill_chunk, turn.passes
    logits = None
    for a in range(start, len(ids), chunk):
        if turn.cancel is not None and turn.cancel():
            return None
        passes.before()
        piece = ids[a : a + chunk]
        if turn.scored is None:
            logits = passes.chunk(kv.cache, piece)[-1]
        else:
            rows = passes.chunk(kv.cache, piece, all_logits=True)
            finite(rows, a, turn.model_id)
            turn.scored.extend(score_next(rows[: len(ids) - 1 - a], ids[a + 1 : a + 1 + len(piece)], turn.prompt_top))
            logits = rows[-1]
        kv.ids = ids[: a + len(piece)]
    return finite(logits, len(ids) - 1, turn.model_id)


def next_token(turn: Turn, logits: np.ndarray) -> int | None:
    """The token sampled from `logits` after the penalties and the grammar's mask (the raw
    logits stay for reported logprobs); None when the grammar allows no token."""
    z = turn.shift.apply(logits, turn.ids, turn.out) if turn.shift is not None else logits
    if turn.constraint is not None:
        if z is logits:
            z = logits.copy()
        turn.constraint.mask(z)
        if turn.constraint.dead:
            return None
    return sample(z, turn.params, turn.rng)


def decode_one_token(turn: Turn, tok: int) -> np.ndarray:
    """The forward pass after sampled token `tok` (with drafts, the pass that also checks
    them): the next position's logits. The slot then holds `tok`."""
    kv = turn.kv
    turn.passes.before()
    if turn.drafts is None:
        logits = turn.passes.token(kv.cache, tok)
    else:
        logits = turn.drafts.step(kv.cache, len(kv.ids), tok, turn.max_tokens - len(turn.out) - 1)
    logits = finite(logits, len(kv.ids), turn.model_id)
    kv.ids.append(tok)
    return logits


def decode_n_tokens(turn: Turn, logits: np.ndarray) -> Iterator[TokenEvent]:
    """Sample from `logits` (the prompt's last position), then token after token until one of
    the stop rules: end of sequence, a stop string, the grammar complete or at a dead end,
    max_tokens, `cancel`. Sets turn.finish unless max_tokens ended it."""
    out, stops, decoder, constraint = turn.out, turn.stops, turn.decoder, turn.constraint
    while turn.max_tokens > 0:  # (0: the prompt is only scored)
        tok = next_token(turn, logits)
        if tok is None:
            turn.finish = "grammar_dead_end"
            return
        if not out:
            turn.ttft = time.perf_counter() - turn.started
        if tok in turn.eos:
            turn.finish = "stop"
            if turn.logprobs is not None:
                ev = token_event(tok, "", logits, turn.logprobs)
                ev.end = True
                yield ev
            return
        if constraint is not None:
            constraint.accept(tok)
        out.append(tok)
        piece, turn.hit = stops.feed(decoder.feed(tok) if decoder else "")
        turn.text.append(piece)
        yield token_event(tok, piece, logits, turn.logprobs)
        if turn.hit or (constraint is not None and constraint.done):  # a stop string; a complete grammar
            turn.finish = "stop"
            return
        if len(out) >= turn.max_tokens:
            return
        if turn.cancel is not None and turn.cancel():
            turn.finish = "cancelled"
            return
        logits = decode_one_token(turn, tok)


def flush_text(turn: Turn) -> Iterator[TokenEvent]:
    """Text held back for a possible stop string (or a split character) is real once no stop
    string ended the generation: one last event carries it."""
    if not turn.hit:
        tail = turn.stops.feed(turn.decoder.flush() if turn.decoder else "")[0] + turn.stops.flush()
        if tail:
            turn.text.append(tail)
            yield TokenEvent(None, tail)


def token_event(tok: int, text: str, logits: np.ndarray, logprobs: int | None) -> TokenEvent:
    if logprobs is None:
        return TokenEvent(tok, text)
    lp = log_softmax(logits)
    top = np.argsort(-lp, kind="stable")[:logprobs] if logprobs else []
    return TokenEvent(tok, text, float(lp[tok]), [(int(i), float(lp[i])) for i in top])


def finite(logits: np.ndarray, position: int, model_id: str) -> np.ndarray:
    """The guard against damaged weights that no checksum caught (a dense tensor, a container
    without checksums): NaN or infinite logits would otherwise sample token 0 forever."""
    if not np.isfinite(logits).all():
        raise EngineFault(f"non-finite logits at position {position} of {model_id}: a weight file is damaged "
                          "(run `colibri info` on the model, re-convert it or restore its files)")
    return logits
