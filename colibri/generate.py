"""The token loop, gpt-fast style: prefill, decode_one, sample, each small.

The hot path is `model.forward` on one token (decode_one): per token it runs every layer's
matvec kernels once; everything here around it is O(vocab) numpy at most.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


def prefill(model, cache, ids: list[int]) -> np.ndarray:
    """Run the prompt as one matrix x matrix pass; returns the last position's logits [V]."""
    return model.forward(np.asarray(ids, dtype=np.int64), cache)[-1]


def decode_one(model, cache, token: int) -> np.ndarray:
    return model.forward(np.asarray([token], dtype=np.int64), cache)[-1]


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else temperature, then top-k, then top-p (nucleus), as
    transformers' logits warpers order them."""
    if p.temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = cum - probs[order] < p.top_p  # always keeps the most likely token
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


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
