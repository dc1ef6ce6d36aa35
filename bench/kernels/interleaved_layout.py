"""Does a block-interleaved int4 layout stream faster than row-major rows? (issue 15, item 1).
Benchmark only. The measurement that led to colibri's interleaved rows (formats/qtensor.py,
Layout). Three layouts: row-major; q and scales interleaved; q only, scales row-major, which
is what colibri does (README, Measured, fifth session).

    python -m bench.kernels.interleaved_layout [--repeats 10]

Row-major int4 matrices: a row's bytes, then the next row's, and the scales in a separate
[rows, groups] array. The decode kernels read W rows at a time (8, or 2 for rows of
1 KB or more), one 64-byte block of each row per step. That is W separate streams of weights and
W of scales, each advancing 64 bytes (or 8 bytes of scales) a step. In the interleaved layout
the W rows' k-th blocks lie side by side, and so do their scales, so a step reads one run of
W x 64 contiguous bytes. llama.cpp repacks Q4_0 this way for its x86 kernels (block_q4_0x8).

Every layout runs the same exact arithmetic: the int4 block of colibri.kernels.cpu (nibbles
masked in place, converted, multiply-added in the same order), with the next step's data
prefetched. The script checks that all give the same bits, then reads int4_g64 matrices at
two widths (Qwen3's 2048 inputs, 1 KB rows; its experts' 768 inputs, 384 B rows) from DRAM:
a pool of copies larger than the caches, W = 8 and 2, the layouts alternated, medians.
The tile here is a stripped-down copy of the kernel's (one activation row, symmetric groups
of 64, no offset term, whole blocks only): enough to time the reads.
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from bench.common import interleaved, machine_line, median
from colibri.kernels.cpu.codegen import hsum
from colibri.kernels.cpu.matvec import prepare_x

_F32, _I64, _I8, _I32 = ir.FloatType(), ir.IntType(64), ir.IntType(8), ir.IntType(32)
_V16F, _V16I = ir.VectorType(_F32, 16), ir.VectorType(_I32, 16)
_NIBBLE_MASKS = [ir.Constant(_V16I, [15 << (4 * k)] * 16) for k in range(7)]  # nibble 7: a shift


def _i64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _i32(v: int) -> ir.Constant:
    return ir.Constant(_I32, v)


# The layouts compared: (q interleaved, scales interleaved). colibri uses "q only".
LAYOUTS = {"row-major": (False, False), "interleaved": (True, True), "q only": (True, False)}


def make_tile(W: int, q_inter: bool, s_inter: bool):
    """An intrinsic (q, scales, r, rn, xp, out): out[0:W] = rows r..r+W-1 of q (int4_g64
    nibbles, row-major or interleaved in blocks of W rows) times x prepared by
    cpu.matvec.prepare_x; the same data of rows rn.. prefetched."""
    def tile(typingctx, q, scales, r, rn, xp, out):
        sig = types.void(q, scales, types.intp, types.intp, xp, out)

        def codegen(context, builder, sig_, args):
            qa, sa = (context.make_array(sig_.args[i])(context, builder, args[i]) for i in (0, 1))
            xa, oa = (context.make_array(sig_.args[i])(context, builder, args[i]) for i in (4, 5))
            r, rn = args[2], args[3]
            row_bytes = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
            ngroups = cgutils.unpack_tuple(builder, sa.shape, 2)[1]
            qb = builder.bitcast(qa.data, _I8.as_pointer())
            sb = builder.bitcast(sa.data, _F32.as_pointer())
            xb = builder.bitcast(xa.data, _F32.as_pointer())
            ob = builder.bitcast(oa.data, _F32.as_pointer())

            def starts(base, row, stride, lane_step, interleaved):
                """Where row + j's data starts: row-major, or inside its block of W rows."""
                if interleaved:
                    return [builder.gep(base, [builder.add(builder.mul(row, stride), _i64(lane_step * j))])
                            for j in range(W)]
                return [builder.gep(base, [builder.mul(builder.add(row, _i64(j)), stride)]) for j in range(W)]

            qrows, next_q = starts(qb, r, row_bytes, 64, q_inter), starts(qb, rn, row_bytes, 64, q_inter)
            srows, next_s = starts(sb, r, ngroups, 2, s_inter), starts(sb, rn, ngroups, 2, s_inter)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3),
                                                 "llvm.fmuladd.v16f32")
            pf = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")

            def prefetch(ptr):  # read, keep in all cache levels, data (as colibri's kernels)
                builder.call(pf, [builder.bitcast(ptr, _I8.as_pointer()), _i32(0), _i32(3), _i32(1)])

            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(W)]
            spread = ir.Constant(ir.VectorType(_I32, 16), [i * 2 // 16 for i in range(16)])  # 2 groups a block
            with cgutils.for_range(builder, builder.udiv(row_bytes, _i64(64))) as loop:
                bi = loop.index
                qoff = builder.mul(bi, _i64(64 * W if q_inter else 64))
                soff = builder.mul(bi, _i64(2 * W if s_inter else 2))
                e = builder.shl(bi, _i64(7))
                xs = [builder.load(builder.bitcast(builder.gep(xb, [builder.add(e, _i64(16 * k))]), _V16F.as_pointer()),
                                   align=4) for k in range(8)]
                for j in range(W):
                    prefetch(builder.gep(next_q[j], [qoff]))
                for j in range(W):
                    prefetch(builder.gep(next_s[j], [soff]))
                for j in range(W):
                    raw = builder.load(builder.bitcast(builder.gep(qrows[j], [qoff]), _V16I.as_pointer()), align=1)
                    two = builder.load(builder.bitcast(builder.gep(srows[j], [soff]), ir.VectorType(_F32, 2).as_pointer()),
                                       align=4)
                    scale = builder.shuffle_vector(two, two, spread)
                    ns = [builder.sitofp(builder.and_(raw, m), _V16F) for m in _NIBBLE_MASKS]
                    ns.append(builder.sitofp(builder.lshr(raw, ir.Constant(_V16I, [28] * 16)), _V16F))
                    t = builder.fmul(ns[0], xs[0])
                    for k in range(1, 8):
                        t = builder.call(fma, [ns[k], xs[k], t])
                    builder.store(builder.call(fma, [t, scale, builder.load(accs[j])]), accs[j])
            for j in range(W):
                builder.store(hsum(builder, builder.load(accs[j])), builder.gep(ob, [_i64(j)]))
            return context.get_dummy_value()
        return sig, codegen
    tile.__name__ = tile.__qualname__ = f"_tile{W}_{int(q_inter)}{int(s_inter)}"
    return intrinsic(tile)


def make_matvec(W: int, q_inter: bool, s_inter: bool):
    """y = W @ x over the whole matrix with make_tile's tile, each thread a contiguous run."""
    tile = make_tile(W, q_inter, s_inter)

    @njit(parallel=True)
    def matvec(q, scales, xp, y, nthreads):
        out = q.shape[0]
        nblk = out // W
        per = (nblk + nthreads - 1) // nthreads
        for t in prange(nthreads):
            d = np.empty(W, np.float32)
            for blk in range(t * per, min(nblk, (t + 1) * per)):
                r = W * blk
                rn = r + W if r + 2 * W <= out else r
                tile(q, scales, r, rn, xp, d)
                for j in range(W):
                    y[r + j] = d[j]
    return matvec


def interleave(q, scales, W: int):
    """q [rows, bytes] and scales [rows, groups] laid out in blocks of W rows: block k of every
    row of the block side by side, then block k + 1; their scales (two groups a block) likewise."""
    rows, row_bytes = q.shape
    ngroups = scales.shape[1]
    qi = q.reshape(rows // W, W, row_bytes // 64, 64).transpose(0, 2, 1, 3).reshape(rows, row_bytes)
    si = scales.reshape(rows // W, W, ngroups // 2, 2).transpose(0, 2, 1, 3).reshape(rows, ngroups)
    return qi.copy(), si.copy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="passes per layout, alternated")
    ap.add_argument("--smoke", action="store_true", help="two matrices per shape (in the caches): checks the script")
    a = ap.parse_args()
    print(machine_line())
    th = threading.Thread(target=work, args=(a.repeats, a.smoke))  # off the main thread, as the engine runs kernels
    th.start()
    th.join()


def work(repeats: int, smoke: bool = False) -> None:
    rng = np.random.default_rng(0)

    def matrix(rows, n):
        return (rng.integers(0, 256, (rows, n // 2), dtype=np.uint8),
                rng.random((rows, n // 64), dtype=np.float32))

    def laid_out(q, s, W, name):
        q_inter, s_inter = LAYOUTS[name]
        qi, si = interleave(q, s, W)
        return (qi if q_inter else q), (si if s_inter else s)

    for W in (8, 2):
        matvecs = {name: make_matvec(W, *LAYOUTS[name]) for name in LAYOUTS}
        q, s = matrix(64, 2048)
        xp = prepare_x(rng.standard_normal(2048).astype(np.float32), 32)
        ys = {name: np.empty(64, np.float32) for name in LAYOUTS}
        for name in LAYOUTS:
            matvecs[name](*laid_out(q, s, W, name), xp, ys[name], 2)
            assert np.array_equal(ys[name], ys["row-major"]), "every layout must give the same bits"
        for n, rows, count in ((2048, 3072, 120), (768, 4096, 200)):  # ~0.4 GB each: past the caches
            count = 2 if smoke else count
            plain = [matrix(rows, n) for _ in range(count)]
            mats = {name: [laid_out(q, s, W, name) for q, s in plain] for name in LAYOUTS}
            del plain
            xp = prepare_x(rng.standard_normal(n).astype(np.float32), 32)
            y = np.empty(rows, np.float32)
            nbytes = sum(q.nbytes + s.nbytes for q, s in mats["row-major"])

            def once(name):
                t0 = time.perf_counter()
                for q, s in mats[name]:
                    matvecs[name](q, s, xp, y, 2)
                return nbytes / (time.perf_counter() - t0) / 1e9

            gbs = interleaved(list(LAYOUTS)[::-1], repeats, once, alternate=True)  # last first, then in order
            print(f"W={W} {n:5d} inputs ({n // 2:4d} B rows), {nbytes / 1e9:.2f} GB from DRAM, 2 threads: "
                  + "  ".join(f"{name} {median(gbs[name]):5.1f}" for name in LAYOUTS) + " GB/s")


if __name__ == "__main__":
    main()
