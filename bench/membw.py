"""Memory read bandwidth as the kernels see it, shared by the benchmarks that print a roof.

A parallel float32 sum over a 512 MiB array (well past the last-level cache): one contiguous
slice per thread, float32 accumulators that LLVM vectorizes and interleaves, so the loop is
bound by reading memory, not by arithmetic (a float64 accumulator, used before, spent its time
converting and read ~50 GB/s where a plain f32 matvec streamed ~70). Best of 5 passes.
"""
from __future__ import annotations

import time

import numba
import numpy as np


@numba.njit(parallel=True, fastmath=True)
def _sum(a, nthreads):
    n = a.shape[0]
    per = (n + nthreads - 1) // nthreads
    parts = np.zeros(nthreads, np.float32)
    for t in numba.prange(nthreads):
        part = a[t * per: min(n, (t + 1) * per)]
        s = np.float32(0.0)
        # Indexing from 0 lets LLVM prove the index non-negative; a loop from a runtime start
        # kept numba's negative-index wraparound and compiled to gathers (5 GB/s).
        for i in range(part.shape[0]):
            s += part[i]
        parts[t] = s
    return parts.sum()


def read_bandwidth(threads: int | None = None, nbytes: int = 512 << 20) -> float:
    """Bytes per second read by `threads` numba threads (default: all numba has)."""
    if threads:
        numba.set_num_threads(threads)
    nthreads = numba.get_num_threads()
    a = np.ones(nbytes // 4, dtype=np.float32)
    _sum(a, nthreads)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        _sum(a, nthreads)
        best = max(best, a.nbytes / (time.perf_counter() - t0))
    return best
