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

BENCH_VERSION = 1


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


def _measure(engine, tokens: list[int], prompt: list[int]) -> dict:
    engine.reset()
    s0, r0 = engine.expert_stats, _disk_read_bytes()
    g = engine.generate(prompt, max_tokens=1, stop_at_eos=False)
    times = engine.feed(tokens)
    s1, r1 = engine.expert_stats, _disk_read_bytes()
    steady = times[1:] or times
    row = {"prefill_tok_s": g.prefill_tok_s, "ttft_s": g.ttft_s, "decode_tok_s": len(steady) / sum(steady),
           "disk_gb_per_token": (r1 - r0) / len(times) / 1e9}
    if s0 is not None:
        asked = (s1["hits"] - s0["hits"]) + (s1["misses"] - s0["misses"])
        row["hit_rate"] = (s1["hits"] - s0["hits"]) / asked if asked else None
        row["expert_gb_per_token"] = (s1["bytes_read"] - s0["bytes_read"]) / len(times) / 1e9
        row["disk_wait_share"] = (s1["wait_s"] - s0["wait_s"]) / sum(times)
    return row


def run_bench(model_dir=None, tokens: int = 32, prompt_tokens: int = 256, **engine_options) -> dict:
    from colibri.engine import Engine

    rng = np.random.default_rng(0)
    cold_ok = _drop_caches()
    t0 = time.perf_counter()
    engine = Engine.load(model_dir, max_context=prompt_tokens + tokens + 8, **engine_options)
    load_s = time.perf_counter() - t0
    vocab = engine.vocab_size
    seq = rng.integers(min(100, vocab - 1), vocab, size=tokens).tolist()
    prompt = rng.integers(min(100, vocab - 1), vocab, size=prompt_tokens).tolist()
    cold = _measure(engine, seq, prompt)
    warm = _measure(engine, seq, prompt)
    c = engine.container
    return {"version": BENCH_VERSION, "model": str(c.dir), "model_type": engine.model_type,
            "dense_gb": c.dense_bytes / 1e9, "expert_gb": c.expert_bytes / 1e9,
            "expert_store": type(engine.experts).__name__, "load_s": load_s,
            "cold_cache_dropped": cold_ok, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "cold": cold, "warm": warm,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}


def render(report: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"colibri bench: {Path(report['model']).name} ({report['model_type']}, "
                    f"dense {report['dense_gb']:.2f} GB, experts {report['expert_gb']:.2f} GB)")
    t.add_column("state")
    for col in ("decode tok/s", "prefill tok/s", "TTFT s", "hit rate", "GB read/token", "disk wait"):
        t.add_column(col, justify="right")
    for state in ("cold", "warm"):
        r = report[state]
        hit = r.get("hit_rate")
        wait = r.get("disk_wait_share")
        label = state if state == "warm" or report["cold_cache_dropped"] else "cold (cache not dropped: not root)"
        t.add_row(label, f"{r['decode_tok_s']:.2f}", f"{r['prefill_tok_s']:.1f}", f"{r['ttft_s']:.3f}",
                  "-" if hit is None else f"{hit:.2f}", f"{r.get('expert_gb_per_token', r['disk_gb_per_token']):.3f}",
                  "-" if wait is None else f"{wait:.0%}")
    console.print(t)
    console.print(f"load {report['load_s']:.2f} s, expert store {report['expert_store']}, "
                  f"peak RSS {report['peak_rss_gb']:.2f} GB; decode on {report['tokens']} forced tokens, "
                  f"prefill on {report['prompt_tokens']}")
