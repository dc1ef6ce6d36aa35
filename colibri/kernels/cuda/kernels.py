"""The @cuda.jit kernels: quantized matrix products (every scheme of formats/qtensor.py, f32 activations
or int8 ones), RMSNorm, RoPE, SiLU-gated product, GQA attention over a KV cache, MLA's
absorbed attention over its latent cache (sampling.py: argmax and sampling). Each mirrors a
CPU kernel (cpu/, gemm.py, idot.py, ops.py) and is tested against the same numpy
references (tests/kernels/test_cuda.py, under numba's CUDA simulator when no GPU is present).

Reductions go through shared memory with __syncthreads, not warp shuffles: the simulator has
no shuffle, and the same code then runs everywhere. RPW matrix rows are one group of LANES
threads (one warp on a GPU) reading consecutive 32-bit words of each, so a warp's loads are
128-byte transactions; a block holds ROWS such groups and TILE_L activation rows (prefill
reuses each unpacked weight word for TILE_L tokens).
"""
from __future__ import annotations

import math

import numpy as np
from numba import config, cuda, float32, float64, int32, int64

# The simulator runs every thread as a Python thread: few threads keep tests fast (the
# reductions still have two or three levels).
SIMULATED = bool(config.ENABLE_CUDASIM)
LANES = 4 if SIMULATED else 32        # threads per weight row (a warp; a power of two)
ROWS = 2 if SIMULATED else 8          # lane groups per block
RPW = 2 if SIMULATED else 4           # weight rows per lane group
TILE_L = 4                            # activation rows per block
TILE = RPW * TILE_L                   # one lane's partial sums (local and shared array shapes
GROUP_THREADS = ROWS * LANES          # must be plain constants, not expressions)
BLOCK = 8 if SIMULATED else 256       # threads of the one-block-per-row kernels (power of two)
ELEMENTWISE = 16 if SIMULATED else 256  # threads per block of the one-thread-per-element kernels

# 2**(i - 149) for i in 0..276: every power of two a float16 or bfloat16 value is built from
# (subnormals included), so decoding 16-bit floats is one exact multiply, no ldexp.
POW2 = np.ldexp(np.float32(1.0), np.arange(-149, 128)).astype(np.float32)


# --- reductions ---------------------------------------------------------------------------


@cuda.jit(device=True)
def _finish_tile(acc, nr, nl, red, tid, lane, r0, l0, y):
    """Sum each lane group's LANES partial sums (acc[i * TILE_L + j] for weight row r0 + i and
    activation row l0 + j) in a fixed tree and store y[l0 + j, r0 + i]. Every thread of the
    block calls it (it synchronizes)."""
    for a in range(TILE):
        red[a, tid] = acc[a]
    cuda.syncthreads()
    stride = LANES // 2
    while stride > 0:
        if lane < stride:
            for a in range(TILE):
                red[a, tid] += red[a, tid + stride]
        cuda.syncthreads()
        stride //= 2
    if lane == 0:
        for i in range(nr):
            for j in range(nl):
                y[l0 + j, r0 + i] = red[i * TILE_L + j, tid]


@cuda.jit(device=True)
def block_sum(red, value, tid):
    """The sum of `value` over the block's BLOCK threads, returned to all of them."""
    red[tid] = value
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if tid < stride:
            red[tid] += red[tid + stride]
        cuda.syncthreads()
        stride //= 2
    total = red[0]
    cuda.syncthreads()  # red is reused by the next reduction
    return total


@cuda.jit(device=True)
def block_max(red, value, tid):
    red[tid] = value
    cuda.syncthreads()
    stride = BLOCK // 2
    while stride > 0:
        if tid < stride:
            red[tid] = max(red[tid], red[tid + stride])
        cuda.syncthreads()
        stride //= 2
    top = red[0]
    cuda.syncthreads()
    return top


# --- matrix products: y [L, out] = x [L, in] @ W.T ------------------------------------------
# Launch: grid (ceil(out / (ROWS * RPW)), ceil(L / TILE_L)), block ROWS * LANES (api.linear).
# Lane group g of a block takes weight rows r0 = (block * ROWS + g) * RPW .. r0 + RPW - 1, and
# each lane walks their words together: the activations it loads serve RPW rows (at decode
# they are as many bytes as the weights: loaded once per row, they would be the bottleneck).
# Loops over rows and activation rows run to the constants RPW and TILE_L with an early break,
# so they can be unrolled and the small local arrays kept in registers.


