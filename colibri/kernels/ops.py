"""Small fused numba kernels for the decode step's glue: RMSNorm, RoPE, one-query attention
over the KV cache, SiLU-gated product. Each replaces 5-15 numpy calls whose per-call overhead
(~1-3 us each, x 30 layers) was a large share of a small model's decode step. Sums accumulate
in float64, so results stay within float32 rounding of the numpy references in
tests/kernels/test_ops.py (which follow transformers' formulas)."""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


@intrinsic
def _pow2i(typingctx, n):
    """int32 n in [-127, 127] -> float32 2**n through the exponent bits (n = -127 gives 0)."""
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(args[0], ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())
    return types.float32(types.int32), codegen


@njit(cache=True, inline="always", fastmath={"contract"})
def expf(x):
    """float32 exp within 1 ulp of the exact value on [-87, 88] (inputs are clamped there).

    numba's math.exp is a libm call per element, so loops around it stay scalar (the softmax
    of decode attention and SiLU spent most of their time there); this is straight-line
    arithmetic that LLVM vectorizes. Cephes' expf: x = n ln2 + r with ln2 split in two
    for an exact reduction, a degree-7 polynomial for e^r, and 2^n built in the exponent.
    """
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))  # float32, not int
    r = x - n * np.float32(0.693359375) + n * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _pow2i(np.int32(n))


@njit(cache=True)
def rms_norm(x, w, eps):
    """x [L, D] float32 -> w * x / sqrt(mean(x^2) + eps), row by row."""
    out = np.empty_like(x)
    rms_norm_into(x, w, eps, out)
    return out


@njit(cache=True, nogil=True)
def rms_norm_into(x, w, eps, out):
    """rms_norm into out [L, D]; nogil, so a prompt's rows can be split over Python threads."""
    L, D = x.shape
    for i in range(L):
        acc = 0.0
        for j in range(D):
            v = np.float64(x[i, j])
            acc += v * v
        inv = np.float32(1.0 / math.sqrt(np.float32(acc / D) + eps))
        for j in range(D):
            out[i, j] = w[j] * (x[i, j] * inv)


@njit(cache=True, nogil=True)
def rope(x, cos, sin, rot):
    """x [L, H, Dh] float32, rotated in place on its first `rot` dims (rotate_half convention:
    pairs (j, j + rot/2)); cos/sin [L, rot]."""
    L, H, _ = x.shape
    half = rot // 2
    for i in range(L):
        for h in range(H):
            for j in range(half):
                a = x[i, h, j]
                b = x[i, h, j + half]
                x[i, h, j] = a * cos[i, j] - b * sin[i, j]
                x[i, h, j + half] = b * cos[i, j + half] + a * sin[i, j + half]


# Keys per work item of decode attention. Fixed (not derived from the thread count), so the
# chunked softmax below sums in the same order with any number of threads.
ATTEND_CHUNK = 128


# Decode attention streams the whole KV cache once per token (at 8k of context, SmolLM2's is
# 377 MB of float32 against 112 MB of weights), so its loops are written for the memory: keys
# go 16 at a time through two LLVM IR intrinsics, and K and V of the same 16 keys are read
# together under an online softmax rather than in two passes over the chunk. Both intrinsics
# read their 16 rows row by row, in address order, with no software prefetch: the hardware
# prefetcher then runs ahead of the arithmetic. Read column block by column block (16 floats
# of each of the 16 rows, then the next 16), the same bytes came at half the rate, and
# prefetching the next 16 rows by hand only partly made up for it (the kernel alone at
# SmolLM2's shapes, 8k of context, 2 threads: 22.2-22.7 -> 12.7 ms a token, 17 -> 30 GB/s;
# bench/kernels/decode_attention.py --baseline). Scores come out as one 16-lane vector per head by a
# transposed tree of shuffles instead of a horizontal sum per key.
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_I16 = ir.IntType(16)
_V16F = ir.VectorType(_F32, 16)
_ROWS = 16  # keys per step of the intrinsics


def _c64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _v16_ptr(builder, base, offset):
    return builder.bitcast(builder.gep(base, [offset]), _V16F.as_pointer())


