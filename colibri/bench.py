"""`colibri bench`: speed and cache figures of one model on this machine, cold then warm.

Cold: the page cache is dropped first (needs root; otherwise the row says so) and a fresh
Engine is loaded. Warm: the same engine again, its expert cache and the page cache filled.
Decode is measured on a fixed token sequence fed one token at a time (teacher forcing), so
routing is realistic even on random-weight models (BENCHMARKS.md point 7); prefill and TTFT on
a ~256-token prompt.
"""
from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import numpy as np

BENCH_VERSION = 4  # 2: per-phase decode breakdown, projection for slices; 3: the measured decode's profile;
# 4: each phase's weights read per second (breakdown gb_per_s)


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _disk_read_bytes() -> int:
    try:
        for line in open("/proc/self/io"):
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def layer_kinds(engine) -> tuple[list[str], list[str] | None]:
    """("dense"/"moe" per decoder layer of the loaded model, the same for the whole model when
    the container is a `--layers` slice of a bigger one (tools/synthetic_moe.py), else None)."""
    args = engine.model.args
    kept = [args.mlp_kind(i) for i in range(len(engine.model.layers))]
    full_n = (engine.container.config.get("colibri_synthetic") or {}).get("full_num_hidden_layers")
    if not full_n or full_n <= len(kept):
        return kept, None

    def kind(i):
        try:
            return args.mlp_kind(i)
        except IndexError:  # a per-layer list cut to the slice: the rest of the model routes
            return "moe"

    return kept, [kind(i) for i in range(full_n)]


def _measure(engine, tokens: list[int], prompt: list[int]) -> dict:
    from colibri.engine.turn_profile import profile_between, read_counters
    from colibri.profile import PHASES, breakdown, phase_bytes

    engine.reset()
    g = engine.generate(prompt, max_tokens=1, stop_at_eos=False)
    s0, r0 = engine.expert_stats, _disk_read_bytes()
    # A model decoded in one compiled call per token (DecoderModel._token_program: dense
    # layers) has no phases to time inside it: its speed is measured as it runs, then the
    # breakdown on the same tokens again, layer by layer.
    whole_token = getattr(engine.model, "_token_program", lambda: None)() is not None
    if whole_token:
        times = engine.feed(tokens)
    counters0 = read_counters(engine.experts, engine.vram_tier)
    PHASES.start()
    try:
        phase_times = engine.feed(tokens)
    finally:
        seconds = PHASES.stop()
    counters1 = read_counters(engine.experts, engine.vram_tier)
    if not whole_token:
        times = phase_times
    s1, r1 = engine.expert_stats, _disk_read_bytes()
    fed = len(times) + (len(phase_times) if whole_token else 0)  # the tokens the counters saw
    steady = times[1:] or times
    row = {"prefill_tok_s": g.prefill_tok_s, "ttft_s": g.ttft_s, "decode_tok_s": len(steady) / sum(steady),
           "disk_gb_per_token": (r1 - r0) / fed / 1e9}
    wait = 0.0
    if s0 is not None:
        asked = (s1["hits"] - s0["hits"]) + (s1["misses"] - s0["misses"])
        row["hit_rate"] = (s1["hits"] - s0["hits"]) / asked if asked else None
        row["expert_gb_per_token"] = (s1["bytes_read"] - s0["bytes_read"]) / fed / 1e9
        wait = s1["wait_s"] - s0["wait_s"]
        row["disk_wait_share"] = wait / sum(times)
        if "vram_hits" in s1:  # --device cuda: the tier above RAM
            asked = (s1["vram_hits"] - s0["vram_hits"]) + (s1["vram_misses"] - s0["vram_misses"])
            row["vram_hit_rate"] = (s1["vram_hits"] - s0["vram_hits"]) / asked if asked else None
    kept, full = layer_kinds(engine)
    row["breakdown"] = breakdown(seconds, sum(phase_times), len(phase_times), wait, kept, full,
                                 phase_bytes(engine.container))
    row["breakdown"]["path"] = "layer by layer (decoding runs every layer in one call)" if whole_token else "as decoded"
    # The timed decode as one turn, in the shape the server's `colibri` field has
    # (engine/turn_profile.py): whole seconds instead of per token, the cache per tier, bytes
    # per drive, prediction, routing entropy per layer.
    row["profile"] = profile_between(counters0, counters1, turn=0, prompt_tokens=0, reused_tokens=0,
                                     completion_tokens=len(phase_times), prefill_s=0.0, decode_s=sum(phase_times),
                                     phase_seconds=seconds, phase_span_s=sum(phase_times),
                                     layer_kinds=kept).as_dict()
    return row


