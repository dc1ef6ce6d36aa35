"""One turn's profile: where its time went (attention, dense MLP, routing, routed experts, disk
wait, head), what the expert cache and each drive did, how well the next layer's experts were
predicted and how spread the routing was, per layer. The seeds' server sends the same per turn
(its PERF and ENTROPY lines, as a `colibri` SSE event and response field).

Every figure is the difference of two readings of cumulative counters (the expert source's
stats, drive and prediction counters, routing counts, the PHASES clock), taken at the turn's
start and end, so a profile costs a few dict copies per turn and nothing per token. Those
counters belong to the process, not to one turn: turns that ran at the same time (batching)
share them, which `overlapping_turns` says.
"""
from __future__ import annotations

import itertools
import logging
import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from colibri.engine.stats import store_stats
from colibri.profile import PHASES, breakdown

log = logging.getLogger("colibri.engine")

PROFILES_KEPT = 120  # the last turns GET /v1/profile serves
PHASE_KEYS = ("attention", "dense_mlp", "routing", "routed_experts", "disk_wait", "head", "other")
DRIVE_COUNTERS = ("bytes_read", "reads", "read_s", "errors")


# ------------------------------------------------------------------------------ readings
@dataclass
class Reading:
    """Cumulative counters at one moment; None where the source keeps no such counter."""

    store: dict | None = None        # engine.stats.store_stats: hits, misses, bytes, wait, VRAM tier...
    drives: dict | None = None       # experts.drive_stats(): {drive dir: {bytes_read, reads, read_s, errors, weight}}
    prediction: dict | None = None   # experts.prediction_by_layer(): {prefix: {predicted, used, needed}}
    routing: dict | None = None      # experts.routing_counts(): {prefix: [count per expert]}
    phases: dict | None = None       # PHASES.seconds: {(phase, layer): s}
    cluster: dict | None = None      # experts.hop_counters(): the --cluster hop's seconds and faults


def read_counters(experts, vram=None, phases: bool = False) -> Reading:
    """One reading of what `experts` (an expert source, or None for a dense model) and the
    VRAM tier above it count; `phases`: the phase clock's seconds too."""
    def call(name):
        method = getattr(experts, name, None)
        return method() if method is not None else None

    return Reading(store=store_stats(experts, vram), drives=call("drive_stats"),
                   prediction=call("prediction_by_layer"), routing=call("routing_counts"),
                   cluster=call("hop_counters"),
                   # one C-level copy: the compute thread adds to it meanwhile (batching)
                   phases=dict(PHASES.seconds) if phases else None)


# ------------------------------------------------------------------------------ the maths
def entropy_bits(counts) -> float | None:
    """H = -sum p log2 p of the selection shares in `counts` (one layer's count per expert);
    None when nothing was selected. 0 when one expert took every selection, log2(E) when all
    E were taken equally."""
    total = sum(counts)
    if total <= 0:
        return None
    return max(0.0, -sum(c / total * math.log2(c / total) for c in counts if c > 0))


def count_diff(before: dict[str, list[int]] | None, after: dict[str, list[int]] | None) -> dict[str, list[int]]:
    """Per layer, the counts added between two routing_counts readings (a layer that is new
    since `before` counts from zero)."""
    if after is None:
        return {}
    before = before or {}
    out = {}
    for prefix, now in after.items():
        then = before.get(prefix) or [0] * len(now)
        if len(then) != len(now):  # (a reset between the readings) only what is there now
            then = [0] * len(now)
        out[prefix] = [max(0, a - b) for a, b in zip(now, then)]
    return out


def layer_number(prefix: str, fallback: int) -> int:
    """"model.layers.7.mlp" -> 7; `fallback` for a name without one."""
    m = re.search(r"layers\.(\d+)", prefix)
    return int(m.group(1)) if m else fallback


def _layer_order(prefixes) -> list[str]:
    return sorted(prefixes, key=lambda p: (layer_number(p, 1 << 30), p))