def _elements(builder, ary, dtype):
    """The data pointer of a float32 array, or of a float16 cache (its bits held as uint16:
    numba has no float16)."""
    return builder.bitcast(ary.data, (_I16 if dtype == types.uint16 else _F32).as_pointer())


def _load16(builder, base, offset, dtype):
    """16 floats from base + offset (elements): float32, or float16 widened (vcvtph2ps)."""
    if dtype != types.uint16:
        return builder.load(_v16_ptr(builder, base, offset), align=4)
    halves = builder.load(builder.bitcast(builder.gep(base, [offset]), ir.VectorType(_I16, 16).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(halves, ir.VectorType(ir.HalfType(), 16)), _V16F)


def _splat16(builder, value):
    v = builder.insert_element(ir.Constant(_V16F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_V16F, ir.Undefined), ir.Constant(ir.VectorType(_I32, 16), [0] * 16))


def _cache_rows(builder, ary, dtype, kv, t):
    """Pointer to row t of KV head kv of a [KV, capacity, D] cache array, and D."""
    cap, width = cgutils.unpack_tuple(builder, ary.shape, 3)[1:]
    rows = builder.gep(_elements(builder, ary, dtype), [builder.mul(builder.add(builder.mul(kv, cap), t), width)])
    return rows, width


def _fma16(builder):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fmuladd.v16f32")


def _transposed_sums(builder, vs):
    """16 vectors of 16 lanes -> one vector whose lane i is the sum of vs[i]'s lanes: four
    levels of pairwise shuffles and adds (30 shuffles for 16 sums, where a horizontal sum per
    vector takes 8 each), always in the same order."""
    h = 8
    while h >= 1:
        lo = [blk * 2 * h + i for blk in range(16 // h) for i in range(h)]
        lo_mask = ir.Constant(ir.VectorType(_I32, 16), lo)
        hi_mask = ir.Constant(ir.VectorType(_I32, 16), [x + h for x in lo])
        vs = [builder.fadd(builder.shuffle_vector(a, b, lo_mask), builder.shuffle_vector(a, b, hi_mask))
              for a, b in zip(vs[0::2], vs[1::2])]
        h //= 2
    return vs[0]


def _is_c_f32(a, ndim) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == ndim and a.layout == "C"


def _is_kv(a) -> bool:
    """A KV cache array: [KV, capacity, D], float32 or float16 bits (uint16)."""
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.uint16) and a.ndim == 3 \
        and a.layout == "C"


# An opt-in float16 KV cache (EngineConfig.kv_cache = "f16") halves the bytes decode attention
# reads at long contexts (llama.cpp's default cache is float16 too); numba has no float16, so
# its arrays hold the bits as uint16, widened on load (vcvtph2ps) and rounded to nearest even
# on store (vcvtps2ph, as numpy's astype(np.float16) rounds prompt rows). The kernels compile
# for either dtype.
@intrinsic
def _half_bits_to_f32(typingctx, h):
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), _F32)
    return types.float32(types.uint16), codegen


@intrinsic
def _f32_to_half_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), _I16)
    return types.uint16(types.float32), codegen


def kv_get(a, g, t, d):
    """a[g, t, d] of a KV cache array as float32 (float32 or float16 bits)."""


def kv_put(a, g, t, d, x):
    """a[g, t, d] = x (float32), rounded to float16 in a float16 cache."""


@overload(kv_get, inline="always")
def _kv_get(a, g, t, d):
    if a.dtype == types.uint16:
        return lambda a, g, t, d: _half_bits_to_f32(a[g, t, d])
    return lambda a, g, t, d: a[g, t, d]


@overload(kv_put, inline="always")
def _kv_put(a, g, t, d, x):
    if a.dtype == types.uint16:
        def put_half(a, g, t, d, x):
            a[g, t, d] = _f32_to_half_bits(np.float32(x))
        return put_half

    def put(a, g, t, d, x):
        a[g, t, d] = x
    return put


