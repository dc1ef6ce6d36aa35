"""Live telemetry for the dashboard (colibri/serve/web/) and for scripts: where the model's bytes
are (the tier bar), which experts are hot, cached, pinned or being read (the expert brain), decode
and disk-read rates over the last minutes, queue and KV slots.

    GET /v1/telemetry          one snapshot, JSON
    GET /v1/telemetry/stream   the same snapshot once a second, as server-sent events

Everything is read from counters the engine, the expert store and the scheduler keep anyway: an
idle dashboard costs nothing, an open one a snapshot a second on the server's event loop, and
the decode path pays nothing for either. Rates come from differences of cumulative counters
between samples, so a sample missed (nobody watching) only widens the next interval.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque

import anyio
from fastapi import APIRouter, Request
from starlette.responses import StreamingResponse

from colibri.io.expert_store import EXPERT_PLACES
from colibri.serve.state import ServerState, sse

router = APIRouter()

HISTORY_S = 300      # the rate charts' window
STREAM_PERIOD_S = 1.0


class Telemetry:
    def __init__(self, state: ServerState, history_s: int = HISTORY_S):
        self.state = state
        self.started = time.time()
        # (unix time, tokens streamed, expert bytes read): cumulative counters, one sample a second at most
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=history_s)

    # ------------------------------------------------------------------ rates
    def _sample(self) -> None:
        now = time.time()
        if self._samples and now - self._samples[-1][0] < 0.5:
            return  # several pages open: one sample serves them all
        stats = self.state.engine.expert_stats or {}
        self._samples.append((now, self.state.scheduler.stats.tokens_streamed, int(stats.get("bytes_read", 0))))

    def rates(self) -> dict:
        """Per interval between samples: decode tok/s and expert read MB/s (all streams together)."""
        s = list(self._samples)
        series = [[round(b[0], 3), round((b[1] - a[1]) / (b[0] - a[0]), 2),
                   round((b[2] - a[2]) / (b[0] - a[0]) / 1e6, 2)] for a, b in zip(s, s[1:]) if b[0] > a[0]]
        last = series[-1] if series else [time.time(), 0.0, 0.0]
        return {"fields": ["time", "tok_s", "read_mb_s"], "series": series, "tok_s": last[1], "read_mb_s": last[2]}

    # ------------------------------------------------------------------ the snapshot
    def snapshot(self, experts: bool = True) -> dict:
        """Everything the dashboard shows; `experts=False` leaves out the heat map (the one
        large part: layers x experts counts)."""
        self._sample()
        engine, scheduler = self.state.engine, self.state.scheduler
        s = scheduler.stats
        busy = scheduler.busy_slots
        out = {
            "time": time.time(), "uptime_s": round(time.time() - self.started, 1),
            "model": {"id": self.state.model_id, "type": engine.model_type, "max_context": engine.max_context,
                      "activations": engine.config.activations,
                      "kv_cache": engine.config.kv_cache, "max_tokens": self.state.config.max_tokens},
            "tiers": tiers(engine),
            "rates": self.rates(),
            "scheduler": {
                "queued": scheduler.queued, "running": scheduler.running, "max_queue": scheduler.max_queue,
                "max_batch": scheduler.max_batch, "draining": scheduler.draining,
                "completed": s.completed, "cancelled": s.cancelled, "failed": s.failed, "rejected": s.rejected,
                "prompt_tokens": s.prompt_tokens, "prompt_tokens_reused": s.prompt_tokens_reused,
                "completion_tokens": s.completion_tokens, "tokens_streamed": s.tokens_streamed,
                "slots": [{"tokens": len(slot.ids), "busy": i in busy, **recurrent_state(slot.cache)}
                          for i, slot in enumerate(engine.slots)],
            },
            "experts": expert_cache(engine, with_map=experts),
        }
        return out


def recurrent_state(cache) -> dict:
    """A hybrid model's slot: the bytes its recurrent state and kept snapshots take, and the
    positions a next prompt can resume from (models/recurrent.py); nothing for a KV cache."""
    if not hasattr(cache, "snapshots"):
        return {}
    kept = sorted(cache.snapshots)
    return {"state_bytes": cache.state_bytes * (1 + len(kept)), "resumable_at": kept}


def tiers(engine) -> list[dict]:
    """Bytes of dense weights and of routed experts in each tier, against each tier's budget.
    The VRAM tier holds nothing while colibri computes on the CPU; the dashboard draws it empty
    rather than hiding it, so a GPU machine's user sees the tier unused."""
    container, experts = engine.container, engine.experts
    dense, expert_total = container.dense_bytes, container.expert_bytes
    # ExpertStore / ResidentExperts: this process's RAM; ClusterExperts: its workers' (the same
    # machine's RAM with --cluster local).
    in_ram = int(getattr(experts, "bytes_resident", 0) or 0)
    budget = int(getattr(experts, "bytes_budget", in_ram) or 0)
    on_device = getattr(engine.model, "device_bytes", None)  # --device cuda: colibri/placement/cuda_model.py
    if on_device is None:
        vram = {"tier": "vram", "dense_bytes": 0, "expert_bytes": 0, "budget_bytes": 0, "note": "not used: CPU compute"}
    else:
        tier = getattr(engine.model, "vram", None)  # the routed experts' VRAM tier (MoE models)
        held = tier.bytes_resident if tier is not None else 0
        vram = {"tier": "vram", "dense_bytes": on_device, "expert_bytes": held,
                "budget_bytes": on_device + (tier.budget_bytes if tier is not None else 0)}
    return [
        vram,
        {"tier": "ram", "dense_bytes": dense, "expert_bytes": min(in_ram, expert_total) if expert_total else 0,
         "budget_bytes": dense + budget},
        {"tier": "disk", "dense_bytes": dense, "expert_bytes": expert_total, "budget_bytes": dense + expert_total},
    ]


