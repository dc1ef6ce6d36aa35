"""All routed experts of one MoE layer for one token in one compiled call (decode).

The step-by-step path (colibri.models.moe.swiglu_expert) calls a SwiGLU kernel per expert:
three parallel matvecs, so a top-8 layer enters 24 parallel regions and 8 Python calls per
token, ~1150 regions for Qwen3-30B's 48 layers; the regions are short (a 768x2048 int4
matrix is ~0.9 MB), so their start-up and the join at each end dominate on small shapes.
Here the gate and up rows of all K experts are one work list split over the threads, then
the down rows of the output are split over the threads with each row summing its K experts:
two parallel regions per layer.

The experts are addressed in place: `FusedExperts` (colibri/formats/expert_blob.py) knows where each projection's arrays sit
inside one layer's expert blob and whether the blobs' q arrays were interleaved once read
(formats/qtensor.py, Layout: the sources that read blobs into RAM do; a mapped file is as stored). It
runs the kernel over a block of blobs laid out at a fixed stride (ResidentExperts' per-layer
array, the ExpertStore's slot pool: `StackedExperts`) or over one blob anywhere (a staging
buffer, a mapped file), so nothing is copied.

Placement must change speed, never tokens. Every int4 routed expert of a decode step goes
through this one compiled function (GGUF block experts through routed_block_experts, below),
however its blob is held: a row's value depends only on its data (rows are computed 8 at a
time by the same code whatever the thread split), and the experts' contributions are added in
ascending expert id with plain float32 adds, so K experts in one call equal the same experts
one call each, summed in that order, bit for bit (tests/kernels/test_moe.py). The row code is
vector IR with a written order plus fixed-order small sums (cpu/codegen.py), so it rounds the
same in every caller; when it was fastmath numba, LLVM reassociated it differently per caller,
and CI once saw 1-ulp differences between this kernel and the matvec kernel.

`act` (colibri.kernels.idot.marker) picks the row code by its type: the exact rows above, or
int4 x int8 integer dots (`--activations int8`), x quantized once for all K experts' gate and
up rows and each expert's activation once for its down rows. Each mode is its own compiled
specialization, and every expert of a mode goes through it, so the rule above holds per mode.
GGUF block experts take `act` too: the projections of block_idot.INT8_SCHEMES (every block
type but Q5_1) get its int8 tiles, Q5_1 stays exact in int8 mode.

`glu` (ExpertActivation.for_experts) says what runs between the gate/up rows and the down rows
when it is not the plain SwiGLU: the clipped SwiGLU (DeepSeek V4, GLM-5.3-Flash) or gpt-oss's
clamped one with its alpha, and per-expert biases of the three projections (gpt-oss), added to
each row's dot product before the activation and before the router weight. The activation is
ops.expert_glu_into, the code those families' prefill runs too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from colibri.formats.expert_blob import FusedExperts, StackedExperts

from .block_idot import prepare as block_prepare
from .block_idot import prepare_rows as block_prepare_rows
from .block_idot import row_of as block_row_of
from .block_idot import rows8_into as block_rows8_into
from .cpu.blocks import ELEMENTS, NBYTES, block_scratch
from .idot import marker, prepare, prepare_rows, row_of, rows8_into
from .ops import SILU, expert_glu_into

_ONE_SLOT = np.zeros(1, np.int64)
_NO_BIAS = np.zeros((0, 0), np.float32)


@dataclass(frozen=True)
class ExpertActivation:
    """A family's routed experts beyond the plain SwiGLU: the activation (ops.SILU,
    CLIPPED_SILU, GPT_OSS) with its alpha and limit, and optional per-expert biases of the
    gate, up and down projections ([E, I], [E, I], [E, D] float32)."""

    kind: int = SILU
    alpha: float = 1.0
    limit: float = float("inf")
    biases: tuple | None = None

    def for_experts(self, ids) -> tuple:
        """The kernels' `glu` argument for the experts `ids` (in the call's slot order): the
        code, alpha, limit and those experts' bias rows (empty arrays when there are none)."""
        if self.biases is None:
            rows = (_NO_BIAS, _NO_BIAS, _NO_BIAS)
        else:
            ids = np.asarray(ids, np.int64)
            rows = tuple(np.ascontiguousarray(b[ids], dtype=np.float32) for b in self.biases)
        return (self.kind, np.float32(self.alpha), np.float32(self.limit), *rows)


PLAIN = ExpertActivation()
_PLAIN_GLU = PLAIN.for_experts([])