@intrinsic
def _scores16(typingctx, q, k, kv, t, scale, s, j):
    """s[g, j + i] = scale * dot(q[kv * G + g], k[kv, t + i]) for i < 16 and every g < G =
    s.shape[0]; Dk (q.shape[1]) a multiple of 16."""
    if not (_is_c_f32(q, 2) and _is_kv(k) and _is_c_f32(s, 2)):
        return None

    def codegen(context, builder, sig, args):
        qa, ka, sa = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 5))
        kv, t, scale, j = args[2], args[3], args[4], args[6]
        G, C = cgutils.unpack_tuple(builder, sa.shape, 2)
        kdt = sig.args[1].dtype
        krows, Dk = _cache_rows(builder, ka, kdt, kv, t)
        fma = _fma16(builder)
        qbase = builder.bitcast(qa.data, _F32.as_pointer())
        sbase = builder.bitcast(sa.data, _F32.as_pointer())
        scale16 = _splat16(builder, scale)
        with cgutils.for_range(builder, G) as head:
            g = head.index
            qrow = builder.gep(qbase, [builder.mul(builder.add(builder.mul(kv, G), g), Dk)])
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(_ROWS)]
            for i, acc in enumerate(accs):  # row by row: the loads walk the cache in address order
                with cgutils.for_range(builder, builder.lshr(Dk, _c64(4))) as chunk:
                    off = builder.shl(chunk.index, _c64(4))
                    qv = builder.load(_v16_ptr(builder, qrow, off), align=4)
                    kv16 = _load16(builder, krows, builder.add(builder.mul(_c64(i), Dk), off), kdt)
                    builder.store(builder.call(fma, [qv, kv16, builder.load(acc)]), acc)
            dots = _transposed_sums(builder, [builder.load(a) for a in accs])
            dst = builder.gep(sbase, [builder.add(builder.mul(g, C), j)])
            builder.store(builder.fmul(dots, scale16), builder.bitcast(dst, _V16F.as_pointer()), align=4)
        return context.get_dummy_value()
    return types.void(q, k, kv, t, scale, s, j), codegen


