"""Python threads for kernels made of BLAS calls (prefill attention, MLA, the prefill GEMM):
numpy's BLAS runs one thread per call here (colibri.engine limits it: OpenBLAS's own threads
kept spinning and took the numba kernels' cores), and BLAS and large ufuncs release the GIL,
so a few Python threads, each with its own tasks, use the cores the numba kernels use."""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

from numba import get_num_threads


@lru_cache(maxsize=4)
def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=n, thread_name_prefix="colibri-blas")


def kernel_threads() -> int:
    """The kernels' thread count (numba's, set per calling thread by kernels.set_threads)."""
    return get_num_threads()


def run_tasks(fn, tasks: list, nthreads: int | None = None) -> list:
    """fn over tasks, on `nthreads` threads (default: the kernels'; inline for one of either)."""
    nthreads = kernel_threads() if nthreads is None else nthreads
    if nthreads <= 1 or len(tasks) <= 1:
        return [fn(t) for t in tasks]
    return list(_pool(nthreads).map(fn, tasks))


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous ranges of nearly equal size (none empty)."""
    parts = max(1, min(parts, n))
    step = math.ceil(n / parts)
    return [(a, min(n, a + step)) for a in range(0, n, step)]


# Rows from which a row-wise kernel (a norm, SwiGLU, RoPE) is split over the threads: a
# 512-token chunk's norm is ~0.4 ms of one core, a split costs ~0.05 ms.
SPLIT_MIN_ROWS = 64


def over_rows(fn, n: int, nthreads: int | None = None) -> None:
    """fn(a, b) over row ranges covering [0, n): one call for few rows, else one range per
    thread. For nogil kernels that treat each row alone, so the split never changes a bit."""
    nthreads = kernel_threads() if nthreads is None else nthreads
    if n < SPLIT_MIN_ROWS or nthreads <= 1:
        fn(0, n)
    else:
        run_tasks(lambda ab: fn(*ab), split(n, nthreads), nthreads)