def expert_cache(engine, with_map: bool = True) -> dict | None:
    """Hit counts, and per MoE layer its routing counts and each expert's place (one character
    per expert, see `places`); None for a dense model."""
    experts = engine.experts
    heat_map = getattr(experts, "heat_map", None)
    if heat_map is None or not engine.container.expert_layouts:
        return None
    stats = engine.expert_stats
    if stats is None:  # every expert resident: every lookup is a hit
        stats = {"hits": None, "misses": 0, "hit_rate": 1.0, "bytes_read": 0, "reads": 0, "wait_s": 0.0}
    out = {"places": EXPERT_PLACES, **{k: stats.get(k) for k in ("hits", "misses", "hit_rate", "bytes_read",
                                                                   "reads", "wait_s")}}
    if out["hits"] is not None and out["hits"] + out["misses"] == 0:
        out["hit_rate"] = None  # nothing asked yet: no rate to show
    if with_map:
        layers = heat_map()
        out["layers"] = [{"prefix": p, "counts": counts, "places": places} for p, (counts, places) in layers.items()]
        out["reading"] = sum(places.count("r") for _, places in layers.values())
    return out


def telemetry_of(request: Request) -> Telemetry:
    state: ServerState = request.app.state.colibri
    t = getattr(request.app.state, "telemetry", None)
    if t is None:
        t = request.app.state.telemetry = Telemetry(state)
    return t


@router.get("/v1/telemetry")
async def telemetry(request: Request, experts: bool = True):
    # In a thread: with --cluster the heat map and the store figures are remote calls to the
    # expert workers, which must not hold up the event loop.
    return await anyio.to_thread.run_sync(lambda: telemetry_of(request).snapshot(experts=experts))


@router.get("/v1/telemetry/stream")
async def telemetry_stream(request: Request, period: float = STREAM_PERIOD_S):
    """One `telemetry` event a period (0.25-10 s) until the client leaves or the server drains."""
    t = telemetry_of(request)
    period = min(10.0, max(0.25, period))
    scheduler = t.state.scheduler

    async def frames():
        # A client that leaves is noticed at the next send (Starlette then ends this generator),
        # so an abandoned page holds nothing for longer than one period.
        while not scheduler.draining:
            yield sse(await anyio.to_thread.run_sync(t.snapshot), event="telemetry")
            await asyncio.sleep(period)

    return StreamingResponse(frames(), media_type="text/event-stream", headers={"cache-control": "no-cache"})