@intrinsic
def _values16(typingctx, v, kv, t, s, j, accs):
    """accs[g] += sum_i s[g, j + i] * v[kv, t + i] for i < 16 in order, and every g; Dv a
    multiple of 16. V is read row by row; each 16-float column block of accs[g] is its own
    chain of multiply-adds (four or eight of them side by side at Dv 64 or 128)."""
    if not (_is_kv(v) and _is_c_f32(s, 2) and _is_c_f32(accs, 2)):
        return None

    def codegen(context, builder, sig, args):
        va, sa, aa = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 3, 5))
        kv, t, j = args[1], args[2], args[4]
        G, C = cgutils.unpack_tuple(builder, sa.shape, 2)
        vdt = sig.args[0].dtype
        vrows, Dv = _cache_rows(builder, va, vdt, kv, t)
        fma = _fma16(builder)
        sbase = builder.bitcast(sa.data, _F32.as_pointer())
        abase = builder.bitcast(aa.data, _F32.as_pointer())
        with cgutils.for_range(builder, G) as head:
            g = head.index
            srow = builder.gep(sbase, [builder.add(builder.mul(g, C), j)])
            arow = builder.gep(abase, [builder.mul(g, Dv)])
            ps = [_splat16(builder, builder.load(builder.gep(srow, [_c64(i)]))) for i in range(_ROWS)]

            def rows_into(blocks):
                """accs[g] += p_i v_i, i = 0..15 in order, over Dv = 16 * blocks: the blocks'
                sums in registers, V read row by row."""
                offs = [_c64(16 * b) for b in range(blocks)]
                sums = [builder.load(_v16_ptr(builder, arow, o), align=4) for o in offs]
                for i in range(_ROWS):
                    for b, o in enumerate(offs):
                        vi = _load16(builder, vrows, builder.add(_c64(i * 16 * blocks), o), vdt)
                        sums[b] = builder.call(fma, [ps[i], vi, sums[b]])
                for b, o in enumerate(offs):
                    builder.store(sums[b], _v16_ptr(builder, arow, o), align=4)

            # The common head sizes with their sums in registers; others through memory, the
            # same operations in the same order.
            with builder.if_else(builder.icmp_unsigned("==", Dv, _c64(64))) as (d64, other):
                with d64:
                    rows_into(4)
                with other:
                    with builder.if_else(builder.icmp_unsigned("==", Dv, _c64(128))) as (d128, rest):
                        with d128:
                            rows_into(8)
                        with rest:
                            for i in range(_ROWS):
                                with cgutils.for_range(builder, builder.lshr(Dv, _c64(4))) as chunk:
                                    off = builder.shl(chunk.index, _c64(4))
                                    acc = _v16_ptr(builder, arow, off)
                                    vi = _load16(builder, vrows, builder.add(builder.mul(_c64(i), Dv), off), vdt)
                                    builder.store(builder.call(fma, [ps[i], vi, builder.load(acc, align=4)]), acc,
                                                  align=4)
        return context.get_dummy_value()
    return types.void(v, kv, t, s, j, accs), codegen


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _attend_chunk(q, k, v, kv, t0, m_len, scale, s, ms, ls, accs):
    """Keys t0 .. t0+m_len of KV head kv for its G query heads, one pass under an online
    softmax: each head's max score into ms, its exp-sum into ls and its exp-weighted value sum
    into accs (zeros on entry); s is a [G, ATTEND_CHUNK] scratch. Element loops only: a slice
    store compiles its shape-mismatch error path, seconds of a first start's compile. No calls
    that take arrays inside the loops: each one paid reference counting on its arrays (with the
    rescale as a function, a third of the kernel's time with the cache in L2)."""
    G, Dk, Dv = ms.shape[0], q.shape[1], accs.shape[1]
    for g in range(G):
        ms[g] = -np.inf
        ls[g] = 0.0
    j = 0
    if Dk % _ROWS == 0 and Dv % _ROWS == 0:
        while j + _ROWS <= m_len:
            _scores16(q, k, kv, t0 + j, scale, s, j)
            for g in range(G):
                top = s[g, j]
                for i in range(1, _ROWS):
                    top = max(top, s[g, j + i])
                if top > ms[g]:  # raise the running max: the sums so far scale by e^(old - new)
                    c = expf(ms[g] - top)  # ~1e-38 while the max is still -inf, and the sums are 0
                    ls[g] *= c
                    for d in range(Dv):
                        accs[g, d] *= c
                    ms[g] = top
                m = ms[g]
                total = np.float32(0.0)
                for i in range(_ROWS):
                    e = expf(s[g, j + i] - m)
                    s[g, j + i] = e
                    total += e
                ls[g] += total
            _values16(v, kv, t0 + j, s, j, accs)
            j += _ROWS
    while j < m_len:  # the last < 16 keys (and head dims the intrinsics do not take)
        t = t0 + j
        for g in range(G):
            a = np.float32(0.0)
            for d in range(Dk):
                a += q[kv * G + g, d] * kv_get(k, kv, t, d)
            a *= scale
            if a > ms[g]:
                c = expf(ms[g] - a)
                ls[g] *= c
                for d in range(Dv):
                    accs[g, d] *= c
                ms[g] = a
            e = expf(a - ms[g])
            ls[g] += e
            for d in range(Dv):
                accs[g, d] += e * kv_get(v, kv, t, d)
        j += 1


@njit(cache=True, parallel=True, fastmath={"reassoc", "contract", "nsz"})
def attend_one(q, k, v, n, scale):
    """One query position over the first n cached keys (decode). q [H, Dk]; k [KV, cap, Dk];
    v [KV, cap, Dv] -> [H * Dv]. Query heads share KV heads in groups of G = H // KV (GQA).

    Flash-decoding: the keys are cut into chunks of ATTEND_CHUNK, and each (KV head, chunk)
    work item serves all G query heads of its group, so every cached key and value is read
    from memory once per token, not G times (at 8k tokens of context, SmolLM2's cache is
    ~12 MB a layer: this read, not the weights, is what a long conversation's token costs).
    An item keeps its chunk's max score, exp-sum and weighted value sum; one serial pass merges
    the chunks in order (online softmax), so the result does not depend on the threads."""
    H = q.shape[0]
    KV, _, Dv = v.shape
    G = H // KV
    C = ATTEND_CHUNK
    nc = (n + C - 1) // C
    ms = np.empty((KV, nc, G), np.float32)
    ls = np.empty((KV, nc, G), np.float32)
    accs = np.zeros((KV, nc, G, Dv), np.float32)
    scratch = np.empty((KV * nc, G, C), np.float32)
    for item in prange(KV * nc):
        kv = item // nc
        c = item - kv * nc
        _attend_chunk(q, k, v, kv, c * C, min(n - c * C, C), scale, scratch[item], ms[kv, c], ls[kv, c],
                      accs[kv, c])
    out = np.empty(H * Dv, np.float32)
    _merge_chunks(ms, ls, accs, nc, out)
    return out


