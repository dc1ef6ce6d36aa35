"""Speculative decoding: guess the next few tokens cheaply, check them all in one pass.

A drafter proposes K tokens to follow the one just sampled; DecoderModel.forward_rows runs the
sampled token and the K drafts as consecutive positions of the sequence in one layer-by-layer
pass, which reads each layer's weights (and each routed expert) once for all K + 1 rows
instead of once per token. Each row's logits are the same bits as decoding that token alone,
so the engine samples exactly as without drafts: while a sampled token equals the next draft,
the draft's row already holds the logits for the position after it, and the pass paid for
that token; at the first difference the remaining drafts are dropped (the cache is cut back to
the tokens kept) and decoding goes on from the sampled token.

Because the logits are identical and the sampler draws from its generator exactly once per
token either way, the output is identical to plain decoding for greedy and for sampled
generation with a seed. (That also makes it a valid speculative sampler: accepting a drafted
token d exactly when the target distribution's own sample equals d accepts with probability
p(d), which is the standard rejection rule for a drafter that proposes one token for certain,
and a rejected position keeps the target's sample.)

Drafters: prompt lookup ("ngram": the tokens that followed the latest earlier occurrence of the
context's last n tokens, n = 3 or 2; it pays on text that repeats or edits what the prompt
holds: code refactors, reformatting, quoting) and the model's own multi-token-prediction layer
("mtp": DeepSeek-V3, GLM-4.5, Qwen3-Next, Qwen3.5 / 3.6 MoE; MTPDrafter). Modes: "off", "ngram"
and "mtp" (draft K whenever the drafter has something) and "auto" (MTP where the model has it,
else lookup, with as many drafts as the measured costs and acceptance say pay, none when nothing
does; see Speculator).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from colibri.errors import ColibriError

MODES = ("off", "ngram", "mtp", "auto")
DEFAULT_DRAFT_TOKENS = 6
MAX_DRAFT_TOKENS = 32


def check_mode(mode: str, draft_tokens: int) -> None:
    if mode not in MODES:
        raise ColibriError(f"speculative must be one of {', '.join(MODES)}, not {mode!r}")
    if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise ColibriError(f"draft tokens must be between 1 and {MAX_DRAFT_TOKENS}, not {draft_tokens}")


class NgramDrafter:
    """Prompt lookup over the sequence so far (prompt and output), kept as a growing array so
    a lookup is a few vectorized comparisons, not a Python scan."""

    def __init__(self, tokens: list[int], max_ngram: int = 3, min_ngram: int = 2):
        # A match of one token (a newline, " the") says little about what follows: drafting on
        # it cost more passes than it won (SmolLM2, bench/engine/speculative.py's prompts replayed
        # offline at 0.4 of a step per extra row: copying a code block 1.53x -> 1.70x, a
        # free-form story 0.55x -> 0.80x with always 6 drafts).
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._buf = np.zeros(max(64, 2 * len(tokens)), np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        need = self.n + len(tokens)
        if need > self._buf.shape[0]:
            grown = np.zeros(2 * need, np.int64)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n : need] = tokens
        self.n = need

    def draft(self, committed: int, k: int) -> list[int]:
        """The drafters' common step: up to k drafts after position `committed`."""
        return self.propose(k) if k > 0 else []

    def observed(self, first: int, hidden: np.ndarray) -> None:
        """A pass ran (the lookup needs nothing from it)."""

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last n tokens
        (longest n first, n >= min_ngram); [] when nothing matches."""
        seq = self._buf[: self.n]
        for n in range(min(self.max_ngram, self.n - 1), self.min_ngram - 1, -1):
            tail = seq[self.n - n :]
            # starts i (i + n < self.n, so the match is not the tail itself and has a follower)
            hit = seq[: self.n - n] == tail[0]
            for j in range(1, n):  # a match may overlap the tail ("7 7" in "7 7 7")
                hit &= seq[j : self.n - n + j] == tail[j]
            starts = np.flatnonzero(hit)
            if starts.size:
                follow = int(starts[-1]) + n
                return seq[follow : follow + k].tolist()
        return []


class MTPDrafter:
    """Drafts from the model's MTP layer (models/mtp.py): the row at position c - 1 (the main
    model's hidden state there and the token just sampled at c) predicts the token at c + 1;
    each further draft feeds the previous row's output and draft back in.

    The MTP layer keeps its own one-layer cache, filled with "true" rows only: row p from the
    main model's hidden state at p, which the pass that computed position p hands to observed()
    (every step of a speculating generation goes through forward_rows, alone or batched). Rows
    past the last true one are drafting scratch, cut off after each proposal. The cache covers
    the positions since this drafter started (the prompt's hidden states are not kept); where
    a hidden state is missing it starts again."""

    KEEP = 256  # hidden states held before they are fed to the cache anyway (memory stays bounded)

    def __init__(self, model, context: list[int], max_tokens: int):
        self.model, self.head = model, model.mtp
        self.seq = list(context)   # every token so far: the prompt, then each one sampled
        self.hidden: dict[int, np.ndarray] = {}  # position -> the main model's hidden state there
        self.cache = self.head.new_cache(max_tokens)
        self.start = 0             # position of the cache's first row
        self.next = None           # position of the first row not yet in the cache (None: empty)

    def extend(self, tokens: list[int]) -> None:
        self.seq.extend(tokens)

    def observed(self, first: int, hidden: np.ndarray) -> None:
        """forward_rows just ran rows from position `first`, with these final hidden states
        [rows, D]: keep them (those of drafts that are not taken are dropped at the next
        proposal)."""
        for r in range(hidden.shape[0]):
            self.hidden[first + r] = np.array(hidden[r])
        # A long run of plain steps: feed the rows whose next token is known (before `first`).
        if len(self.hidden) > self.KEEP and first - 1 in self.hidden:
            self._feed(first)

    def draft(self, committed: int, k: int) -> list[int]:
        return self.propose(committed, k)

    def propose(self, committed: int, k: int) -> list[int]:
        """Up to k drafts for the positions after `committed` (the position of the token just
        sampled, seq[committed]); [] without the main model's hidden state at committed - 1."""
        c = committed
        for p in [p for p in self.hidden if p >= c]:  # rows of drafts that were not taken
            del self.hidden[p]
        if k < 1 or c - 1 not in self.hidden:
            return []
        logits, x = self._feed(c)
        drafts = [int(np.argmax(logits))]
        h = x[-1:]
        for i in range(1, k):
            p = c + i - 1
            logits, h = self.head(h, [drafts[-1]], np.array([p]), self.cache, p - self.start)
            drafts.append(int(np.argmax(logits)))
        self.cache.truncate(c - self.start)
        return drafts

    def _feed(self, upto: int):
        """Rows next .. upto - 1 into the cache (restarting it at the longest run of known
        states ending at upto - 1 when one is missing); the last row's (logits, outputs)."""
        if self.next is None or any(p not in self.hidden for p in range(self.next, upto)):
            first = upto - 1
            while first - 1 in self.hidden:
                first -= 1
            self.start, self.next = first, first
            self.cache.truncate(0)
        todo = list(range(self.next, upto))
        out = self.head(np.stack([self.hidden[p] for p in todo]), [self.seq[p + 1] for p in todo],
                        np.asarray(todo), self.cache, self.next - self.start)
        for p in todo:
            del self.hidden[p]
        self.next = upto
        return out


@dataclass
class SpecStats:
    passes: int = 0     # multi-row passes run
    drafted: int = 0    # draft tokens checked
    accepted: int = 0   # draft tokens that became output

    def as_dict(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"passes": self.passes, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(rate, 4)}


class Speculator:
    """The logits for each next position of one generation, from drafted passes where they pay.
    step() replaces the plain pass in the token loop (generate.decode_one_token); the cache's positions past the
    committed tokens may hold drafts, which step() keeps or cuts back.

    `auto` decides before every step from what it has measured in this generation: t1, the
    seconds of a plain step; r, what one more row adds to a pass, as a share of t1; a, the chance
    that a draft is accepted given the one before it was (accepted / (accepted + rejections)).
    K drafts then yield 1 + a + a^2 + ... + a^K tokens for (1 + r K) t1 seconds; it drafts the K
    that maximizes tokens per second, and not at all when no K beats a plain step; then it
    still drafts one token (K = 1) every PROBE_EVERY steps, so text that starts repeating, and
    raises a, is noticed."""

    PROBE_EVERY = 16
    ROW_COST_PRIOR = 0.4

    def __init__(self, drafted_rows, context: list[int], mode: str, draft_tokens: int, mtp: MTPDrafter | None = None):
        # (tok, cache, draft) -> (drafts, logits rows, hidden states): draft() is called, then
        # [tok, *drafts] run in one forward_rows pass (generate.Passes.drafted_rows; when batching, both
        # on the batcher's thread, the pass shared with other generations' rows)
        self.drafted_rows = drafted_rows
        self.mode = mode
        self.k = draft_tokens
        # "mtp" (and "auto" on a model with an MTP layer) draft from it, else by prompt lookup
        self.drafter = mtp if mtp is not None else NgramDrafter(context)
        self.stats = SpecStats()
        self._ahead: list[tuple[int, np.ndarray]] = []  # (draft token, logits after it)
        self._rejections = 0      # passes that ended at a draft the sampler did not take
        self._plain = [0.0, 0]    # seconds, count of plain steps
        self._extra = [0.0, 0]    # seconds over a plain step, rows beyond the first, of drafted passes
        self._since_probe = 0

    def step(self, cache, committed: int, tok: int, room: int) -> np.ndarray:
        """Logits for the position after `tok`, the token just sampled, which follows the
        `committed` tokens the cache holds for certain. `room`: how many more tokens the
        generation may still emit after tok (drafts beyond it would be wasted)."""
        self.drafter.extend([tok])
        if self._ahead:
            draft, row = self._ahead.pop(0)
            if draft == tok:
                self.stats.accepted += 1
                return row
            self._ahead.clear()
            self._rejections += 1
            cache.truncate(committed)
        k = min(self._draft_count(), room, cache.max_tokens - committed - 1)
        t0 = time.perf_counter()  # drafting counts in a pass's cost (an MTP draft is a layer and a head)
        draft, rows, hidden = self.drafted_rows(tok, cache, lambda: self.drafter.draft(committed, k))
        seconds = time.perf_counter() - t0
        self.drafter.observed(committed, hidden)
        if not draft:
            self._plain[0] += seconds
            self._plain[1] += 1
            return rows[0]
        if self._plain[1]:
            self._extra[0] += seconds - self._plain[0] / self._plain[1]
            self._extra[1] += len(draft)
        self.stats.passes += 1
        self.stats.drafted += len(draft)
        self._ahead = list(zip(draft, rows[1:]))
        return rows[0]

    def finish(self, cache, committed: int) -> None:
        """The generation ended: drop drafts the cache still holds past `committed`."""
        self._ahead.clear()
        cache.truncate(committed)

    def _draft_count(self) -> int:
        """How many tokens to draft for the next step (0: a plain step)."""
        if self.mode in ("ngram", "mtp"):
            return self.k
        if self._plain[1] < 2:  # auto: first the cost of a plain step
            return 0
        t1 = self._plain[0] / self._plain[1]
        # Before a drafted pass has been timed: the extra-row cost the multi-row kernels measure
        # (0.30-0.45 of a step, docs/benchmarks.md: Speculative decoding). 0.5 made a first draft never pay at the prior a = 1/2,
        # so copying text waited for a probe (replayed offline: 1.34x -> 1.67x on a list copy).
        r = max(self._extra[0], 0.0) / self._extra[1] / t1 if self._extra[1] else self.ROW_COST_PRIOR
        accepted, rejected = self.stats.accepted, self._rejections
        a = (accepted + 1.0) / (accepted + rejected + 2.0)  # a uniform prior: 1/2 before any evidence
        best_k, best_rate, tokens = 0, 1.0, 1.0
        for k in range(1, self.k + 1):
            tokens += a ** k
            rate = tokens / (1.0 + r * k)  # tokens per plain-step time
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k:
            self._since_probe = 0
            return best_k
        self._since_probe += 1
        if self._since_probe >= self.PROBE_EVERY:
            self._since_probe = 0
            return 1
        return 0