@cuda.jit(device=True)
def _tile_origin():
    """(thread, lane, first weight row, first activation row) of this thread's tile."""
    tid = cuda.threadIdx.x
    r0 = (cuda.blockIdx.x * ROWS + tid // LANES) * RPW
    l0 = cuda.blockIdx.y * TILE_L
    return tid, tid % LANES, r0, l0


@cuda.jit
def int4_rows(q, scales, offs, coef, half, x, y):
    """int4_g64 / q4_0 / q4_1: q uint32 [out, in / 8] (the packed bytes read 4 at a time; a
    word never straddles a group since half is a multiple of 4), w = nib * s + coef * off
    (symmetric: coef = -8, off = s; q4_1: coef = 1, off = min). Byte k of a group holds
    elements k (low nibble) and k + half (high nibble). Per word: the dot of its 8 weights'
    nibbles with x and the sum of those x, then s * dot + coef * off * sum."""
    tid, lane, r0, l0 = _tile_origin()
    nr = max(0, min(RPW, q.shape[0] - r0))
    nl = min(TILE_L, x.shape[0] - l0)
    acc = cuda.local.array(TILE, float32)
    words = cuda.local.array(RPW, int64)
    xv = cuda.local.array(8, float32)  # the word's activations: elements base + b, base + half + b
    red = cuda.shared.array((TILE, GROUP_THREADS), float32)
    for a in range(TILE):
        acc[a] = float32(0.0)
    words_per_group = half // 4
    for wi in range(lane, q.shape[1] if nr > 0 else 0, LANES):
        g = wi // words_per_group
        base = g * 2 * half + (wi - g * words_per_group) * 4
        for i in range(RPW):
            if i >= nr:
                break
            words[i] = q[r0 + i, wi]
        for j in range(TILE_L):
            if j >= nl:
                break
            xsum = float32(0.0)
            for b in range(4):
                xv[b] = x[l0 + j, base + b]
                xv[4 + b] = x[l0 + j, base + half + b]
                xsum += xv[b] + xv[4 + b]
            for i in range(RPW):
                if i >= nr:
                    break
                word = words[i]
                dot = float32(0.0)
                for b in range(4):
                    byte = (word >> (8 * b)) & 0xFF
                    dot += float32(byte & 0xF) * xv[b] + float32(byte >> 4) * xv[4 + b]
                acc[i * TILE_L + j] += scales[r0 + i, g] * dot + coef * offs[r0 + i, g] * xsum
    _finish_tile(acc, nr, nl, red, tid, lane, r0, l0, y)


def _element_rows(value):
    """A matrix-product kernel for weights read one element at a time: value(w, aux, param,
    r, k) gives the float32 W[r, k] (f32, f16/bf16 bits, q8_0). Consecutive lanes read
    consecutive elements."""

    @cuda.jit
    def kernel(w, aux, param, x, y):
        tid, lane, r0, l0 = _tile_origin()
        nr = max(0, min(RPW, w.shape[0] - r0))
        nl = min(TILE_L, x.shape[0] - l0)
        acc = cuda.local.array(TILE, float32)
        wv = cuda.local.array(RPW, float32)
        red = cuda.shared.array((TILE, GROUP_THREADS), float32)
        for a in range(TILE):
            acc[a] = float32(0.0)
        for k in range(lane, w.shape[1] if nr > 0 else 0, LANES):
            for i in range(RPW):
                if i >= nr:
                    break
                wv[i] = value(w, aux, param, r0 + i, k)
            for j in range(TILE_L):
                if j >= nl:
                    break
                xv = x[l0 + j, k]
                for i in range(RPW):
                    if i >= nr:
                        break
                    acc[i * TILE_L + j] += wv[i] * xv
        _finish_tile(acc, nr, nl, red, tid, lane, r0, l0, y)

    return kernel


@cuda.jit(device=True)
def _f32_value(w, aux, param, r, k):
    return w[r, k]


@cuda.jit(device=True)
def half_bits_to_f32(h, is_bf16, pow2):
    """Raw float16 (is_bf16 = 0) or bfloat16 (1) bits -> float32, exactly (pow2 = POW2)."""
    if is_bf16:
        e = (h >> 7) & 0xFF
        m = h & 0x7F
        if e == 0xFF:
            v = float32(math.inf) if m == 0 else float32(math.nan)
        elif e == 0:
            v = float32(m) * pow2[149 - 133]
        else:
            v = float32(m + 128) * pow2[e + 149 - 134]
        sign = (h >> 15) & 1
    else:
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        if e == 0x1F:
            v = float32(math.inf) if m == 0 else float32(math.nan)
        elif e == 0:
            v = float32(m) * pow2[149 - 24]
        else:
            v = float32(m + 1024) * pow2[e + 149 - 25]
        sign = (h >> 15) & 1
    return -v if sign else v


@cuda.jit(device=True)
def _u16_value(w, aux, param, r, k):
    return half_bits_to_f32(w[r, k], param, aux)


@cuda.jit(device=True)
def _q8_value(w, aux, param, r, k):
    return float32(w[r, k]) * aux[r, k // param]


f32_rows = _element_rows(_f32_value)
u16_rows = _element_rows(_u16_value)   # aux = POW2 on the device, param = is_bf16
q8_rows = _element_rows(_q8_value)     # aux = scales, param = group


# --- int8 activations (idot.py's opt-in path) ---------------------------------------------


@cuda.jit(device=True)
def _rint(v):
    """Round half to even (numpy's round, which idot.quantize_into uses); exact for |v| < 2**22."""
    r = math.floor(v)
    d = v - r
    if d > 0.5 or (d == 0.5 and r % 2 != 0):
        r += 1
    return r


@cuda.jit
def quantize_groups(x, group, xq, sx):
    """x [L, n] -> xq int8 [L, n], sx float32 [L, n / group]: per group s = max|x| / 127,
    xq = round(x / s) (idot.quantize_into's numbers). A non-finite x makes its group's scale
    NaN, so the product is NaN (the engine's non-finite guard sees it). One thread per group."""
    i = cuda.grid(1)
    ng = x.shape[1] // group
    if i < x.shape[0] * ng:
        l = i // ng
        g = i - l * ng
        x0 = g * group
        amax = float32(0.0)
        finite = True
        for k in range(group):
            v = x[l, x0 + k]
            if math.isnan(v) or math.isinf(v):
                finite = False
            amax = max(amax, abs(v))
        inv = float32(127.0) / amax if finite and amax > 0 else float32(0.0)
        for k in range(group):
            xq[l, x0 + k] = _rint(x[l, x0 + k] * inv) if finite else 0
        sx[l, g] = amax / float32(127.0) if finite else float32(math.nan)


@cuda.jit
def rounded_groups(xq, sx, group, out):
    """out [L, n] = xq * the group's sx: the activations as quantize_groups rounded them, for
    the weights whose int8-activation product is the float kernel on them (q8_0: the q8_0
    rows of the CPU's idot path are the dot with these values). One thread per element."""
    i = cuda.grid(1)
    n = xq.shape[1]
    if i < xq.shape[0] * n:
        l = i // n
        c = i - l * n
        out[l, c] = float32(xq[l, c]) * sx[l, c // group]


@cuda.jit
def int4_idot_rows(q, scales, offs, symmetric, half, xq, sx, y):
    """int4 weights times int8 activations, integer sums per 4-byte word: symmetric schemes
    sum (nib - 8) * xq, q4_1 sums nib * xq plus min * sum(xq); one float scale per word
    (w_scale * x_scale). Same launch and q layout as int4_rows. (On a GPU this is where
    dp4a would go; numba exposes no dp4a, and the integer multiply-adds are cheap next to the
    weight reads.)"""
    tid, lane, r0, l0 = _tile_origin()
    nr = max(0, min(RPW, q.shape[0] - r0))
    nl = min(TILE_L, xq.shape[0] - l0)
    acc = cuda.local.array(TILE, float32)
    words = cuda.local.array(RPW, int64)
    xv = cuda.local.array(8, int32)  # the word's activations, as in int4_rows
    red = cuda.shared.array((TILE, GROUP_THREADS), float32)
    for a in range(TILE):
        acc[a] = float32(0.0)
    words_per_group = half // 4
    for wi in range(lane, q.shape[1] if nr > 0 else 0, LANES):
        g = wi // words_per_group
        base = g * 2 * half + (wi - g * words_per_group) * 4
        for i in range(RPW):
            if i >= nr:
                break
            words[i] = q[r0 + i, wi]
        for j in range(TILE_L):
            if j >= nl:
                break
            qsum = int32(0)
            for b in range(4):
                xv[b] = int32(xq[l0 + j, base + b])
                xv[4 + b] = int32(xq[l0 + j, base + half + b])
                qsum += xv[b] + xv[4 + b]
            sxg = sx[l0 + j, g]
            for i in range(RPW):
                if i >= nr:
                    break
                word = words[i]
                isum = int32(0)
                for b in range(4):
                    byte = (word >> (8 * b)) & 0xFF
                    isum += int32(byte & 0xF) * xv[b] + int32(byte >> 4) * xv[4 + b]
                if symmetric:
                    acc[i * TILE_L + j] += scales[r0 + i, g] * sxg * float32(isum - 8 * qsum)
                else:
                    acc[i * TILE_L + j] += (scales[r0 + i, g] * sxg * float32(isum)
                                            + offs[r0 + i, g] * sxg * float32(qsum))
    _finish_tile(acc, nr, nl, red, tid, lane, r0, l0, y)


# --- glue ---------------------------------------------------------------------------------


@cuda.jit
def rms_norm(x, w, eps, out):
    """x [L, D] -> w * x / sqrt(mean(x^2) + eps), one block per row; the sum of squares in
    float64 and the rest exactly as ops.rms_norm."""
    i = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    red = cuda.shared.array(BLOCK, float64)
    D = x.shape[1]
    acc = float64(0.0)
    for j in range(tid, D, BLOCK):
        v = float64(x[i, j])
        acc += v * v
    acc = block_sum(red, acc, tid)
    inv = float32(1.0 / math.sqrt(float64(float32(acc / D) + eps)))
    for j in range(tid, D, BLOCK):
        out[i, j] = w[j] * (x[i, j] * inv)


@cuda.jit
def head_rms_norm(x, col0, Dh, w, eps):
    """In place, the rms_norm of each head of Dh columns from col0 of x [L, width] (a fused
    q/k/v output): grid (heads, L), one block per head and row. q/k norms: Qwen3's over each
    head (w [Dh]), OLMoE's over all heads of q or k at once (one "head" of H * Dh, w [H * Dh])."""
    h = cuda.blockIdx.x
    i = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    red = cuda.shared.array(BLOCK, float64)
    c0 = col0 + h * Dh
    acc = float64(0.0)
    for j in range(tid, Dh, BLOCK):
        v = float64(x[i, c0 + j])
        acc += v * v
    acc = block_sum(red, acc, tid)
    inv = float32(1.0 / math.sqrt(float64(float32(acc / Dh) + eps)))
    for j in range(tid, Dh, BLOCK):  # each thread rewrites only the columns it read
        x[i, c0 + j] = w[j] * (x[i, c0 + j] * inv)


@cuda.jit
def rope(x, col0, H, Dh, cos, sin, rot):
    """The H heads of Dh columns from col0 of x [L, width] (a fused q/k/v output) rotated in
    place on their first rot dims (rotate_half pairs (j, j + rot/2)); cos/sin [L, rot]. One
    thread per pair."""
    i = cuda.grid(1)
    L = x.shape[0]
    half = rot // 2
    if i < L * H * half:
        j = i % half
        lh = i // half
        h = lh % H
        t = lh // H
        c = col0 + h * Dh + j
        a = x[t, c]
        b = x[t, c + half]
        x[t, c] = a * cos[t, j] - b * sin[t, j]
        x[t, c + half] = b * cos[t, j + half] + a * sin[t, j + half]


@cuda.jit
def rope_copy(src, col0, H, Dh, cos, sin, rot, interleaved, scale, dst):
    """dst [L, H, rot] = scale * the first rot dims of each of the H heads of Dh columns from
    col0 of src [L, width], rotated: rotate_half pairs (j, j + rot/2), or with `interleaved`
    the pairs (2j, 2j + 1) written de-interleaved (evens then odds, as models/mla.py's
    rope_interleaved). MLA's q_rope and k_rope, out of place. One thread per pair."""
    i = cuda.grid(1)
    L = src.shape[0]
    half = rot // 2
    if i < L * H * half:
        j = i % half
        lh = i // half
        h = lh % H
        t = lh // H
        c = col0 + h * Dh
        if interleaved:
            a = src[t, c + 2 * j]
            b = src[t, c + 2 * j + 1]
            dst[t, h, j] = (a * cos[t, j] - b * sin[t, j]) * scale
            dst[t, h, j + half] = (b * cos[t, j] + a * sin[t, j]) * scale
        else:
            a = src[t, c + j]
            b = src[t, c + j + half]
            dst[t, h, j] = (a * cos[t, j] - b * sin[t, j]) * scale
            dst[t, h, j + half] = (b * cos[t, j + half] + a * sin[t, j + half]) * scale


@cuda.jit
def head_matmul(a, col0, Da, w, scale, out):
    """out [L, H, N] = scale * (a_h @ w[h]) per head h, where a_h [L, K] is the K columns from
    col0 + h * Da of a [L, width] and w [H, K, N] (MLA's per-head W_uk and W_uv, float32). One
    thread per output element."""
    i = cuda.grid(1)
    L, H, N = out.shape
    K = w.shape[1]
    if i < L * H * N:
        n = i % N
        lh = i // N
        h = lh % H
        t = lh // H
        c = col0 + h * Da
        acc = float32(0.0)
        for k in range(K):
            acc += a[t, c + k] * w[h, k, n]
        out[t, h, n] = acc * scale


@cuda.jit
def silu_mul(gu, n, out):
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n]."""
    i = cuda.grid(1)
    if i < gu.shape[0] * n:
        t = i // n
        c = i - t * n
        g = gu[t, c]
        out[t, c] = g / (float32(1.0) + math.exp(-g)) * gu[t, n + c]


@cuda.jit
def add_into(x, y):
    """x [L, D] += y [L, D] (the residual stream)."""
    i = cuda.grid(1)
    if i < x.shape[0] * x.shape[1]:
        t = i // x.shape[1]
        c = i - t * x.shape[1]
        x[t, c] += y[t, c]


@cuda.jit
def fill(x, value):
    """x [L, D] = value."""
    i = cuda.grid(1)
    if i < x.shape[0] * x.shape[1]:
        x[i // x.shape[1], i % x.shape[1]] = value


@cuda.jit
def sigmoid_scale_rows(y, g):
    """y[t] *= sigmoid(g[t, 0]) for y [L, n], g [L, 1] (a shared expert's gate), as
    1 / (1 + exp(-g)) in float32 like the CPU path."""
    i = cuda.grid(1)
    n = y.shape[1]
    if i < y.shape[0] * n:
        t = i // n
        y[t, i - t * n] = (float32(1.0) / (float32(1.0) + math.exp(-g[t, 0]))) * y[t, i - t * n]


@cuda.jit
def gather_rows(x, rows, out):
    """out [n, D] = x[rows] (the tokens routed to one expert)."""
    i = cuda.grid(1)
    D = x.shape[1]
    if i < rows.shape[0] * D:
        t = i // D
        out[t, i - t * D] = x[rows[t], i - t * D]


@cuda.jit
def scatter_add_scaled(out, y, rows, scales):
    """out[rows[t]] += scales[t] * y[t] for each of the n rows of y [n, D]: one expert's weighted
    output added to the tokens that chose it (rows distinct: no two threads add to one element)."""
    i = cuda.grid(1)
    D = y.shape[1]
    if i < y.shape[0] * D:
        t = i // D
        c = i - t * D
        out[rows[t], c] += y[t, c] * scales[t]


@cuda.jit
def add_bias(y, b):
    """y [L, n] += b [n]."""
    i = cuda.grid(1)
    if i < y.shape[0] * y.shape[1]:
        t = i // y.shape[1]
        c = i - t * y.shape[1]
        y[t, c] += b[c]


@cuda.jit
def kv_store(cache, src, col0, pos0):
    """cache [KV, cap, Dh][:, pos0 + t] = src[t, col0 + h * Dh : col0 + (h + 1) * Dh] for each
    token row t of src [L, width]: the new keys or values from the fused qkv output."""
    i = cuda.grid(1)
    KV, Dh = cache.shape[0], cache.shape[2]
    if i < src.shape[0] * KV * Dh:
        d = i % Dh
        th = i // Dh
        h = th % KV
        t = th // KV
        cache[h, pos0 + t, d] = src[t, col0 + h * Dh + d]


@cuda.jit
def copy_positions(dst, src, n):
    """dst[:, :n] = src[:, :n] for caches [KV, cap, D] (growing a KV cache)."""
    i = cuda.grid(1)
    KV, D = src.shape[0], src.shape[2]
    if i < KV * n * D:
        d = i % D
        hp = i // D
        p = hp % n
        h = hp // n
        dst[h, p, d] = src[h, p, d]


# --- attention ----------------------------------------------------------------------------


@cuda.jit
def attend(q, H, k, v, pos0, scale, scores, out):
    """Causal GQA attention of L query rows at positions pos0 .. pos0 + L - 1 over the cache.
    q [L, >= H * Dk] (head h in columns h * Dk..: a fused q/k/v output); k [KV, cap, Dk];
    v [KV, cap, Dv]; scores [>= L, H, >= pos0 + L] scratch; out [L, H * Dv]. One block per
    (head, query row); query head h reads KV head h // (H / KV). softmax(q k^T * scale) v with
    the max subtracted, as attention.reference_attention."""
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    red = cuda.shared.array(BLOCK, float32)
    Dk = k.shape[2]
    Dv = v.shape[2]
    kv = h // (H // k.shape[0])
    n = pos0 + t + 1
    top = float32(-math.inf)
    for p in range(tid, n, BLOCK):
        a = float32(0.0)
        for d in range(Dk):
            a += q[t, h * Dk + d] * k[kv, p, d]
        a *= scale
        scores[t, h, p] = a
        top = max(top, a)
    top = block_max(red, top, tid)
    total = float32(0.0)
    for p in range(tid, n, BLOCK):
        e = math.exp(scores[t, h, p] - top)
        scores[t, h, p] = e
        total += e
    total = block_sum(red, total, tid)  # its barrier also publishes every thread's scores
    inv = float32(1.0) / total
    # The weighted sum of values: with Dv <= BLOCK, the block's threads form BLOCK // Dv groups
    # that each take every groups-th position for all Dv dims (consecutive threads, consecutive
    # dims: coalesced rows of v), and the groups' partial sums are added in group order.
    groups = BLOCK // Dv if Dv <= BLOCK else 1
    if groups > 1:
        gi = tid // Dv
        d = tid - gi * Dv
        acc = float32(0.0)
        if gi < groups:
            for p in range(gi, n, groups):
                acc += scores[t, h, p] * v[kv, p, d]
        red[tid] = acc
        cuda.syncthreads()
        if gi == 0:
            for g in range(1, groups):
                acc += red[g * Dv + d]
            out[t, h * Dv + d] = acc * inv
    else:
        for d in range(tid, Dv, BLOCK):
            acc = float32(0.0)
            for p in range(n):
                acc += scores[t, h, p] * v[kv, p, d]
            out[t, h * Dv + d] = acc * inv


@cuda.jit
def mla_attend(q_lat, q_rope, c, k_rope, pos0, scores, out):
    """MLA's absorbed decode attention (models/mla.py, MLAttention._absorbed): every head
    attends over the one shared latent cache, scores and output in latent space. q_lat
    [L, H, r] = q_nope W_uk * scale, q_rope [L, H, R] (already scaled); c [cap, r] latents;
    k_rope [cap, R]; scores [>= L, H, >= pos0 + L] scratch; out [L, H, r] = softmax(q_lat c^T +
    q_rope k_rope^T) c, causal (row t sees positions 0 .. pos0 + t). One block per (head, row);
    W_uv and o_proj follow as matrix products."""
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    red = cuda.shared.array(BLOCK, float32)
    r, R = c.shape[1], k_rope.shape[1]
    n = pos0 + t + 1
    top = float32(-math.inf)
    for p in range(tid, n, BLOCK):
        a = float32(0.0)
        for d in range(r):
            a += q_lat[t, h, d] * c[p, d]
        for d in range(R):
            a += q_rope[t, h, d] * k_rope[p, d]
        scores[t, h, p] = a
        top = max(top, a)
    top = block_max(red, top, tid)
    total = float32(0.0)
    for p in range(tid, n, BLOCK):
        e = math.exp(scores[t, h, p] - top)
        scores[t, h, p] = e
        total += e
    total = block_sum(red, total, tid)  # its barrier also publishes every thread's scores
    inv = float32(1.0) / total
    for d in range(tid, r, BLOCK):
        acc = float32(0.0)
        for p in range(n):
            acc += scores[t, h, p] * c[p, d]
        out[t, h, d] = acc * inv