@njit(cache=True, fastmath={"reassoc", "contract", "nsz"})
def _merge_chunks(ms, ls, accs, nc, out):
    """One query's chunks merged in order (online softmax): ms/ls [KV, >= nc, G], accs
    [KV, >= nc, G, Dv] -> out [H * Dv]."""
    KV, _, G, Dv = accs.shape
    row = np.empty(Dv, np.float32)
    for h in range(KV * G):
        kv = h // G
        g = h - kv * G
        top = np.float32(-np.inf)
        for c in range(nc):
            top = max(top, ms[kv, c, g])
        total = np.float32(0.0)
        for d in range(Dv):
            row[d] = 0.0
        for c in range(nc):
            w = expf(ms[kv, c, g] - top)
            total += w * ls[kv, c, g]
            for d in range(Dv):
                row[d] += w * accs[kv, c, g, d]
        inv = np.float32(1.0) / total
        for d in range(Dv):
            out[h * Dv + d] = row[d] * inv


@njit(cache=True, parallel=True, fastmath={"reassoc", "contract", "nsz"})
def attend_rows(q, kcs, vcs, n, scale):
    """attend_one for several queries at once (the fused decode blocks, one token or several):
    q [B, H, Dk]; query r over the first n[r] keys of kcs[r] / vcs[r] (numba typed lists of
    [KV, cap, D] arrays; rows may share a cache) -> [B, H * Dv]. One parallel region for all
    rows' (KV head, chunk) work items, so a few short rows do not each pay a region's start.
    A row's result does not depend on the other rows: the same items, merged in the same order,
    whatever B is; one token and a batch both go through here."""
    B, H, _ = q.shape
    KV, _, Dv = vcs[0].shape
    G = H // KV
    C = ATTEND_CHUNK
    nc = np.empty(B, np.int64)
    first = np.zeros(B + 1, np.int64)  # rows' first work items
    for r in range(B):
        nc[r] = (n[r] + C - 1) // C
        first[r + 1] = first[r] + KV * nc[r]
    most = 0
    for r in range(B):
        most = max(most, nc[r])
    ms = np.empty((B, KV, most, G), np.float32)
    ls = np.empty((B, KV, most, G), np.float32)
    accs = np.zeros((B, KV, most, G, Dv), np.float32)
    scratch = np.empty((first[B], G, C), np.float32)
    for item in prange(first[B]):
        r = 0
        while first[r + 1] <= item:
            r += 1
        kv = (item - first[r]) // nc[r]
        c = item - first[r] - kv * nc[r]
        _attend_chunk(q[r], kcs[r], vcs[r], kv, c * C, min(n[r] - c * C, C), scale, scratch[item],
                      ms[r, kv, c], ls[r, kv, c], accs[r, kv, c])
    out = np.empty((B, H * Dv), np.float32)
    for r in range(B):
        _merge_chunks(ms[r], ls[r], accs[r], nc[r], out[r])
    return out


# error_model="numpy": numba's default checks every float division for a zero divisor, a
# branch that keeps the loop scalar (5x slower here).
@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def silu_gate_into(g, u, out):
    for i in range(g.shape[0]):
        v = g[i]
        out[i] = v / (np.float32(1.0) + expf(-v)) * u[i]


@njit(cache=True)
def silu_mul(gu, n):
    """gu [L, 2n] = [gate | up] -> silu(gate) * up [L, n]."""
    out = np.empty((gu.shape[0], n), np.float32)
    silu_mul_into(gu, n, out)
    return out


