"""Memory the kernels stream: anonymous mappings backed by transparent huge pages.

Decode reads every weight once per token and, at long contexts, the whole KV cache once per
token; both are far larger than the TLB covers with 4 KiB pages (SmolLM2's 112 MB of weights
are 27k pages a token, its 8k-token float32 cache 92k). With 2 MiB pages the page walks go,
and the int4 matvec streams faster from DRAM (docs/benchmarks.md: What a design choice is
worth). numpy's own allocations get 4 KiB pages where THP is in `madvise` mode (the common
default), so the arrays the kernels stream are placed here instead:

- huge_pages(n): one mapping (an expert arena, a KV cache's arrays);
- WEIGHTS.empty(shape, dtype): dense weights, packed into shared 64 MiB chunks, since most
  matrices of a small model are under the 2 MiB a huge page needs. A chunk is unmapped when no
  array in it is left.

Where the kernel has no THP, the same calls give 4 KiB pages: slower, never different.
"""
from __future__ import annotations

import mmap
import threading

import numpy as np

_HUGE = 2 << 20
_ALIGN = 64  # a cache line: the kernels' vector loads of a row start aligned


def huge_pages(nbytes: int, touch: bool = False) -> np.ndarray:
    """uint8 [nbytes] of zeroed anonymous memory, page-aligned, advised for transparent huge
    pages; `touch` faults every page in now (moves the faults out of the first use)."""
    if nbytes == 0:
        return np.zeros(0, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # no THP on this kernel: 4 KiB pages work the same, only slower
    a = np.frombuffer(m, dtype=np.uint8)
    if touch:
        a[::mmap.PAGESIZE] = 0
    return a


def huge_arrays(specs: list[tuple[tuple, np.dtype]]) -> list[np.ndarray]:
    """Zeroed arrays of the given (shape, dtype)s, laid out in one huge_pages mapping."""
    offsets, total = [], 0
    for shape, dtype in specs:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = huge_pages(total)
    return [_view(buf, off, shape, dtype) for off, (shape, dtype) in zip(offsets, specs)]


def _view(buf: np.ndarray, off: int, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return buf[off:off + n].view(dtype).reshape(shape)


class Slab:
    """Bump allocation of arrays that live as long as their model, in shared huge-page chunks.
    A chunk stays mapped while any array in it (or the slab, for the chunk it fills) is alive."""

    def __init__(self, chunk_bytes: int = 64 << 20):
        self.chunk_bytes = chunk_bytes
        self._chunk: np.ndarray | None = None
        self._used = 0
        self._lock = threading.Lock()

    def empty(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if n < 4096:  # a norm weight, a bias: not worth a slab's space or alignment
            return np.empty(shape, dtype)
        if n > self.chunk_bytes // 4:  # a large matrix gets its own mapping
            return _view(huge_pages(n), 0, shape, dtype)
        with self._lock:
            start = -(-self._used // _ALIGN) * _ALIGN
            if self._chunk is None or start + n > self._chunk.shape[0]:
                self._chunk, start = huge_pages(self.chunk_bytes), 0
            self._used = start + n
            return _view(self._chunk, start, shape, dtype)

    def copy(self, a: np.ndarray) -> np.ndarray:
        out = self.empty(a.shape, a.dtype)
        out[...] = a
        return out


WEIGHTS = Slab()  # the dense weights of every model this process loads


# ---------------------------------------------------------------- how much there is
def available_memory() -> int:
    """Bytes this process may still use: MemAvailable, lowered by a cgroup-v1/v2 memory limit."""
    avail = None
    try:
        for line in _text("/proc/meminfo").splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_limit()
    candidates = [v for v in (avail, limit) if v]
    return min(candidates) if candidates else 8 << 30


def _cgroup_limit() -> int | None:
    """The tightest memory limit on this process's cgroup (page cache counts against it there, so
    the budget planned below it leaves room for reads in flight)."""
    try:
        lines = _text("/proc/self/cgroup").splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "":  # cgroup v2
                base = f"/sys/fs/cgroup{path}"
                raw = _text(f"{base}/memory.max").strip()
                if raw != "max":
                    found.append(int(raw))
            elif "memory" in controllers.split(","):
                base = f"/sys/fs/cgroup/memory{path}"
                limit = int(_text(f"{base}/memory.limit_in_bytes"))
                if limit < (1 << 60):
                    found.append(limit)
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()