def routing_entropy(before: dict | None, after: dict | None) -> dict | None:
    """Per MoE layer (in layer order), the entropy in bits of the turn's expert selections, and
    log2(E), its most; None when the source counts no routing."""
    if after is None:
        return None
    diff = count_diff(before, after)
    order = _layer_order(diff)
    widths = [len(diff[p]) for p in order]
    return {"layers": [layer_number(p, i) for i, p in enumerate(order)],
            "entropy_bits": [_round(entropy_bits(diff[p]), 4) for p in order],
            "max_bits": _round(math.log2(max(widths)), 4) if widths and max(widths) > 0 else None}


def _rate(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def cache_tiers(before: dict | None, after: dict | None) -> dict | None:
    """The turn's expert-cache figures per tier: RAM (the store) and, when there is one, VRAM
    above it; hit_rate None when no expert was asked for."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses", "prefetch_hits", "bytes_read", "reads")}
    out = {"ram": {"hits": d["hits"], "misses": d["misses"], "prefetch_hits": d["prefetch_hits"],
                   "hit_rate": _rate(d["hits"], d["hits"] + d["misses"])},
           "bytes_read": d["bytes_read"], "reads": d["reads"]}
    if "vram_hits" in after:
        hits = after["vram_hits"] - before.get("vram_hits", 0)
        misses = after["vram_misses"] - before.get("vram_misses", 0)
        out["vram"] = {"hits": hits, "misses": misses, "hit_rate": _rate(hits, hits + misses),
                       "bytes_uploaded": after.get("vram_bytes_uploaded", 0) - before.get("vram_bytes_uploaded", 0)}
    return out


def drive_use(before: dict | None, after: dict | None) -> dict | None:
    """Per drive (its directory), what the turn read from it: bytes, reads, seconds, errors."""
    if after is None:
        return None
    before = before or {}
    out = {}
    for drive, now in after.items():
        then = before.get(drive, {})
        d = {k: now.get(k, 0) - then.get(k, 0) for k in DRIVE_COUNTERS if k in now}
        if "read_s" in d:
            d["read_s"] = _round(d["read_s"], 6)
        out[str(drive)] = d
    return out


def prediction(before: dict | None, after: dict | None, layers_before: dict | None,
               layers_after: dict | None) -> dict | None:
    """How well the experts guessed for a layer before it ran matched the ones it used:
    precision = used / predicted, recall = used / needed, over the turn, and per layer when
    the source counts per layer. None where the source predicts nothing."""
    out = None
    if after is not None and "predicted" in after:
        before = before or {}
        predicted, used, needed = (after.get(k, 0) - before.get(k, 0)
                                   for k in ("predicted", "predicted_used", "needed"))
        out = {"predicted": predicted, "used": used, "needed": needed,
               "precision": _rate(used, predicted), "recall": _rate(used, needed)}
    if layers_after:
        layers_before = layers_before or {}
        order = _layer_order(layers_after)
        per = {"layers": [layer_number(p, i) for i, p in enumerate(order)], "precision": [], "recall": []}
        for p in order:
            now, then = layers_after[p], layers_before.get(p, {})
            predicted, used, needed = (now.get(k, 0) - then.get(k, 0) for k in ("predicted", "used", "needed"))
            per["precision"].append(_rate(used, predicted))
            per["recall"].append(_rate(used, needed))
        if any(x is not None for x in per["precision"] + per["recall"]):  # (nothing guessed: no rows of nulls)
            out = {**(out or {}), "per_layer": per}
    return out


def cluster_hop(before: dict | None, after: dict | None) -> dict | None:
    """Where a cluster MoE layer's time went over the span (colibri/cluster/head.py Transport),
    ms per layer, and the worker faults in it; None without a cluster or with no layer."""
    if before is None or after is None:
        return None
    layers = after["layers"] - before["layers"]
    if layers <= 0:
        return None
    out = {"layers": layers, "worker_faults": after["faults"] - before["faults"]}
    for key in ("wall", "compute", "transport", "network", "worker_io", "local", "overlap"):
        out[f"{key}_ms_per_layer"] = round(1e3 * (after[f"{key}_s"] - before[f"{key}_s"]) / layers, 4)
    return out


def phase_diff(before: dict | None, after: dict | None) -> dict:
    """The phase clock's seconds added between two readings, by (phase, layer)."""
    before = before or {}
    return {k: s - before.get(k, 0.0) for k, s in (after or {}).items() if s - before.get(k, 0.0) > 0}


def phase_split(seconds: dict, covered_s: float, disk_wait_s: float, layer_kinds: list[str]) -> dict:
    """Seconds by phase (PHASE_KEYS) in a span of `covered_s` seconds, from the phase clock's
    seconds in it: `colibri bench`'s breakdown for one "token" that is the whole span; `other`
    is what no phase timed (glue, sampling, waiting for a batched step)."""
    split = breakdown(seconds, covered_s, 1, disk_wait_s, layer_kinds)["per_token_s"]
    return {k: _round(split[k], 6) for k in PHASE_KEYS}


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


# ------------------------------------------------------------------------------ the profile
@dataclass
class TurnProfile:
    """What `Generation.profile` and the server's `colibri` field hold (as_dict)."""

    turn: int                           # this engine's turn number, from 1
    prompt_tokens: int
    reused_tokens: int                  # served from the KV cache, not prefilled
    completion_tokens: int
    prefill_s: float
    decode_s: float
    finish_reason: str = ""
    slot: int = 0
    time: float = field(default_factory=time.time)  # unix time at the turn's end
    disk_wait_s: float | None = None    # the compute thread blocked on expert reads (None: nothing streams)
    phases: dict | None = None          # seconds by PHASE_KEYS; None when the phase clock was off
    overlapping_turns: int = 0          # other turns that ran meanwhile, sharing every counter below
    cache: dict | None = None           # cache_tiers
    drives: dict | None = None          # drive_use
    prediction: dict | None = None      # prediction
    repins: int | None = None           # hot-set swaps during the turn
    routing: dict | None = None         # routing_entropy
    cluster: dict | None = None         # cluster_hop

    @property
    def decode_tok_s(self) -> float:
        # A turn's first token comes out of its prefill; a span with none (bench's forced
        # tokens) decoded every one.
        n = self.completion_tokens - 1 if self.prefill_s > 0 else self.completion_tokens
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    def as_dict(self) -> dict:
        """Plain JSON types, per-layer figures as lists (layer order), nothing per expert."""
        return {
            "turn": self.turn, "time": round(self.time, 3), "slot": self.slot, "finish_reason": self.finish_reason,
            "tokens": {"prompt": self.prompt_tokens, "reused": self.reused_tokens,
                       "completion": self.completion_tokens},
            "seconds": {"prefill": round(self.prefill_s, 6), "decode": round(self.decode_s, 6),
                        "total": round(self.prefill_s + self.decode_s, 6),
                        "disk_wait": _round(self.disk_wait_s, 6)},
            "tok_s": {"prefill": round(self.prefill_tok_s, 3), "decode": round(self.decode_tok_s, 3)},
            "phases": self.phases, "overlapping_turns": self.overlapping_turns,
            "cache": self.cache, "drives": self.drives, "prediction": self.prediction, "repins": self.repins,
            "routing": self.routing, "cluster": self.cluster,
        }


def profile_between(start: Reading, end: Reading, *, turn: int, prompt_tokens: int, reused_tokens: int,
                    completion_tokens: int, prefill_s: float, decode_s: float, phase_seconds: dict | None = None,
                    phase_span_s: float = 0.0, layer_kinds: list[str] = (), **extra) -> TurnProfile:
    """The profile of the span between two readings. `phase_seconds`: the phase clock's
    seconds in it (None: the clock was off), over `phase_span_s` seconds of wall time."""
    s0, s1 = start.store, end.store
    wait = s1["wait_s"] - s0["wait_s"] if s0 is not None and s1 is not None else None
    repins = s1["repins"] - s0.get("repins", 0) if s0 is not None and s1 is not None and "repins" in s1 else None
    phases = None
    if phase_seconds is not None:
        phases = phase_split(phase_seconds, phase_span_s, wait or 0.0, list(layer_kinds))
    return TurnProfile(turn=turn, prompt_tokens=prompt_tokens, reused_tokens=reused_tokens,
                       completion_tokens=completion_tokens, prefill_s=prefill_s, decode_s=decode_s,
                       disk_wait_s=wait, phases=phases,
                       cache=cache_tiers(s0, s1), drives=drive_use(start.drives, end.drives),
                       prediction=prediction(s0, s1, start.prediction, end.prediction), repins=repins,
                       routing=routing_entropy(start.routing, end.routing),
                       cluster=cluster_hop(start.cluster, end.cluster), **extra)


# ------------------------------------------------------------------------------ an engine's recorder
class TurnRecorder:
    """An engine's side of profiling: the readings around each turn, the phase clock while
    turns that want it run, and the last PROFILES_KEPT profiles (oldest first).

    PHASES is one clock for the process: it runs while at least one profiled turn runs and
    is never cleared here (each turn diffs its own readings), so `colibri bench`'s own
    start/stop around it keeps working. Turns running at once (batching) each see all their
    phases; `overlapping_turns` says so."""

    def __init__(self, experts, vram, phases: bool, layer_kinds: list[str]):
        self.experts, self.vram, self.phases, self.layer_kinds = experts, vram, phases, layer_kinds
        self._lock = threading.Lock()
        self._active: set[Recording] = set()
        self._clock_users = 0
        self._clock_owned = False  # the clock was off when the first user came (so the last turns it off)
        self._numbers = itertools.count(1)
        self._kept: deque[dict] = deque(maxlen=PROFILES_KEPT)

    def begin(self) -> "Recording":
        """A turn starts."""
        rec = Recording(self)
        with self._lock:
            for other in self._active:
                other.overlapping += 1
            rec.overlapping = len(self._active)
            self._active.add(rec)
            if self.phases:
                if self._clock_users == 0:
                    self._clock_owned = not PHASES.on
                    PHASES.on = True
                self._clock_users += 1
        try:
            rec.start = self.read()
        except BaseException:
            self.release(rec)
            raise
        return rec

    def read(self) -> Reading:
        return read_counters(self.experts, self.vram, phases=self.phases)

    def release(self, rec: "Recording") -> None:
        with self._lock:
            self._active.discard(rec)
            if self.phases:
                self._clock_users -= 1
                if self._clock_users == 0 and self._clock_owned:
                    PHASES.on = False

    def keep(self, profile: dict) -> None:
        with self._lock:
            self._kept.append(profile)

    def next_turn(self) -> int:
        return next(self._numbers)

    def profiles(self) -> list[dict]:
        with self._lock:  # (a deque copied while another thread appends would raise)
            return list(self._kept)


class Recording:
    """One turn between TurnRecorder.begin and finish."""

    def __init__(self, recorder: TurnRecorder):
        self.recorder = recorder
        self.overlapping = 0
        self.start: Reading | None = None
        self.end: Reading | None = None

    def finish(self) -> None:
        """The turn's end (also when it failed or its consumer left): the last reading, and the
        phase clock let go. Runs once, and never raises: the engine's cleanup comes after it."""
        if self.end is not None:
            return
        try:
            self.end = self.recorder.read()
        except Exception:  # (a cluster's worker gone mid-reading): the profile shows nothing moved
            log.warning("turn profile: the counters could not be read at the turn's end", exc_info=True)
            self.end = self.start
        finally:
            self.recorder.release(self)

    def profile(self, prompt_tokens: int, reused_tokens: int, completion_tokens: int, prefill_s: float,
                decode_s: float, finish_reason: str, slot: int) -> dict:
        """The finished turn's profile as a dict, kept for GET /v1/profile."""
        r = self.recorder
        phase_seconds = phase_diff(self.start.phases, self.end.phases) if r.phases else None
        p = profile_between(self.start, self.end, turn=r.next_turn(), prompt_tokens=prompt_tokens,
                            reused_tokens=reused_tokens, completion_tokens=completion_tokens, prefill_s=prefill_s,
                            decode_s=decode_s, phase_seconds=phase_seconds, phase_span_s=prefill_s + decode_s,
                            layer_kinds=r.layer_kinds,
                            finish_reason=finish_reason, slot=slot, overlapping_turns=self.overlapping)
        out = p.as_dict()
        r.keep(out)
        return out
