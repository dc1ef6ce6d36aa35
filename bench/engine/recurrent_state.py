"""A hybrid model's per-conversation memory and the recurrent kernels' cost, at a real model's
shapes (default Qwen3.6-35B-A3B: 30 Gated DeltaNet layers, 10 full-attention layers).

    python -m bench.engine.recurrent_state [--preset qwen3.6-35b-a3b] [--context 32768] [--json OUT]

Memory: one slot's cache is allocated as the engine allocates it (models/recurrent.py:
RecurrentCache grown to the context, its live state and STATE_SNAPSHOTS snapshots) and its
arrays' bytes are summed, beside the KV cache the same model would need if every layer were
full attention (models/cache.py: KVCache). Time: a snapshot's copy, one decode step of the
delta rule (kernels/delta_rule.py: delta_step) per layer, and the chunked form's cost per
prompt token (delta_chunked over CHUNK-token blocks), against the token loop it replaces.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import add_json_arg, machine_line, write_json


def _bytes(cache) -> int:
    arrays = list(cache.k) + list(cache.v)
    arrays += list(getattr(cache, "conv", {}).values()) + list(getattr(cache, "state", {}).values())
    for conv, state in getattr(cache, "snapshots", {}).values():
        arrays += list(conv.values()) + list(state.values())
    return sum(a.nbytes for a in arrays)


def memory(cfg: dict, context: int) -> dict:
    from colibri.models.cache import KVCache
    from colibri.models.recurrent import MAX_SNAPSHOTS, RecurrentCache
    from colibri.plan import shapes

    types = shapes.layer_types(cfg)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    linear = [i for i, t in enumerate(types) if t == "linear_attention"]
    conv, state = shapes.linear_state_shapes(cfg)
    kvh, dh = cfg["num_key_value_heads"], cfg["head_dim"]
    hybrid = RecurrentCache(full, linear, kvh, dh, context, conv, state)
    hybrid.reserve(context)
    for n in range(MAX_SNAPSHOTS):  # as many snapshots as a long conversation keeps
        hybrid.length = (n + 1) * 512
        hybrid.snapshot()
    hybrid.length = context
    all_full = KVCache(len(types), kvh, dh, context)
    all_full.reserve(context)
    state_bytes = hybrid.state_bytes
    return {"context": context, "full_layers": len(full), "linear_layers": len(linear),
            "hybrid_kv_bytes": hybrid.bytes_per_token * context, "state_bytes": state_bytes,
            "snapshot_bytes": state_bytes * len(hybrid.snapshots), "hybrid_total_bytes": _bytes(hybrid),
            "all_full_attention_kv_bytes": _bytes(all_full)}


def _best(f, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def kernels(cfg: dict, prompt: int = 512) -> dict:
    from colibri.kernels import delta_rule
    from colibri.plan import shapes

    (k1, c), (hv, dk, dv) = shapes.linear_state_shapes(cfg)
    hk = cfg["linear_num_key_heads"]
    rng = np.random.default_rng(0)
    S = np.zeros((hv, dk, dv), np.float32)
    q, k = (rng.standard_normal((prompt, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((prompt, hv, dv)).astype(np.float32)
    g = -np.abs(rng.standard_normal((prompt, hv))).astype(np.float32) * 0.1
    beta = rng.uniform(0.1, 0.9, (prompt, hv)).astype(np.float32)
    delta_rule.delta_step(S, q[0], k[0], v[0], g[0], beta[0])   # compile
    delta_rule.delta_chunked(S, q[:70], k[:70], v[:70], g[:70], beta[:70])
    step = _best(lambda: delta_rule.delta_step(S, q[0], k[0], v[0], g[0], beta[0]), 20)
    chunked = _best(lambda: delta_rule.delta_chunked(S, q, k, v, g, beta), 3)

    def token_loop():
        for t in range(prompt):
            delta_rule.delta_step(S, q[t], k[t], v[t], g[t], beta[t])

    loop = _best(token_loop, 3)
    snap = np.empty((hv, dk, dv), np.float32)
    copy = _best(lambda: np.copyto(snap, S), 20)
    layers = shapes.layer_types(cfg).count("linear_attention")
    return {"decode_step_ms_per_layer": round(step * 1e3, 4), "decode_step_ms_all_layers": round(step * layers * 1e3, 3),
            "prefill_us_per_token_per_layer_chunked": round(chunked / prompt * 1e6, 2),
            "prefill_us_per_token_per_layer_token_loop": round(loop / prompt * 1e6, 2),
            "snapshot_copy_ms_all_layers": round(copy * layers * 1e3, 3), "prompt_tokens": prompt}


def main() -> None:
    from tools import moe_presets

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--context", type=int, default=32768)
    add_json_arg(ap)
    a = ap.parse_args()
    cfg = moe_presets.preset_config(a.preset)
    out = {"preset": a.preset, "memory": memory(cfg, a.context), "kernels": kernels(cfg)}
    if a.json:
        write_json(a.json, out, args=a)
        if a.json == "-":
            return
    m, k = out["memory"], out["kernels"]
    gib = 2 ** 30
    print(machine_line())
    print(f"{a.preset}: {m['linear_layers']} Gated DeltaNet + {m['full_layers']} full-attention layers, "
          f"one conversation at {a.context} tokens (float32 cache)")
    print(f"  hybrid: KV of the full layers {m['hybrid_kv_bytes'] / gib:.2f} GiB + recurrent state "
          f"{m['state_bytes'] / 2**20:.1f} MiB + {m['snapshot_bytes'] / 2**20:.1f} MiB of snapshots = "
          f"{m['hybrid_total_bytes'] / gib:.2f} GiB")
    print(f"  every layer full attention: KV {m['all_full_attention_kv_bytes'] / gib:.2f} GiB "
          f"({m['all_full_attention_kv_bytes'] / m['hybrid_total_bytes']:.1f}x)")
    print(f"  delta rule, decode: {k['decode_step_ms_per_layer']} ms per layer, {k['decode_step_ms_all_layers']} ms "
          f"per token over all linear layers; a snapshot's copy {k['snapshot_copy_ms_all_layers']} ms")
    print(f"  delta rule, prefill of {k['prompt_tokens']} tokens: chunked {k['prefill_us_per_token_per_layer_chunked']} "
          f"us per token per layer, token loop {k['prefill_us_per_token_per_layer_token_loop']} us")


if __name__ == "__main__":
    main()