def fused_experts(kernel: FusedExperts, x: np.ndarray, memory: np.ndarray, slots: np.ndarray, weights: np.ndarray,
                  nthreads: int, activations: str = "f32", glu: tuple = _PLAIN_GLU) -> np.ndarray:
    """sum_k weights[k] * expert_{slots[k]}(x) for one token x [D] float32, the experts' blobs
    in `memory` [n, stride] uint8 laid out as `kernel` says; `slots` in ascending expert-id
    order (the order contributions are added in); `activations`: "f32" (exact) or "int8";
    `glu`: ExpertActivation.for_experts of the slots' experts (default: the plain SwiGLU)."""
    if kernel.blocks is not None:  # GGUF block experts (int8: the types of block_idot.INT8_SCHEMES)
        return routed_block_experts(x, memory, kernel.layout, kernel.blocks, slots, weights, nthreads,
                                    marker(activations), *glu)
    return routed_experts(x, memory, kernel.layout, slots, weights, kernel.half, kernel.cshift, nthreads,
                          marker(activations), *glu)


def stacked_experts(stacked: StackedExperts, x: np.ndarray, slots: np.ndarray, weights: np.ndarray, nthreads: int,
                    activations: str = "f32", glu: tuple = _PLAIN_GLU) -> np.ndarray:
    """fused_experts over a layer's expert blobs in place (`stacked.memory`)."""
    return fused_experts(stacked.kernel, x, stacked.memory, slots, weights, nthreads, activations, glu)


def one_expert(kernel: FusedExperts, x: np.ndarray, blob: np.ndarray, weight: float, nthreads: int,
               activations: str = "f32", glu: tuple = _PLAIN_GLU) -> np.ndarray:
    """weight * expert(x) for the expert whose blob (uint8, C-contiguous) is `blob` (`glu` for
    that one expert): the same compiled call, so summing these in expert-id order equals one
    call over all."""
    return fused_experts(kernel, x, blob.reshape(1, -1), _ONE_SLOT, np.full(1, weight, np.float32), nthreads,
                         activations, glu)


