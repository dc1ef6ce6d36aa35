"""Prefill matmul, both ways colibri.kernels.gemm has: the numba 4x4 register-blocked kernel
and dequantize-a-tile + BLAS sgemm, at the shapes a prefill chunk runs, in GFLOP/s (2 L K N per
call). Picks colibri.kernels.gemm.BLAS_MIN_ROWS: the smallest L where BLAS wins.
Benchmark only: no asserts.

    python -m bench.kernels.prefill_gemm [--threads 2] [--scheme q4_1] [--rows 4,8,16,32,64,512]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import machine_line


# (out, in): SmolLM2's q/k/v/o, gate/up, down and an OLMoE-shaped expert's projections.
SHAPES = [(576, 576), (1536, 576), (576, 1536), (1024, 2048), (2048, 1024)]


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scheme", default="q4_1")
    ap.add_argument("--rows", default="4,8,16,32,64,512")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()

    import numba
    from threadpoolctl import threadpool_limits

    from colibri.kernels import gemm, quantize
    from colibri.kernels.cpu.checks import int4_args

    numba.set_num_threads(a.threads)
    threadpool_limits(1)  # as the engine runs: one BLAS thread per call, Python threads over tiles
    rng = np.random.default_rng(0)
    print(machine_line())
    print(f"scheme {a.scheme}, {a.threads} threads; GFLOP/s, best of {a.repeats}; BLAS_MIN_ROWS = {gemm.BLAS_MIN_ROWS}")
    print(f"{'out x in':>11} {'L':>4} {'numba':>7} {'BLAS':>7} {'BLAS/numba':>10}")
    for shape in SHAPES:
        t = quantize(rng.standard_normal(shape).astype(np.float32), a.scheme)
        args = int4_args(t)
        for L in (int(v) for v in a.rows.split(",")):
            x = rng.standard_normal((L, shape[1])).astype(np.float32)
            y = np.empty((L, shape[0]), np.float32)
            flop = 2 * L * shape[0] * shape[1]
            nb = best_of(lambda: gemm.matmul_int4(*args, x, y, a.threads), a.repeats)
            bl = best_of(lambda: gemm.matmul_blas(t, x, y, a.threads), a.repeats)
            print(f"{shape[0]:5}x{shape[1]:<5} {L:4} {flop / nb / 1e9:7.1f} {flop / bl / 1e9:7.1f} {nb / bl:9.2f}x")


if __name__ == "__main__":
    main()
