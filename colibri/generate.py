"""The token loop, gpt-fast style: prefill, decode_one, sample, each small.

The hot path is `model.forward` on one token (decode_one): per token it runs every layer's
matvec kernels once; everything here around it is O(vocab) numpy at most.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


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
    full sort of a 152k vocabulary took ~20 ms a token; this takes ~1 ms (bench in README)."""
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
