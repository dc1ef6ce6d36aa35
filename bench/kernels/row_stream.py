"""How fast the quantized row kernels read weights from DRAM, eight rows at a time against two
(colibri/kernels/cpu/, PAIR_ROW_BYTES; colibri/kernels/idot.py, rows8). Benchmark only: no
asserts.

    python -m bench.kernels.row_stream [--scheme int4_g64|q8_0|int4-int8] [--layout rows|interleaved]
                               [--shapes 2048,576,768,4096] [--gib 0.8] [--rows-per-call 6144]

For each input width, a matrix of random bytes (about --gib GiB, far past the caches), read
by matvecs of --rows-per-call rows each (as a model's matrices are), after a 1
GiB pass over other memory before every timing; 2 threads, each a contiguous half of every
call's 8-row blocks. Prints GB/s (weights + scales) for the two row orders, alternated, medians
of 5. Repeated rows or a matrix read twice measure the caches, not DRAM: a matrix whose rows
were all the same bytes read ~30% faster here.

--scheme int4-int8: int4 weights times int8 activations (`--activations int8`, idot.py).
--layout interleaved: each order on the layout that makes it one stream per thread (rows
interleaved in blocks of 8 for eight at a time, of 2 for two: formats/qtensor.py, Layout), as
the engine lays matrices out; rows (the default): row-major, as stored.
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from numba import njit, prange

from bench.common import interleaved, machine_line
from colibri.kernels import idot
from colibri.kernels.cpu.codegen import int4_dot2, int4_dot8, q8_dot2, q8_dot8
from colibri.kernels.cpu.matvec import prepare_x
from colibri.memory import huge_pages




@njit(parallel=True)
def _matvec_q8(q, s, x, y, pairs, ilv):
    out = q.shape[0]
    nblk = out // 8
    per = (nblk + 1) // 2
    for t in prange(2):
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            rn = r + 8 if r + 16 <= out else r
            if pairs:
                for p in range(0, 8, 2):
                    q8_dot2(q, s, r + p, r + p + 2 if p < 6 else rn, x, 32, 1, ilv, y, r + p)
            else:
                q8_dot8(q, s, r, rn, x, 32, 1, ilv, y, r)


@njit(parallel=True)
def _matvec(q, s, xp, y, pairs, ilv):
    out = q.shape[0]
    nblk = out // 8
    per = (nblk + 1) // 2
    for t in prange(2):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            rn = r + 8 if r + 16 <= out else r
            if pairs:
                for p in range(0, 8, 2):
                    int4_dot2(q, s, s, r + p, r + p + 2 if p < 6 else rn, xp, 32, 1, ilv, d, p)
            else:
                int4_dot8(q, s, s, r, rn, xp, 32, 1, ilv, d, 0)
            for j in range(8):
                y[r + j] = d[j]


@njit(parallel=True)
def _matvec_int8(q, s, xa, y, pairs, ilv):
    xlo, xhi, negc, xsl, sxl = xa
    out = q.shape[0]
    nblk = out // 8
    per = (nblk + 1) // 2
    for t in prange(2):
        d = np.empty(8, np.float32)
        for blk in range(t * per, min(nblk, (t + 1) * per)):
            r = 8 * blk
            rn = r + 8 if r + 16 <= out else r
            if pairs:
                for p in range(0, 8, 2):
                    idot._idot2(q, s, s, r + p, r + p + 2 if p < 6 else rn, xlo, xhi, negc, xsl, sxl, d[p:],
                                np.float32(-8.0), 32, ilv)
            else:
                idot._idot8(q, s, s, r, rn, xlo, xhi, negc, xsl, sxl, d, np.float32(-8.0), 32, ilv)
            for j in range(8):
                y[r + j] = d[j]


@njit
def _flush(a):
    total = 0
    for i in range(0, a.shape[0], 64):
        total += a[i]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scheme", choices=["int4_g64", "q8_0", "int4-int8"], default="int4_g64")
    ap.add_argument("--layout", choices=["rows", "interleaved"], default="rows")
    ap.add_argument("--shapes", default="2048,576,768,4096", help="input widths (multiples of 128)")
    ap.add_argument("--gib", type=float, default=0.8)
    ap.add_argument("--rows-per-call", type=int, default=6144)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    flush = huge_pages(1 << 30)
    flush[:] = 1
    int4 = args.scheme != "q8_0"
    print(machine_line())
    print(f"{args.scheme}, {args.layout} layout, from DRAM, 2 threads: GB/s of weights + scales "
          f"(median of 5, alternated)")

    def width(pairs):  # the interleave each order reads as one stream
        return 1 if args.layout == "rows" else (2 if pairs else 8)
    for cols in (int(c) for c in args.shapes.split(",")):
        chunk = args.rows_per_call
        row_bytes, group = (cols // 2, 64) if int4 else (cols, 32)
        rows = max(chunk, int(args.gib * 2**30 / (row_bytes + 4 * cols // group)) // chunk * chunk)
        q = huge_pages(rows * row_bytes).reshape(rows, row_bytes)
        q[:] = rng.integers(0, 256, q.shape, dtype=np.uint8)
        if not int4:
            q = q.view(np.int8)
        s = huge_pages(rows * 4 * cols // group).view(np.float32).reshape(rows, cols // group)
        s[:] = rng.uniform(0.5, 1.5, s.shape).astype(np.float32)
        x = rng.standard_normal(cols, dtype=np.float32)
        if args.scheme == "int4-int8":
            xp, matvec = idot.quantize(x, 32), _matvec_int8
        else:
            xp, matvec = (prepare_x(x, 32), _matvec) if int4 else (x, _matvec_q8)
        y = np.empty(rows, np.float32)
        for pairs in (False, True):
            matvec(q[:chunk], s[:chunk], xp, y[:chunk], pairs, width(pairs))

        def timed(pairs):
            _flush(flush)
            t0 = time.perf_counter()
            for r0 in range(0, rows, chunk):
                matvec(q[r0:r0 + chunk], s[r0:r0 + chunk], xp, y[r0:r0 + chunk], pairs, width(pairs))
            return time.perf_counter() - t0

        times = interleaved([False, True], 5, timed)
        nbytes = q.nbytes + s.nbytes
        eight, two = (nbytes / np.median(times[p]) / 1e9 for p in (False, True))
        print(f"{cols:5d} inputs ({row_bytes:4d}-byte rows), {nbytes / 2**30:.2f} GiB: eight rows at a time "
              f"{eight:5.1f} GB/s, two at a time {two:5.1f} GB/s", flush=True)
        del q, s


if __name__ == "__main__":
    th = threading.Thread(target=main)  # one non-main thread: GNU OpenMP keeps a pool per thread
    th.start()
    th.join()