@njit(cache=True)
def _weight(memory, s, layout, p, half):
    """Projection p of the expert in slot s as the (q, scales) C-contiguous 2-D arrays the
    matvec kernel takes (the same array types, so the same compiled row code)."""
    q_off, s_off, rows, cols = layout[p, 0], layout[p, 1], layout[p, 2], layout[p, 3]
    q = memory[s, q_off: q_off + rows * (cols // 2)].reshape((rows, cols // 2))
    groups = cols // (2 * half)
    scales = memory[s, s_off: s_off + rows * groups * 4].view(np.float32).reshape((rows, groups))
    return q, scales


@njit(cache=True)
def _activations(g, u, kind, alpha, limit, gate_bias, up_bias, biased):
    """Each expert k's down-projection input from its gate and up rows g[k], u[k] [K, I]: the
    activation `kind`, after its bias rows where `biased`."""
    a = np.empty_like(g)
    none = np.zeros(0, np.float32)
    for k in range(g.shape[0]):
        if biased:
            expert_glu_into(g[k], u[k], gate_bias[k], up_bias[k], a[k], kind, alpha, limit)
        else:
            expert_glu_into(g[k], u[k], none, none, a[k], kind, alpha, limit)
    return a


@njit(parallel=True, cache=True)
def routed_experts(x, memory, layout, slots, weights, half, cshift, nthreads, act, kind, alpha, limit, gate_bias,
                   up_bias, down_bias):
    K = slots.shape[0]
    I = layout[0, 2]
    D = layout[2, 2]
    coef = np.float32(-8.0)
    # exact: x laid out for the int4 blocks, and its group sums; int8: x quantized once for all experts
    xp = prepare(x, half, act)
    g = np.empty((K, I), np.float32)
    u = np.empty((K, I), np.float32)
    # Gate and up rows of every expert: one list of (expert, 8-row block) items.
    nblk = I // 8
    items = K * nblk
    per = (items + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for it in range(t * per, min(items, (t + 1) * per)):
            k = it // nblk
            r = 8 * (it - k * nblk)
            gq, gs = _weight(memory, slots[k], layout, 0, half)
            rows8_into(gq, gs, gs, coef, half, cshift, layout[0, 4], x, xp, r, d, act)
            for j in range(8):
                g[k, r + j] = d[j]
            uq, us = _weight(memory, slots[k], layout, 1, half)
            rows8_into(uq, us, us, coef, half, cshift, layout[1, 4], x, xp, r, d, act)
            for j in range(8):
                u[k, r + j] = d[j]
    biased = down_bias.shape[0] != 0
    a = _activations(g, u, kind, alpha, limit, gate_bias, up_bias, biased)
    ap = prepare_rows(a, half, act)
    # Down rows: each thread owns a run of output rows and adds the experts' contributions to
    # them one expert after another, in ascending expert id (a product, then a sum: this
    # function is compiled without fastmath, so no FMA). Expert-major order streams each
    # expert's rows front to back, which the row kernel's prefetch of the next block covers.
    out = np.zeros(D, np.float32)
    nblk = D // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        d = np.empty(8, np.float32)
        for k in range(K):
            dq, ds = _weight(memory, slots[k], layout, 2, half)
            w = weights[k]
            apk = row_of(ap, k, act)
            for blk in range(t * per, min(nblk, (t + 1) * per)):
                r = 8 * blk
                rows8_into(dq, ds, ds, coef, half, cshift, layout[2, 4], a[k], apk, r, d, act)
                if biased:
                    for j in range(8):
                        out[r + j] += (d[j] + down_bias[k, r + j]) * w
                else:
                    for j in range(8):
                        out[r + j] += d[j] * w
    return out


# --- GGUF block experts (kernels/cpu/blocks.py) --------------------------------------------
# The same two regions, each projection of its own block type (layout row p, type tcs[p]), rows
# through block_idot.rows8_into: in act's mode, the exact tiles matvec uses (blocks.block_rows8)
# or the int8 ones (block_idot.py; a type without one runs exactly), so a row's bits depend on
# its data only, and the experts' down contributions are added in ascending expert id. In int8
# mode x is quantized once for all K experts' gate and up rows, each expert's activation once
# for its down rows.


@njit(cache=True)
def _block_weight(memory, s, layout, tcs, p):
    """Projection p of the expert in slot s: its rows of GGUF blocks, uint8 [rows, row bytes]
    (C-contiguous 2-D, the array type matvec's kernels take)."""
    off, rows, cols = layout[p, 0], layout[p, 2], layout[p, 3]
    rb = cols // ELEMENTS[tcs[p]] * NBYTES[tcs[p]]
    return memory[s, off: off + rows * rb].reshape((rows, rb))


@njit(parallel=True, cache=True)
def routed_block_experts(x, memory, layout, tcs, slots, weights, nthreads, act, kind, alpha, limit, gate_bias,
                         up_bias, down_bias):
    K = slots.shape[0]
    I = layout[0, 2]
    D = layout[2, 2]
    xp_g = block_prepare(tcs[0], x, act)
    xp_u = xp_g if tcs[1] == tcs[0] else block_prepare(tcs[1], x, act)  # (laid out per type)
    g = np.empty((K, I), np.float32)
    u = np.empty((K, I), np.float32)
    nblk = (I + 7) // 8
    items = K * nblk
    per = (items + nthreads - 1) // nthreads
    for t in prange(nthreads):
        codes, sc, of = block_scratch(x.shape[0])
        d = np.empty(8, np.float32)
        for it in range(t * per, min(items, (t + 1) * per)):
            k = it // nblk
            r = 8 * (it - k * nblk)
            gq = _block_weight(memory, slots[k], layout, tcs, 0)
            block_rows8_into(tcs[0], gq, r, x, xp_g, codes, sc, of, d, act)
            for j in range(min(8, I - r)):
                g[k, r + j] = d[j]
            uq = _block_weight(memory, slots[k], layout, tcs, 1)
            block_rows8_into(tcs[1], uq, r, x, xp_u, codes, sc, of, d, act)
            for j in range(min(8, I - r)):
                u[k, r + j] = d[j]
    biased = down_bias.shape[0] != 0
    a = _activations(g, u, kind, alpha, limit, gate_bias, up_bias, biased)
    xp_d = block_prepare_rows(tcs[2], a, act)
    out = np.zeros(D, np.float32)
    nblk = (D + 7) // 8
    per = (nblk + nthreads - 1) // nthreads
    for t in prange(nthreads):
        codes, sc, of = block_scratch(I)
        d = np.empty(8, np.float32)
        for k in range(K):
            dq = _block_weight(memory, slots[k], layout, tcs, 2)
            w = weights[k]
            apk = block_row_of(xp_d, k, act)
            for blk in range(t * per, min(nblk, (t + 1) * per)):
                r = 8 * blk
                block_rows8_into(tcs[2], dq, r, a[k], apk, codes, sc, of, d, act)
                if biased:
                    for j in range(min(8, D - r)):
                        out[r + j] += (d[j] + down_bias[k, r + j]) * w
                else:
                    for j in range(min(8, D - r)):
                        out[r + j] += d[j] * w
    return out
