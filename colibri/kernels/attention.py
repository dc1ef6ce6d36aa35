"""Prefill attention over the keys in blocks with an online softmax (flash attention's
recurrence, Dao et al. 2022), in numpy + BLAS: a block of scores exists at a time, so a prompt's
attention memory is O(queries x block) per head instead of O(queries x context); the work is
spread over a few Python threads (BLAS calls and large ufuncs release the GIL).

Decode attention (one query) is ops.attend_one; these serve chunks of prompt tokens and MLA.
Reference: a full softmax over the whole score matrix (tests/kernels/test_attention.py).

Shape letters: L queries, N keys, KV key heads, G = H // KV query heads per key head, P heads
in one task, b keys in one block.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from colibri import workspace
from colibri.workspace import MAX_BLOCK, MIN_BLOCK, SCORE_BLOCK_BYTES

from .ops import expf
from .tasks import run_tasks, split

# Score blocks: colibri/workspace.py (SCORE_BLOCK_BYTES, key_block), which the planner reads too.
QUERY_TILE = 128  # queries per causal_attention task


def seen_rows(visible: np.ndarray, *rows: np.ndarray) -> tuple:
    """One query's visible [1, N] and the key/value arrays [N, ...] it masks, cut to the rows
    it sees where that is at most half of them (a sparse attention's top-k at a context past
    twice k), else as they are: scoring and summing only those is the same attention (a
    masked row weighs exp(-inf) = 0) for N / k times less work, which is what a sparse layer
    is for. The models take this path for every one-query pass alike (decode, and each row of
    a batch or a draft, which they run one by one), so those keep giving the same bits."""
    seen = seen_index(visible)
    if seen is None:
        return (visible, *rows)
    return (np.ones((1, seen.size), bool), *(r[seen] for r in rows))


def seen_index(visible: np.ndarray) -> np.ndarray | None:
    """seen_rows' rule: the indices of the rows one query sees (visible [1, N]) where they are at
    most half of them, else None (the rows stay as they are)."""
    seen = np.flatnonzero(visible[0])
    return seen if 2 * seen.size <= visible.shape[1] else None


class OnlineSoftmax:
    """Running max m, denominator l and weighted value sum acc for rows of queries; fed blocks
    of scores (-inf where a key is not visible) and their values, it ends with softmax(S) V
    without ever holding all of S."""

    def __init__(self, rows: tuple, dv: int):
        self.m = np.full(rows + (1,), -np.inf, np.float32)
        self.l = np.zeros(rows + (1,), np.float32)
        self.acc = np.zeros(rows + (dv,), np.float32)

    def update(self, s: np.ndarray, v: np.ndarray, visible0: int | None = None, period: int = 1) -> None:
        """s [..., rows, b] (overwritten with its exps), v [..., b, Dv]. Scores may be -inf
        where a key is not visible; or, for a causal block, row r (rows flattened) sees only
        its first visible0 + r % period keys, the rest taken as -inf without being written
        (visible0=None: every key)."""
        s = np.ascontiguousarray(s)
        c = np.empty_like(self.m)
        b = s.shape[-1]
        _exp_block(s.reshape(-1, b), b if visible0 is None else visible0, 1 if visible0 is None else period,
                   self.m.reshape(-1), self.l.reshape(-1), c.reshape(-1))
        if v.ndim == 2:  # one value matrix for every head (MLA's latent): one GEMM, v read once
            pv = (s.reshape(-1, b) @ v).reshape(s.shape[:-1] + v.shape[-1:])
        else:
            pv = np.matmul(s, v)
        self.acc *= c  # in place: the same two roundings as acc * c + pv
        self.acc += pv

    def result(self) -> np.ndarray:
        return self.acc / self.l


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "nnan"}, error_model="numpy")
def _exp_block(s, visible0, period, m, l, c):
    """One block of the online softmax in two passes over each row of scores, the row's max
    then its exps (numpy's max, a boolean mask of the diagonal block and three more passes,
    subtract, exp and sum, were 40% of a ~2000-token prefill's attention): each row's running
    max m rises to cover the block, its visible scores become exp(s - m) and the rest 0, the
    running denominator l takes their sum, and c gets exp(old m - new m), the factor the value
    sum held so far must take. Row i sees its first visible0 + i % period scores (a causal
    block; pass the block's width for all), and -inf scores (keys a mask hides) give 0; a
    row with nothing visible yet keeps m = -inf. nogil: the tasks run on Python threads
    (tasks.py)."""
    b = s.shape[1]
    lanes = np.empty(16, np.float32)
    for i in range(s.shape[0]):
        n = min(b, max(0, visible0 + i % period))
        top = max(m[i], _row_max(s[i], n, lanes))
        base = top if top > -np.inf else np.float32(0.0)
        c[i] = expf(m[i] - base) if m[i] > -np.inf else np.float32(0.0)
        total = np.float32(0.0)
        for j in range(n):
            x = s[i, j]
            e = expf(x - base) if x > -np.inf else np.float32(0.0)
            s[i, j] = e
            total += e
        for j in range(n, b):
            s[i, j] = np.float32(0.0)
        l[i] = l[i] * c[i] + total
        m[i] = top


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz", "nnan"}, error_model="numpy")
def _row_max(row, n, lanes):
    """max(row[:n]) (-inf for n = 0), in 16 running maxima that LLVM keeps in one vector
    register: a plain max loop is a serial chain of compares, 5x slower than numpy's max."""
    lanes[:] = -np.inf
    n16 = n - n % 16
    for j in range(0, n16, 16):
        for u in range(16):
            x = row[j + u]
            lanes[u] = x if x > lanes[u] else lanes[u]
    top = np.float32(-np.inf)
    for u in range(16):
        top = lanes[u] if lanes[u] > top else top
    for j in range(n16, n):
        top = row[j] if row[j] > top else top
    return top


def key_block(rows: int) -> int:
    """Keys per block so that `rows` score rows of float32 fit SCORE_BLOCK_BYTES (this module's,
    which tests lower to force many blocks; colibri.workspace.key_block is the rule)."""
    return workspace.key_block(rows, SCORE_BLOCK_BYTES, MIN_BLOCK, MAX_BLOCK)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos0: int, scale: np.float32,
                     nthreads: int = 1) -> np.ndarray:
    """Causal GQA softmax attention. q [L, H, Dk]; k [KV, N, Dk]; v [KV, N, Dv] with
    N >= pos0 + L -> [L, H*Dv]. Query i sits at position pos0 + i and sees keys 0 .. pos0 + i.

    One task is a key head and a range of queries (its G query heads stacked as rows), so each
    task's keys are read once per block for all its rows."""
    L, H, Dk = q.shape
    KV, _, Dv = v.shape
    G = H // KV
    qg = np.ascontiguousarray(q.reshape(L, KV, G, Dk).transpose(1, 2, 0, 3))  # [KV, G, L, Dk]
    qg *= scale  # once here, not on every block of scores
    # Query tiles of a fixed size, never sized by the thread count: the tile decides the score
    # blocks (key_block) and the BLAS shapes, hence the rounding, and the engine's thread
    # count follows the machine's load (threads.py), so a tile per thread made the same prompt
    # give different last bits from run to run. 128 queries (G * 128 rows per product) beat 64
    # by 15% at ~2000 tokens (SmolLM2, 2 cores); a 512-token chunk still makes 4 tasks per key
    # head.
    tiles = split(L, math.ceil(L / QUERY_TILE))
    out = np.empty((KV, G, L, Dv), np.float32)

    def task(t):
        h, (i0, i1) = t
        Lt = i1 - i0
        qt = qg[h, :, i0:i1].reshape(G * Lt, Dk)                               # [G*Lt, Dk]
        last = pos0 + i1                                                       # keys the tile's last query sees
        b = key_block(G * Lt)
        acc = OnlineSoftmax((G * Lt,), Dv)
        for n0 in range(0, last, b):
            n1 = min(last, n0 + b)
            s = qt @ k[h, n0:n1].T                                             # [G*Lt, n1 - n0]
            # Query i0 + i sees the keys up to pos0 + i0 + i: the first pos0 + i0 + 1 - n0 + i
            # of this block (all of it but on the diagonal; the mask costs no pass of its own).
            acc.update(s, v[h, n0:n1], visible0=pos0 + i0 + 1 - n0, period=Lt)
        out[h, :, i0:i1] = acc.result().reshape(G, Lt, Dv)

    run_tasks(task, [(h, t) for h in range(KV) for t in tiles], nthreads)
    return out.transpose(2, 0, 1, 3).reshape(L, H * Dv)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, scale) -> np.ndarray:
    """The plain form the blockwise kernels are tested against: q [P, L, Dk], k [P, N, Dk],
    v [P, N, Dv], visible [L, N] -> softmax(q k^T * scale, masked) v  [P, L, Dv]."""
    s = np.matmul(q, k.transpose(0, 2, 1)) * np.float32(scale)
    s = np.where(visible[None], s, np.float32(-np.inf))
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.matmul((p / p.sum(axis=-1, keepdims=True)).astype(np.float32), v)
