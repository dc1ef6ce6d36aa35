"""Quick CPU kernel figures: GB/s of weights streamed by a 4096x4096 matvec, per scheme
(median of 20 calls after warm-up; bytes = QTensor.nbytes) and as a share of the memory read
bandwidth measured in the same run (bench/membw.py), plus prefill matmul GFLOP/s.

    python -m bench.kernels.kernels_quick --shapes 7168x2048,2048x7168,6144x2048,2048x768 --schemes int4_g64

measures the shapes frontier MoE decode runs (rows x inputs: DeepSeek-V3's expert gate/up and
down, GLM-5's gate/up, Qwen3-30B's gate/up), each cycling through enough distinct copies
to pass 96 MB, so every call reads DRAM.

Note: a 4096x4096 int4 tensor (~9 MB) fits in a 32 MB L3, so repeated calls on one tensor
can read faster than DRAM; --rotate cycles through enough copies to defeat the cache
(each a distinct array: 12 x 9 MB of int4 is well past the 32 MB L3).
A busy core (another process) stalls every 2-thread call for a scheduler slice (~4-12 ms):
compare with --threads 1 when the machine is shared.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from colibri.kernels import SCHEMES, QTensor, matmul, matvec, quantize
from bench.common import machine_line
from bench.membw import read_bandwidth


def median_seconds(fn, calls: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rotate", type=int, default=1, help="distinct weight copies cycled through")
    ap.add_argument("--prefill", type=int, default=64, help="L for the matmul figure (0: skip)")
    ap.add_argument("--threads", type=int, default=0, help="numba threads (0: numba's default)")
    ap.add_argument("--shapes", default="", help="ROWSxCOLS,... instead of --n x --n (copies past the L3)")
    ap.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated schemes")
    args = ap.parse_args()
    print(machine_line())
    if args.shapes:
        shapes_main(args)
        return
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    n = args.n
    w = rng.standard_normal((n, n), dtype=np.float32)
    x = rng.standard_normal(n, dtype=np.float32)
    xs = rng.standard_normal((args.prefill, n), dtype=np.float32)
    y = np.empty(n, np.float32)
    bw = read_bandwidth()
    print(f"{n}x{n}, {numba.get_num_threads()} threads: matvec GB/s of weights (median of {args.calls}) "
          f"and % of the read bandwidth, {bw / 1e9:.1f} GB/s (parallel f32 sum over 512 MiB); "
          f"matmul L={args.prefill} GFLOP/s")
    for scheme in SCHEMES:
        t0 = quantize(w, scheme)
        # Copies, not the same arrays again (f32 "quantizes" to w itself): one cached tensor
        # would measure the L3, not DRAM.
        ts = [t0] + [QTensor(t0.scheme, t0.shape, *(None if a is None else a.copy() for a in (t0.q, t0.scales, t0.mins)))
                     for _ in range(args.rotate - 1)]
        it = iter(range(1 << 62))

        def call():
            matvec(ts[next(it) % len(ts)], x, y)

        sec = median_seconds(call, args.calls)
        nbytes = ts[0].nbytes
        line = (f"{scheme:9s} {nbytes / 2**20:7.1f} MiB  {nbytes / sec / 1e9:6.1f} GB/s  "
                f"{100 * nbytes / sec / bw:4.0f}%  {sec * 1e3:7.3f} ms")
        if args.prefill:
            sec_mm = median_seconds(lambda: matmul(ts[0], xs), max(3, args.calls // 4))
            line += f"   matmul {2 * args.prefill * n * n / sec_mm / 1e9:6.1f} GFLOP/s"
        print(line, flush=True)


def shapes_main(args) -> None:
    if args.threads:
        numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bw = read_bandwidth()
    print(f"{numba.get_num_threads()} threads, read bandwidth {bw / 1e9:.1f} GB/s (parallel f32 sum over 512 MiB)")
    for shape in args.shapes.split(","):
        rows, cols = (int(v) for v in shape.lower().split("x"))
        x = rng.standard_normal(cols, dtype=np.float32)
        y = np.empty(rows, np.float32)
        for scheme in args.schemes.split(","):
            t0 = quantize(rng.standard_normal((rows, cols), dtype=np.float32), scheme)
            copies = max(2, -(-(96 << 20) // t0.nbytes))
            ts = [t0] + [QTensor(t0.scheme, t0.shape, *(None if a is None else a.copy() for a in (t0.q, t0.scales, t0.mins)))
                         for _ in range(copies - 1)]
            it = iter(range(1 << 62))
            sec = median_seconds(lambda: matvec(ts[next(it) % len(ts)], x, y), max(args.calls, 2 * copies))
            print(f"{rows:5d}x{cols:<5d} {scheme:9s} {t0.nbytes / 2**20:6.2f} MiB  {t0.nbytes / sec / 1e9:6.1f} GB/s  "
                  f"{100 * t0.nbytes / sec / bw:4.0f}% of read bandwidth  {sec * 1e6:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
