"""Memory read bandwidth as the kernels see it, shared by the benchmarks that print a roof.

A parallel float32 sum over a 512 MiB array (well past the last-level cache): one contiguous
slice per thread, float32 accumulators that LLVM vectorizes and interleaves, so the loop is
bound by reading memory, not by arithmetic (a float64 accumulator, used before, spent its time
converting and read ~50 GB/s where a plain f32 matvec streamed ~70). Best of 5 passes.

    python -m bench.membw [--threads N] [--mib 512]     # the figure alone
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from colibri.kernels.team import claim, counters_size, finish, run_team


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


PIECE_WORDS = 1024  # 8 KB: about what a decode thread takes at a time (32 rows of 288 bytes)


@numba.njit(nogil=True)
def _sum_each(t, buf, bounds, ctr, nthreads, sums):
    """Team member t's part of summing each piece buf[bounds[k]:bounds[k + 1]] in turn, shared
    out in PIECE_WORDS runs as colibri.kernels.decode shares a matrix's rows, all members
    meeting after each piece (colibri.kernels.team)."""
    state = np.zeros(2, np.int64)
    s = np.uint64(0)
    for k in range(bounds.shape[0] - 1):
        lo, hi = bounds[k], bounds[k + 1]
        n = (hi - lo + PIECE_WORDS - 1) // PIECE_WORDS
        state[0] = 0
        state[1] = 0
        while True:
            j = claim(ctr, k, n, nthreads, t, state)
            if j < 0:
                break
            run = buf[lo + j * PIECE_WORDS: min(hi, lo + (j + 1) * PIECE_WORDS)]
            for i in range(run.shape[0]):
                s += run[i]
        finish(ctr, k, n, nthreads, state)
    sums[t] = s


@numba.njit(nogil=True)
def _sum_halves(t, buf, bounds, ctr, nthreads, sums):
    """Team member t's contiguous share of each piece buf[bounds[k]:bounds[k + 1]] in turn,
    never meeting the others: _sum_each's pattern without the claims and the waits."""
    s = np.uint64(0)
    for k in range(bounds.shape[0] - 1):
        lo, hi = bounds[k], bounds[k + 1]
        per = (hi - lo + nthreads - 1) // nthreads
        run = buf[min(hi, lo + t * per): min(hi, lo + (t + 1) * per)]
        for i in range(run.shape[0]):  # from 0: see _sum
            s += run[i]
    sums[t] = s


def read_bandwidth_each(arrays: list[np.ndarray], threads: int | None = None, meet: bool = True) -> float:
    """Bytes per second read by a plain sum over `arrays` one after another, each shared out
    to the threads as a decode token shares a matrix (colibri's thread team, the threads
    meeting after each): the bandwidth a token's access pattern (many matrices of a few hundred
    KB) leaves with no arithmetic in the way. meet=False: each thread sums its own contiguous
    share of every array and never waits for the others (what the split alone costs, without
    the meetings). The bytes are summed as 64-bit integers (random bytes as floats would hold
    denormals, slow on some CPUs), laid out back to back, each rounded down to whole words;
    copies are cycled past 256 MB, so each comes from memory. Best of 5 passes."""
    nthreads = threads or numba.get_num_threads()
    fn = _sum_each if meet else _sum_halves
    sizes = [a.nbytes // 8 for a in arrays]
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    nbytes = int(bounds[-1]) * 8
    copies = []
    for _ in range(max(2, -(-(256 << 20) // max(nbytes, 1)))):
        buf = np.empty(int(bounds[-1]), np.uint64)
        for a, lo, hi in zip(arrays, bounds[:-1], bounds[1:]):
            buf[lo:hi] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)[: (hi - lo) * 8].view(np.uint64)
        copies.append(buf)
    sums = np.zeros(nthreads, np.uint64)

    def one_pass():
        for buf in copies:
            run_team(fn, nthreads, buf, bounds, np.zeros(counters_size(len(arrays), nthreads), np.int64),
                     nthreads, sums)

    one_pass()
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        one_pass()
        best = max(best, nbytes * len(copies) / (time.perf_counter() - t0))
    return best


def main() -> None:
    from bench.common import add_json_arg, machine_line, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: numba's)")
    ap.add_argument("--mib", type=int, default=512, help="array size (well past the last-level cache)")
    add_json_arg(ap)
    a = ap.parse_args()
    print(machine_line())
    bw = read_bandwidth(a.threads, a.mib << 20)
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s (parallel f32 sum over {a.mib} MiB, best of 5)")
    write_json(a.json, {"read_bandwidth_gbs": bw / 1e9}, args=a)


if __name__ == "__main__":
    main()
