"""Quality, measured: perplexity over a text with a sliding window, and the KL divergence of a
run's next-token distributions against a saved reference, so two configurations (quantization
schemes, budgets, devices, engines) are compared on the same tokens (`colibri perplexity`).

Windows are Hugging Face's "perplexity of fixed-length models" method: windows of `ctx` tokens
starting every `stride` tokens; each window scores only the tokens no earlier window scored, each
predicted from the window's tokens before it (so every scored token but those of the first window
has at least ctx - stride tokens of context). With stride = ctx / 2 this is close to
llama-perplexity, which scores the second half of non-overlapping ctx-token chunks.

A reference keeps, for every scored token, the TOP_SAVED most likely next tokens and their log
probabilities (20k tokens: ~40 MB instead of 4 GB of full distributions at a 49k vocabulary).
KL(reference || run) is computed over those tokens plus one bucket holding the rest of each
distribution's mass: a lower bound of the full KL that misses only how the two distributions
split their last (1 - top-256 mass) differently.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

TOP_SAVED = 256
REFERENCE_VERSION = 1


def check_windows(ctx: int, stride: int) -> None:
    if ctx < 2:
        raise ColibriError(f"--ctx must be at least 2, not {ctx}")
    if not 1 <= stride <= ctx:
        raise ColibriError(f"--stride must be between 1 and --ctx ({ctx}), not {stride}")


def windows(n_tokens: int, ctx: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first target) of each window over n_tokens tokens: the window runs the model
    on tokens[begin:end] and scores targets first..end-1."""
    check_windows(ctx, stride)
    if n_tokens < 2:
        raise ColibriError(f"the text has {n_tokens} token(s); scoring needs at least 2")
    out, scored_to, begin = [], 1, 0
    while scored_to < n_tokens:
        # A window never starts on its first target: that token would have no context (with
        # stride = ctx the window starts one token early instead).
        start = min(begin, scored_to - 1)
        end = min(start + ctx, n_tokens)
        out.append((start, end, scored_to))
        scored_to = end
        begin += stride
    return out


@dataclass
class Scores:
    """Per scored token: its log probability, and (for a reference or a KL run) the top tokens."""

    targets: np.ndarray                      # token ids scored, in text order
    logprobs: np.ndarray                     # log p(target | its window's tokens before it), float64
    top_ids: np.ndarray | None = None        # [n, TOP_SAVED] int32, best first
    top_logprobs: np.ndarray | None = None   # [n, TOP_SAVED] float32
    kl: np.ndarray | None = None             # KL(reference || this run) per token
    agree: np.ndarray | None = None          # this run's most likely token is the reference's
    seconds: float = 0.0
    config: dict = field(default_factory=dict)

    @property
    def perplexity(self) -> float:
        return float(np.exp(-self.logprobs.mean()))

    def summary(self) -> dict:
        out = {"tokens_scored": int(self.logprobs.size), "perplexity": self.perplexity,
               "mean_nll": float(-self.logprobs.mean()), "seconds": self.seconds,
               "tokens_per_s": self.logprobs.size / self.seconds if self.seconds else 0.0, **self.config}
        if self.kl is not None:
            out.update(kl_mean=float(self.kl.mean()), kl_median=float(np.median(self.kl)),
                       kl_p99=float(np.percentile(self.kl, 99)), kl_max=float(self.kl.max()),
                       top1_agreement=float(self.agree.mean()))
        return out


