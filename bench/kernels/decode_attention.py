"""The decode attention kernel alone (colibri.kernels.ops.attend_one) at SmolLM2's shapes (9 query
heads over 3 KV heads of 64, 30 layers) and 1k-8k tokens of context: ms per token for all layers,
and the K/V bytes it reads per second. Separate arrays per layer (as the cache has), so each
layer's K/V comes from memory, not from the CPU caches. Benchmark only: no asserts.

--baseline FILE times another copy of the kernels' module (say the last commit's, from `git show
HEAD~1:colibri/kernels/ops.py > /tmp/ops_before.py`) in the same process, the two alternating
repeat by repeat, each first in turn, and says whether their outputs are the same bits: this
machine's speed drifts too much between processes for a before/after of a few percent.

    python -m bench.kernels.decode_attention [--contexts 1024,4096,8192] [--heads 9 --kv-heads 3 --head-dim 64 --layers 30]
                                     [--kv-cache f32,f16] [--small-pages] [--baseline FILE]
"""
from __future__ import annotations

import argparse
import time
import types
from pathlib import Path

import numpy as np

from bench.common import interleaved, machine_line


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
    ap.add_argument("--baseline", help="another copy of colibri/kernels/ops.py to time beside this one")
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
    kernels = {"this": ops}
    if a.baseline:
        # Compiled afresh, not from numba's cache: its index would take the copy for a changed
        # file, and a cached function's environment is found again by module name on loading.
        baseline = types.ModuleType("baseline_ops")
        source = Path(a.baseline).read_text().replace("cache=True", "cache=False")
        exec(compile(source, a.baseline, "exec"), baseline.__dict__)
        kernels["baseline"] = baseline
    print(machine_line())
    print(f"{a.heads} heads over {a.kv_heads} KV heads of {a.head_dim}, {a.layers} layers; best of {a.repeats}")
    print(f"{'kernel':>8} {'cache':>5} {'context':>7} {'ms/token':>9} {'K+V GB/s':>9}")
    for kind, n in [(kind, n) for kind in a.kv_cache.split(",") for n in lengths]:
        k, v = caches[kind]
        outs = {name: mod.attend_one(q, k[0], v[0], n, scale) for name, mod in kernels.items()}

        def once(name):
            mod = kernels[name]
            t0 = time.perf_counter()
            for layer in range(a.layers):
                mod.attend_one(q, k[layer], v[layer], n, scale)
            return time.perf_counter() - t0

        # alternated: either goes first in turn
        best = {name: min(ts) for name, ts in interleaved(kernels, a.repeats, once, alternate=True).items()}
        read = a.layers * a.kv_heads * n * a.head_dim * k[0].itemsize * 2
        for name in kernels:
            print(f"{name:>8} {kind:>5} {n:7} {best[name] * 1e3:9.2f} {read / best[name] / 1e9:9.1f}")
        if a.baseline:
            same = np.array_equal(outs["this"], outs["baseline"])
            print(f"{'':8} this / baseline time: {best['this'] / best['baseline']:.3f}; outputs "
                  + ("the same bits" if same else f"differ by {np.abs(outs['this'] - outs['baseline']).max():.2e}"))


if __name__ == "__main__":
    main()