def run_bench(model_dir=None, tokens: int = 32, prompt_tokens: int = 256, **engine_options) -> dict:
    from colibri.engine import Engine

    rng = np.random.default_rng(0)
    cold_ok = _drop_caches()
    t0 = time.perf_counter()
    engine = Engine.load(model_dir, max_context=prompt_tokens + 2 * tokens + 8, **engine_options)  # _measure may feed twice
    load_s = time.perf_counter() - t0
    vocab = engine.vocab_size
    seq = rng.integers(min(100, vocab - 1), vocab, size=tokens).tolist()
    prompt = rng.integers(min(100, vocab - 1), vocab, size=prompt_tokens).tolist()
    cold = _measure(engine, seq, prompt)
    warm = _measure(engine, seq, prompt)
    c = engine.container
    return {"version": BENCH_VERSION, "model": str(c.dir), "model_type": engine.model_type,
            "activations": engine.config.activations, "kv_cache": engine.config.kv_cache,
            "dense_gb": c.dense_bytes / 1e9, "expert_gb": c.expert_bytes / 1e9,
            "expert_store": type(engine.experts).__name__, "load_s": load_s,
            "cold_cache_dropped": cold_ok, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "cold": cold, "warm": warm,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def render(report: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"colibri bench: {Path(report['model']).name} ({report['model_type']}, "
                    f"dense {report['dense_gb']:.2f} GB, experts {report['expert_gb']:.2f} GB"
                    + (", int8 activations" if report.get("activations") == "int8" else "")
                    + (", f16 KV cache" if report.get("kv_cache") == "f16" else "") + ")")
    t.add_column("state")
    for col in ("decode tok/s", "prefill tok/s", "TTFT s", "hit rate", "GB read/token", "disk wait"):
        t.add_column(col, justify="right")
    for state in ("cold", "warm"):
        r = report[state]
        hit = r.get("hit_rate")
        hit = "-" if hit is None else f"{hit:.2f}"
        if r.get("vram_hit_rate") is not None:
            hit = f"VRAM {r['vram_hit_rate']:.2f}, RAM {hit}"
        wait = r.get("disk_wait_share")
        label = state if state == "warm" or report["cold_cache_dropped"] else "cold (cache not dropped: not root)"
        t.add_row(label, f"{r['decode_tok_s']:.2f}", f"{r['prefill_tok_s']:.1f}", f"{r['ttft_s']:.3f}",
                  hit, f"{r.get('expert_gb_per_token', r['disk_gb_per_token']):.3f}",
                  "-" if wait is None else f"{wait:.0%}")
    console.print(t)
    console.print(f"load {report['load_s']:.2f} s, expert store {report['expert_store']}, "
                  f"peak RSS {report['peak_rss_gb']:.2f} GB; decode on {report['tokens']} forced tokens, "
                  f"prefill on {report['prompt_tokens']}")
    b = Table(title="decode time per token (ms)")
    b.add_column("state")
    phases = list(report["warm"]["breakdown"]["per_token_s"])
    short = {"attention": "attn", "dense_mlp": "dense", "routing": "route", "routed_experts": "experts",
             "disk_wait": "disk", "head": "head", "other": "other"}
    for col in phases + ["total"]:
        b.add_column(short.get(col, col), justify="right")
    for state in ("cold", "warm"):
        bd = report[state]["breakdown"]
        b.add_row(state, *(f"{1e3 * bd['per_token_s'][p]:.1f}" for p in phases), f"{1e3 * bd['total_s']:.1f}")
    rates = report["warm"]["breakdown"].get("gb_per_s", {})
    if rates:  # each phase's weights over its time: set against the machine's read bandwidth
        b.add_row("warm GB/s", *(f"{rates[p]:.1f}" if p in rates else "" for p in phases), "")
    console.print(b)
    if report["warm"]["breakdown"].get("path", "as decoded") != "as decoded":
        console.print(f"(breakdown measured {report['warm']['breakdown']['path']})")
    for state in ("cold", "warm"):
        proj = report[state]["breakdown"].get("projection")
        if proj:
            console.print(f"{state}: PROJECTED to the full {proj['layers_full']}-layer model from this "
                          f"{proj['layers_measured']}-layer slice: {proj['tok_s']:.3f} tok/s "
                          f"({proj['seconds_per_token']:.2f} s/token; {proj['note']})")