def score_text(engine, ids: list[int], ctx: int, stride: int, keep_top: bool = False,
               reference: Scores | None = None, progress: Callable[[int, int], None] | None = None) -> Scores:
    """Score `ids` window by window. keep_top: keep the top tokens (to save as a reference);
    reference: compute KL and top-1 agreement against it (same tokens, ctx and stride)."""
    if ctx > engine.max_context:
        raise ColibriError(f"--ctx {ctx} is longer than the context this engine holds ({engine.max_context}); "
                           "lower --ctx or raise --max-context")
    plan = windows(len(ids), ctx, stride)
    targets, lps, tops, top_lps, kls, agree = [], [], [], [], [], []
    t0 = time.perf_counter()
    done = 0
    for begin, end, first in plan:
        window = ids[begin:end]
        for a, rows in engine.logit_rows(window):
            # row r is position begin + a + r; it predicts the token after it
            lo = max(first - 1 - begin - a, 0)
            hi = min(rows.shape[0], end - 1 - begin - a)
            if lo >= hi:
                continue
            for b in range(lo, hi, 32):  # a few rows at a time: float64 log-softmax over the vocabulary
                z = rows[b:min(b + 32, hi)].astype(np.float64)
                z -= z.max(axis=1, keepdims=True)
                z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
                tgt = np.asarray(window[a + b + 1: a + b + 1 + z.shape[0]], dtype=np.int64)
                targets.append(tgt)
                lps.append(z[np.arange(z.shape[0]), tgt])
                if keep_top:
                    best = np.argpartition(-z, TOP_SAVED - 1, axis=1)[:, :TOP_SAVED]
                    order = np.argsort(-np.take_along_axis(z, best, axis=1), axis=1, kind="stable")
                    best = np.take_along_axis(best, order, axis=1)
                    tops.append(best.astype(np.int32))
                    top_lps.append(np.take_along_axis(z, best, axis=1).astype(np.float32))
                if reference is not None:
                    k0 = sum(x.size for x in kls)
                    kl, same = _kl_rows(z, reference.top_ids[k0:k0 + z.shape[0]],
                                        reference.top_logprobs[k0:k0 + z.shape[0]])
                    kls.append(kl)
                    agree.append(same)
        done += 1
        if progress is not None:
            progress(done, len(plan))
    cat = np.concatenate
    return Scores(cat(targets), cat(lps), cat(tops) if keep_top else None, cat(top_lps) if keep_top else None,
                  cat(kls) if reference is not None else None, cat(agree) if reference is not None else None,
                  time.perf_counter() - t0, {"ctx": ctx, "stride": stride, "windows": len(plan)})


def _kl_rows(z: np.ndarray, ref_ids: np.ndarray, ref_lp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """KL(reference || run) over the reference's top tokens plus a bucket for the rest, and
    whether the run's most likely token is the reference's. z: the run's log-softmax rows."""
    p_lp = ref_lp.astype(np.float64)
    q_lp = np.take_along_axis(z, ref_ids.astype(np.int64), axis=1)
    p_rest = np.clip(1.0 - np.exp(p_lp).sum(axis=1), 0.0, 1.0)
    q_rest = np.clip(1.0 - np.exp(q_lp).sum(axis=1), 1e-300, 1.0)
    kl = (np.exp(p_lp) * (p_lp - q_lp)).sum(axis=1)
    tail = p_rest > 1e-12
    kl[tail] += p_rest[tail] * (np.log(p_rest[tail]) - np.log(q_rest[tail]))
    return np.maximum(kl, 0.0), z.argmax(axis=1) == ref_ids[:, 0]


# ---------------------------------------------------------------------------------- files
def read_text(path: Path) -> str:
    """A UTF-8 text file, or a clear error for a missing, empty or binary one."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ColibriError(f"cannot read {path}: {e.strerror}") from None
    if b"\x00" in data[:65536]:
        raise ColibriError(f"{path} is a binary file; perplexity needs text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ColibriError(f"{path} is not UTF-8 text (byte {e.start}); perplexity needs text") from None
    if not text.strip():
        raise ColibriError(f"{path} is empty")
    return text


def tokens_digest(ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def save_reference(path: Path, scores: Scores, ids: list[int], model_id: str) -> None:
    np.savez_compressed(path, version=REFERENCE_VERSION, tokens=tokens_digest(ids), model=model_id,
                        ctx=scores.config["ctx"], stride=scores.config["stride"], targets=scores.targets.astype(np.int32),
                        logprobs=scores.logprobs, top_ids=scores.top_ids, top_logprobs=scores.top_logprobs)


def load_reference(path: Path, ids: list[int], ctx: int, stride: int) -> Scores:
    """A reference saved by save_reference, checked to be for these tokens, ctx and stride."""
    try:
        with np.load(path, allow_pickle=False) as f:
            ref = {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ColibriError(f"{path} is not a reference saved by `colibri perplexity --save-logits` ({e})") from None
    if int(ref.get("version", -1)) != REFERENCE_VERSION or "top_ids" not in ref:
        raise ColibriError(f"{path} is not a reference saved by this colibri's `perplexity --save-logits`")
    if str(ref["tokens"]) != tokens_digest(ids):
        raise ColibriError(f"{path} scored other tokens (another text or tokenizer); compare runs on the same text")
    if (int(ref["ctx"]), int(ref["stride"])) != (ctx, stride):
        raise ColibriError(f"{path} was made with --ctx {int(ref['ctx'])} --stride {int(ref['stride'])}; "
                           "use the same values")
    return Scores(ref["targets"], ref["logprobs"], ref["top_ids"], ref["top_logprobs"],
                  config={"reference_model": str(ref["model"])})
