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

from .ops import expf
from .tasks import run_tasks, split

# Bytes of scores one task holds at a time. A few MB stays in L2/L3 while exp and the value
# product read it back, and bounds a prompt's attention memory whatever its length.
SCORE_BLOCK_BYTES = 4 << 20
MIN_BLOCK, MAX_BLOCK = 64, 2048
QUERY_TILE = 128  # queries per causal_attention task


class OnlineSoftmax:
    """Running max m, denominator l and weighted value sum acc for rows of queries; fed blocks
    of scores (-inf where a key is not visible) and their values, it ends with softmax(S) V
    without ever holding all of S."""

    def __init__(self, rows: tuple, dv: int):
        self.m = np.full(rows + (1,), -np.inf, np.float32)
        self.l = np.zeros(rows + (1,), np.float32)
        self.acc = np.zeros(rows + (dv,), np.float32)

    def update(self, s: np.ndarray, v: np.ndarray) -> None:
        """s [..., rows, b] (overwritten with its exps), v [..., b, Dv]."""
        s = np.ascontiguousarray(s)
        c = np.empty_like(self.m)
        _exp_block(s.reshape(-1, s.shape[-1]), s.max(axis=-1).reshape(-1), self.m.reshape(-1), self.l.reshape(-1),
                   c.reshape(-1))
        self.acc = self.acc * c + np.matmul(s, v)

    def result(self) -> np.ndarray:
        return self.acc / self.l


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract", "nsz"}, error_model="numpy")
def _exp_block(s, block_max, m, l, c):
    """One block of the online softmax, in one pass over its scores after numpy's row max
    (numpy took three more: subtract, exp, sum; with them the softmax was ~40% of a prefill
    task at ~2000 tokens, now ~25%): each row's running max m rises to cover the block, the
    scores become exp(s - m), the running denominator l takes their sum, and c gets
    exp(old m - new m), the factor the value sum held so far must take. -inf scores (keys a
    query does not see) give 0, and a row with nothing visible yet keeps m = -inf. nogil:
    the tasks run on Python threads (tasks.py)."""
    for i in range(s.shape[0]):
        top = max(m[i], block_max[i])
        base = top if top > -np.inf else np.float32(0.0)
        c[i] = expf(m[i] - base) if m[i] > -np.inf else np.float32(0.0)
        total = np.float32(0.0)
        for j in range(s.shape[1]):
            x = s[i, j]
            e = expf(x - base) if x > -np.inf else np.float32(0.0)
            s[i, j] = e
            total += e
        l[i] = l[i] * c[i] + total
        m[i] = top


def key_block(rows: int) -> int:
    """Keys per block so that `rows` score rows of float32 fit SCORE_BLOCK_BYTES."""
    return int(min(MAX_BLOCK, max(MIN_BLOCK, SCORE_BLOCK_BYTES // (4 * max(rows, 1)))))


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
        seen = pos0 + i0 + 1                                                   # keys every query of the tile sees
        last = pos0 + i1                                                       # keys some query of it sees
        b = key_block(G * Lt)
        acc = OnlineSoftmax((G * Lt,), Dv)
        # The keys all of the tile's queries see, in blocks with no mask; then the < Lt keys on
        # the diagonal, masked. (Masking whole blocks cost more than their products did: a
        # boolean store over every score of a ~2000-token prompt.)
        blocks = [(n0, min(seen, n0 + b)) for n0 in range(0, seen, b)] + ([(seen, last)] if last > seen else [])
        for n0, n1 in blocks:
            s = qt @ k[h, n0:n1].T                                             # [G*Lt, n1 - n0]
            if n1 > seen:  # the diagonal: key n is in the future of query i when n > pos0 + i
                future = np.arange(n0, n1)[None, :] > (pos0 + np.arange(i0, i1))[:, None]  # [Lt, n1 - n0]
                s.reshape(G, Lt, -1)[:, future] = -np.inf
            acc.update(s, v[h, n0:n1])
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
