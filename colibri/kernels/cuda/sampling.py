"""Sampling on the device: argmax (numpy's order) and generate.sample's temperature, top-k and
top-p draw for a given uniform number, plus that number from a seeded xoroshiro128+ stream.
One block each; tested against numpy and generate.candidates (tests/kernels/test_cuda.py)."""
from __future__ import annotations

import math

from numba import cuda, float32, float64, int64
from numba.cuda.random import xoroshiro128p_uniform_float64

from .kernels import BLOCK, block_max, block_sum


@cuda.jit(device=True)
def _first_is_better(a, ia, b, ib):
    """numpy argmax's order: NaN above everything, then larger values, ties to the lower index."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and (not math.isnan(b) or ia < ib)
    return a > b or (a == b and ia < ib)


@cuda.jit
def argmax(z, out):
    """out[0] = np.argmax(z) for z [V], one block."""
    tid = cuda.threadIdx.x
    vals = cuda.shared.array(BLOCK, float32)
    idx = cuda.shared.array(BLOCK, int64)
    best = float32(-math.inf)
    bi = int64(z.shape[0])
    for i in range(tid, z.shape[0], BLOCK):
        if bi == z.shape[0] or _first_is_better(z[i], i, best, bi):
            best = z[i]
            bi = i
    vals[tid] = best
    idx[tid] = bi
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if tid < stride:
            o = tid + stride
            if idx[o] < z.shape[0] and (idx[tid] == z.shape[0]
                                         or _first_is_better(vals[o], idx[o], vals[tid], idx[tid])):
                vals[tid] = vals[o]
                idx[tid] = idx[o]
        cuda.syncthreads()
        stride //= 2
    if tid == 0:
        out[0] = idx[0]


@cuda.jit(device=True)
def _order_key(bits):
    """float32 bits (as int32) -> an int64 that orders like the float (NaN excluded)."""
    b = int64(bits)
    return b if b >= 0 else -(b & 0x7FFFFFFF) - 1


@cuda.jit(device=True)
def _measure(z, zbits, ranked, top, inv_t, by_mass, key, limit, red, tid):
    """Over the tokens ranked ahead of the boundary (key, limit) in the order (value
    descending, id ascending), or id order when not ranked (every key 0): their count, or
    their total weight exp((z - top) / T) in float64 (generate.candidates' weights). A token
    i is ahead when its key > key, or key == key and i <= limit."""
    acc = float64(0.0)
    for i in range(tid, z.shape[0], BLOCK):
        if math.isnan(z[i]):
            continue
        ki = _order_key(zbits[i]) if ranked else int64(0)
        if ki > key or (ki == key and i <= limit):
            if by_mass:
                acc += math.exp((float64(z[i]) - top) * inv_t)
            else:
                acc += 1.0
    return block_sum(red, acc, tid)


@cuda.jit(device=True)
def _prefix(z, zbits, ranked, top, inv_t, by_mass, target, strict, red, tid, bound):
    """The shortest prefix of the order above whose measure reaches target (>= target, or
    > target when strict) -> bound[0] = its last token's key, bound[1] = its id. Bisection on
    the key (32 steps over the float bits), then on the id among tokens of that key."""
    n = z.shape[0]
    lo = int64(-(1 << 31)) - 1  # the largest key known to reach the target: everything
    hi = int64(1 << 31)         # the smallest key known not to
    if not ranked:  # every key is 0
        lo, hi = int64(0), int64(1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        # the tokens of key >= mid: key > mid - 1 (limit -1 admits no tie)
        m = _measure(z, zbits, ranked, top, inv_t, by_mass, mid - 1, -1, red, tid)
        if m > target or (not strict and m == target):
            lo = mid
        else:
            hi = mid
    key = lo
    ilo = int64(-1)   # the largest id known not to reach the target
    ihi = int64(n - 1)
    while ihi - ilo > 1:
        mid = (ilo + ihi) // 2
        m = _measure(z, zbits, ranked, top, inv_t, by_mass, key, mid, red, tid)
        if m > target or (not strict and m == target):
            ihi = mid
        else:
            ilo = mid
    if tid == 0:
        bound[0] = key
        bound[1] = ihi
    cuda.syncthreads()


@cuda.jit
def sample(z, zbits, temperature, top_k, top_p, u, out):
    """out[0] = the token generate.sample draws for uniform u: temperature, then top-k, then
    top-p over the order (value descending, id ascending), then the first token whose
    cumulative weight exceeds u times the kept weight. z [V] float32 with zbits its int32
    view; one block. Weights as generate.candidates: exp((z - max) / T) in float64; when
    nothing trims by rank, the draw walks the tokens in id order, as candidates does."""
    tid = cuda.threadIdx.x
    red = cuda.shared.array(BLOCK, float64)
    red32 = cuda.shared.array(BLOCK, float32)
    bound = cuda.shared.array(2, int64)
    n = z.shape[0]
    best = float32(-math.inf)
    for i in range(tid, n, BLOCK):
        if not math.isnan(z[i]):
            best = max(best, z[i])
    top = float64(block_max(red32, best, tid))
    inv_t = 1.0 / float64(temperature)
    key = int64(-(1 << 31)) - 1  # no bound yet: every token
    limit = int64(n - 1)
    ranked = 0 < top_k < n or top_p < 1.0
    if 0 < top_k < n:
        _prefix(z, zbits, ranked, top, inv_t, False, float64(top_k), False, red, tid, bound)
        key = bound[0]
        limit = bound[1]
    kept = _measure(z, zbits, ranked, top, inv_t, True, key, limit, red, tid)
    if top_p < 1.0:
        _prefix(z, zbits, ranked, top, inv_t, True, float64(top_p) * kept, False, red, tid, bound)
        key = bound[0]
        limit = bound[1]
        kept = _measure(z, zbits, ranked, top, inv_t, True, key, limit, red, tid)
    _prefix(z, zbits, ranked, top, inv_t, True, u * kept, True, red, tid, bound)
    if tid == 0:
        out[0] = bound[1]


@cuda.jit
def uniform(states, out):
    """out[0] = the next uniform [0, 1) number of the xoroshiro128+ stream states[0]."""
    if cuda.grid(1) == 0:
        out[0] = xoroshiro128p_uniform_float64(states, 0)
