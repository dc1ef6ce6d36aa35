"""The decode attention kernel alone (colibri.kernels.ops.attend_one) at SmolLM2's shapes (9 query
heads over 3 KV heads of 64, 30 layers) and 1k-8k tokens of context: ms per token for all layers,
and the K/V bytes it reads per second. Separate arrays per layer (as the cache has), so each
layer's K/V comes from memory, not from the CPU caches. Benchmark only: no asserts.

    python bench/decode_attention.py [--contexts 1024,4096,8192] [--heads 9 --kv-heads 3 --head-dim 64 --layers 30]
                                     [--kv-cache f32,f16] [--small-pages]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-cache", default="f32,f16", help="cache element types to time (f16: --kv-cache f16)")
    ap.add_argument("--small-pages", action="store_true",
                    help="numpy's own arrays (4 KiB pages) instead of the cache's huge-page mapping")
    a = ap.parse_args()

    from colibri.kernels import ops
    from colibri.memory import huge_arrays

    def placed(arrays):  # where KVCache puts them: one mapping advised for huge pages
        if a.small_pages:
            return arrays
        out = huge_arrays([(x.shape, x.dtype) for x in arrays])
        for dst, src in zip(out, arrays):
            dst[...] = src
        return out

    lengths = [int(x) for x in a.contexts.split(",")]
    cap = max(lengths)
    rng = np.random.default_rng(0)
    k32 = [rng.standard_normal((a.kv_heads, cap, a.head_dim), dtype=np.float32) for _ in range(a.layers)]
    v32 = [rng.standard_normal((a.kv_heads, cap, a.head_dim), dtype=np.float32) for _ in range(a.layers)]
    caches = {"f32": (placed(k32), placed(v32)),
              "f16": (placed([x.astype(np.float16).view(np.uint16) for x in k32]),
                      placed([x.astype(np.float16).view(np.uint16) for x in v32]))}
    q = rng.standard_normal((a.heads, a.head_dim), dtype=np.float32)
    scale = np.float32(a.head_dim ** -0.5)
    print(f"{a.heads} heads over {a.kv_heads} KV heads of {a.head_dim}, {a.layers} layers; best of {a.repeats}")
    print(f"{'cache':>5} {'context':>7} {'ms/token':>9} {'K+V GB/s':>9}")
    for kind, n in [(kind, n) for kind in a.kv_cache.split(",") for n in lengths]:
        k, v = caches[kind]
        ops.attend_one(q, k[0], v[0], n, scale)
        best = float("inf")
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            for layer in range(a.layers):
                ops.attend_one(q, k[layer], v[layer], n, scale)
            best = min(best, time.perf_counter() - t0)
        read = a.layers * a.kv_heads * n * a.head_dim * k[0].itemsize * 2
        print(f"{kind:>5} {n:7} {best * 1e3:9.2f} {read / best / 1e9:9.1f}")


if __name__ == "__main__":
    main()
