"""The fused routed-experts kernel alone (colibri/kernels/moe.py), one MoE layer's top-8 call, at
a container's real expert shapes: is it bound by its arithmetic or by its reads? Benchmark only.

    python -m bench.kernels.moe_kernel --model /work/qwen3-30b [--layers 6] [--calls 60]

The experts are random bytes in the container's blob layout (scales set to 0.01), `--layers`
layers of all experts in RAM. "hot": the same 8 experts called again and again (Qwen3-30B-A3B:
8 x 2.25 MB, inside the L3 cache), which is the arithmetic's speed; "cold": a new layer and new
experts each call, read from DRAM, as decode reads them. Both layouts (formats/qtensor.py,
Layout), exact and int8 activations; medians, 2 threads, from one thread that is not the main one.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a colibri container with routed experts")
    ap.add_argument("--layers", type=int, default=6, help="layers of random experts for the cold calls")
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    from bench.common import machine_line

    print(machine_line())
    th = threading.Thread(target=run, args=(a,))
    th.start()
    th.join()


def run(a) -> None:
    from colibri.io.container import Container
    from colibri.formats.expert_blob import FusedExperts
    from colibri.kernels.moe import fused_experts

    c = Container(a.model)
    prefix, layout = next(iter(c.expert_layouts.items()))
    proj = layout.projections
    rng = np.random.default_rng(0)
    experts = layout.num_experts
    memory = [rng.integers(0, 256, (experts, layout.blob_bytes), dtype=np.uint8) for _ in range(a.layers)]
    for m in memory:
        for p in proj.values():
            off, _, shape = p["parts"]["scales"]
            n = int(np.prod(shape))
            m[:, off:off + 4 * n] = np.full((experts, n), 0.01, np.float32).view(np.uint8)
    x = rng.standard_normal(proj["gate_proj"]["shape"][1]).astype(np.float32)
    weights = np.full(8, 0.125, np.float32)
    used = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for p in proj.values() for _, dt, shape in p["parts"].values())
    print(f"{a.model}: {prefix}, {experts} experts of {used / 1e6:.2f} MB; top-8 call reads {8 * used / 1e6:.1f} MB")

    def pick():
        return np.sort(rng.choice(experts, 8, replace=False)).astype(np.int64)

    for act in ("f32", "int8"):
        for interleaved in (False, True):
            kernel = FusedExperts.of(proj, interleaved)
            slots = pick()
            fused_experts(kernel, x, memory[0], slots, weights, a.threads, act)  # compile / load
            hot, cold = [], []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                fused_experts(kernel, x, memory[0], slots, weights, a.threads, act)
                hot.append(time.perf_counter() - t0)
            for i in range(a.calls):
                s = pick()
                t0 = time.perf_counter()
                fused_experts(kernel, x, memory[i % a.layers], s, weights, a.threads, act)
                cold.append(time.perf_counter() - t0)
            h, cd = statistics.median(hot), statistics.median(cold)
            print(f"{act:4} {'interleaved' if interleaved else 'row-major':11}  hot {h * 1e3:6.3f} ms "
                  f"{8 * used / h / 1e9:5.1f} GB/s   cold {cd * 1e3:6.3f} ms {8 * used / cd / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
