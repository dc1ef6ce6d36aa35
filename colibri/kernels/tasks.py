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
