"""colibri.memory: the huge-page arrays the kernels stream (dense weights, KV caches)."""
import mmap

import numpy as np
import pytest

from colibri.memory import Slab, huge_arrays, huge_pages
from colibri.models.cache import KVCache


def _mapping_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding addr."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def _advised_huge(a: np.ndarray) -> bool:
    return "hg" in _mapping_flags(a.ctypes.data).get("VmFlags", "").split()


needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE here")


@needs_thp
def test_huge_pages_are_zeroed_and_advised_for_huge_pages():
    a = huge_pages(3 << 20)
    assert a.dtype == np.uint8 and a.shape == (3 << 20,) and not a.any()
    assert _advised_huge(a)


def test_slab_packs_arrays_aligned_and_apart():
    slab = Slab(chunk_bytes=1 << 20)
    arrays = [slab.empty((100, 33), np.float32) for _ in range(5)] + [slab.empty((7, 4096), np.uint8)]
    for i, a in enumerate(arrays):
        assert a.ctypes.data % 64 == 0
        a[...] = i + 1
    for i, a in enumerate(arrays):  # no two overlap
        assert (a == i + 1).all()
    tiny = slab.empty((3,), np.float32)  # a norm weight stays an ordinary array
    assert tiny.base is None
    big = slab.copy(np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024))  # over a quarter chunk: its own
    assert big.shape == (1024, 1024) and big[1023, 1023] == (1 << 20) - 1


@needs_thp
def test_slab_chunks_are_advised_for_huge_pages():
    a = Slab().empty((512, 512), np.float32)
    assert _advised_huge(a)


def test_huge_arrays_lay_out_distinct_zeroed_arrays():
    a, b, c = huge_arrays([((3, 5, 7), np.float32), ((2, 9), np.uint16), ((4,), np.float64)])
    assert (a.shape, b.shape, c.shape) == ((3, 5, 7), (2, 9), (4,))
    assert (a.dtype, b.dtype, c.dtype) == (np.float32, np.uint16, np.float64)
    a[...], b[...], c[...] = 1.5, 7, 2.25
    assert (a == 1.5).all() and (b == 7).all() and (c == 2.25).all()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_kv_cache_grows_in_huge_pages_keeping_what_it_holds(dtype):
    cache = KVCache(num_layers=3, num_kv_heads=2, head_dim=8, max_tokens=2000, dtype=dtype)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 300, 8)).astype(np.float32)
    v = rng.standard_normal((3, 2, 300, 8)).astype(np.float32)
    cache.reserve(300)
    for layer in range(3):
        cache.write_rows(layer, 0, k[layer], v[layer])
    cache.length = 300
    cache.reserve(1500)
    assert cache.capacity == 1500
    tol = 0 if dtype == "f32" else 1e-3
    for layer in range(3):
        np.testing.assert_allclose(cache.keys(layer, 300), k[layer], rtol=tol, atol=tol)
        np.testing.assert_allclose(cache.values(layer, 300), v[layer], rtol=tol, atol=tol)
        assert not cache.k[layer][:, 300:].any() and not cache.v[layer][:, 300:].any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert _advised_huge(cache.k[0])
