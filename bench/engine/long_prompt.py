"""Long prompts: peak memory growth and prefill speed by prompt length, one child process per
length so each peak is that prompt's own.

    python -m bench.engine.long_prompt [-m MODEL_DIR] [--lengths 512,1024,4096,8191] [--limit-mb N] [--json]

Each child loads the engine, warms the kernels on a 16-token prompt, records its resident set
(VmRSS), prefills a prompt of N token ids (seeded random ids from the vocabulary: prefill cost
does not depend on which tokens, and random ids route realistically through MoE layers) and
reports prefill tok/s and the peak resident set (VmHWM) above the warm baseline. With
--limit-mb every child runs in a cgroup-v1 memory group of that size (tools/memlimit.py): a
prompt that does not fit is reported as OOM-killed instead of taking the machine down.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from bench.common import add_json_arg, child_env, machine_line, module_command, write_json


def _status_kb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(model: str | None, n: int, ram_gb: float | None, chunk: int | None) -> dict:
    import numpy as np

    from colibri.engine import Engine

    opts = {"max_context": max(n + 16, 1024), "ram_gb": ram_gb}
    if chunk:
        opts["prefill_chunk"] = chunk
    engine = Engine.load(model, **opts)
    rng = np.random.default_rng(0)
    vocab = engine.vocab_size
    engine.generate(rng.integers(0, vocab, 16).tolist(), max_tokens=1, stop_at_eos=False)  # compile, touch weights
    engine.reset()
    base_kb = _status_kb("VmRSS")
    # Peak from here on: reset the high-water mark (Linux >= 4.0: writing 5 to clear_refs).
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    ids = rng.integers(0, vocab, n).tolist()
    t0 = time.perf_counter()
    g = engine.generate(ids, max_tokens=1, stop_at_eos=False)
    dt = time.perf_counter() - t0
    cache = engine.slots[0].cache
    kv_mb = cache.capacity * cache.bytes_per_token / 2**20  # the context's own memory, not working memory
    return {"kv_cache_mb": round(kv_mb, 1), "tokens": n, "prefill_s": round(g.prefill_s, 3), "prefill_tok_s": round(n / g.prefill_s, 1),
            "total_s": round(dt, 3), "base_rss_mb": round(base_kb / 1024, 1),
            "peak_growth_mb": round((_status_kb("VmHWM") - base_kb) / 1024, 1)}


def run_one(a, n: int) -> dict:
    cmd = [*module_command(__spec__.name), "--child", str(n)] + (["-m", a.model] if a.model else [])
    if a.ram_gb:
        cmd += ["--ram-gb", str(a.ram_gb)]
    if a.chunk:
        cmd += ["--chunk", str(a.chunk)]
    if a.limit_mb:
        from tools.memlimit import run_limited

        r = run_limited(cmd, a.limit_mb << 20, env=child_env())
        out, err, rc = r.stdout, r.stderr, r.returncode
        extra = {"group_peak_mb": round(r.max_usage_bytes / 2**20), "oom_killed": r.oom_killed}
    else:
        p = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
        out, err, rc = p.stdout, p.stderr, p.returncode
        extra = {}
    if rc != 0:
        return {"tokens": n, "error": (err.strip().splitlines() or [f"exit {rc}"])[-1], "returncode": rc, **extra}
    return {**json.loads(out.strip().splitlines()[-1]), **extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--lengths", default="512,1024,4096,8191")
    ap.add_argument("--ram-gb", type=float, default=None)
    ap.add_argument("--chunk", type=int, default=None, help="EngineConfig.prefill_chunk (default: the engine's)")
    ap.add_argument("--limit-mb", type=int, default=None, help="run each child in a memory cgroup of this size")
    add_json_arg(ap)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        print(json.dumps(child(a.model, a.child, a.ram_gb, a.chunk)))
        return
    rows = [run_one(a, int(n)) for n in a.lengths.split(",")]
    if a.json:
        write_json(a.json, {"model": a.model or "default", "limit_mb": a.limit_mb, "rows": rows}, args=a)
        if a.json == "-":
            return
    print(machine_line())
    print(f"model {a.model or 'default (SmolLM2-135M Q4_1)'}, threads {os.environ.get('NUMBA_NUM_THREADS', 'default')}"
          + (f", memory cgroup {a.limit_mb} MiB" if a.limit_mb else ""))
    print(f"{'tokens':>7} {'prefill tok/s':>14} {'prefill s':>10} {'base RSS MB':>12} {'peak growth MB':>15} "
          f"{'of it KV cache MB':>18}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>7}  FAILED: {r['error']}" + ("  (OOM-killed)" if r.get("oom_killed") else ""))
            continue
        print(f"{r['tokens']:>7} {r['prefill_tok_s']:>14} {r['prefill_s']:>10} {r['base_rss_mb']:>12} "
              f"{r['peak_growth_mb']:>15} {r.get('kv_cache_mb', '?'):>18}" + (f"  group peak {r['group_peak_mb']} MiB" if "group_peak_mb" in r else ""))


if __name__ == "__main__":
    main()