@njit(cache=True, nogil=True)
def silu_mul_into(gu, n, out):
    """silu_mul into out [L, n]; nogil, for rows split over Python threads."""
    for i in range(gu.shape[0]):
        silu_gate_into(gu[i, :n], gu[i, n:], out[i])


def silu_gate(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u for float32 arrays of one shape (the SwiGLU of unfused gate/up weights)."""
    out = np.empty_like(g)
    silu_gate_into(g.reshape(-1), u.reshape(-1), out.reshape(-1))
    return out


# The gated activations of routed experts, by code (colibri.kernels.moe.ExpertActivation):
SILU = 0          # silu(gate) * up: every family's SwiGLU
CLIPPED_SILU = 1  # silu(min(gate, limit)) * clip(up, -limit, limit): DeepSeek V4, GLM-5.3-Flash
GPT_OSS = 2       # (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)


@njit(cache=True, fastmath={"contract"}, error_model="numpy")
def expert_glu_into(g, u, gate_bias, up_bias, out, kind, alpha, limit):
    """out = the activation `kind` of gate g and up u [I] (each plus its bias row, when the bias
    rows are not empty): the one activation code every path of a family's experts runs (the
    fused decode kernel, prefill's matrices), so decode and prefill round it alike."""
    if kind == SILU and gate_bias.shape[0] == 0:
        silu_gate_into(g, u, out)
        return
    one = np.float32(1.0)
    biased = gate_bias.shape[0] != 0
    for i in range(g.shape[0]):
        v, w = g[i], u[i]
        if biased:
            v += gate_bias[i]
            w += up_bias[i]
        if kind != SILU:
            v = min(v, limit)
            w = min(max(w, -limit), limit)
        if kind == GPT_OSS:
            out[i] = (w + one) * (v / (one + expf(-v * alpha)))
        else:
            out[i] = v / (one + expf(-v)) * w


def expert_glu(gate: np.ndarray, up: np.ndarray, kind: int, alpha: float = 1.0, limit: float = np.inf) -> np.ndarray:
    """expert_glu_into over [L, I] float32 gate and up (biases already added) -> [L, I]."""
    gate = np.ascontiguousarray(gate, dtype=np.float32)
    up = np.ascontiguousarray(up, dtype=np.float32)
    out = np.empty_like(gate)
    _expert_glu_rows(gate, up, out, kind, np.float32(alpha), np.float32(limit))
    return out


@njit(cache=True)
def _expert_glu_rows(gate, up, out, kind, alpha, limit):
    none = np.zeros(0, np.float32)
    for r in range(gate.shape[0]):
        expert_glu_into(gate[r], up[r], none, none, out[r], kind, alpha, limit)


# --- routing ----------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def softmax_topk(logits, k, normalize):
    """Router logits [L, E] float32 -> (weights [L, k] float32, expert ids [L, k] int64): the
    softmax over each row's experts, its k most probable highest first (ties: the lower id
    first, as a stable sort), their probabilities renormalised to sum to 1 if `normalize`.

    One compiled call: the numpy form (softmax, argsort, take, sum: about ten calls) took
    ~100 us a layer inside decode, ~5% of a Qwen3-30B token; a selection of k of E costs
    k * E comparisons, under 2 us here. np.exp is libm's, the sums run in order in float32."""
    L, E = logits.shape
    weights = np.empty((L, k), np.float32)
    ids = np.empty((L, k), np.int64)
    probs = np.empty(E, np.float32)
    taken = np.empty(E, np.bool_)
    for r in range(L):
        m = logits[r, 0]
        for e in range(1, E):
            m = max(m, logits[r, e])
        total = np.float32(0.0)
        for e in range(E):
            p = np.exp(logits[r, e] - m)
            probs[e] = p
            total += p
        for e in range(E):
            probs[e] = probs[e] / total
            taken[e] = False
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or probs[e] > probs[best]):
                    best = e
            taken[best] = True
            ids[r, j] = best
            weights[r, j] = probs[best]
        if normalize:
            s = np.float32(0.0)
            for j in range(k):
                s += weights[r, j]
            for j in range(k):
                weights[r, j] = weights[r, j] / s
    return weights, ids
