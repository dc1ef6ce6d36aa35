"""The int8-activation row tiles alone (colibri/kernels/idot.py), one thread, one matrix small
enough for the core's L2, so the figure is the tile's arithmetic and registers, not DRAM: the
eight-rows-side-by-side tile (_idot8) against the four-rows-by-halves one (_idot4) and, for
rows interleaved in pairs, pairs whole against pairs by halves (_idot2 in each form). Every
form's outputs are compared bit for bit with the 8-row tile's. Benchmark only: no asserts.

    python -m bench.kernels.idot_tiles [--shapes 256x2048,512x768,1024x576] [--scheme int4_g64] [--rounds 5]

What rows8 runs on this target (idot.PARTS): whole chunks, eight rows at a time, where the CPU
has 32 vector registers (AVX-512); four rows by halves and pairs by halves where it has 16
(AVX2). On another target, compile for it (`NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=`).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from bench.common import machine_line, median


def _kernels():
    from colibri.kernels import idot

    def pair_tile(parts: int):
        """_idot2 with its 64-byte chunks whole (parts 1) or by halves (2), whatever the target."""
        @intrinsic
        def tile(typingctx, q, scales, offs, r, rn, xlo, xhi, negc, xsl, sxl, out, coef, half, ilv):
            sig = types.void(q, scales, offs, types.intp, types.intp, xlo, xhi, negc, xsl, sxl, out, coef,
                             types.intp, types.intp)
            return sig, idot._variants_codegen(2, parts=parts)
        return tile

    tile8, tile4 = idot._idot8, idot._idot4

    def runner(form: str, pair=pair_tile(1)):
        """Every row of q through one form, `reps` times: "8" (_idot8), "4h" (_idot4 twice) or
        "pair" (the given pair tile, rows interleaved in pairs)."""
        step = 2 if form == "pair" else 8

        @njit(cache=False)
        def run(q, s, o, coef, half, ilv, xa, y, reps):
            xlo, xhi, negc, xsl, sxl = xa
            d = np.empty(8, np.float32)
            for _ in range(reps):
                for r in range(0, q.shape[0], step):
                    rn = r + step if r + 2 * step <= q.shape[0] else r
                    if form == "pair":
                        pair(q, s, o, r, rn, xlo, xhi, negc, xsl, sxl, d, coef, half, ilv)
                    elif form == "4h":
                        tile4(q, s, o, r, rn, xlo, xhi, negc, xsl, sxl, d, coef, half, ilv)
                        tile4(q, s, o, r + 4, rn + 4, xlo, xhi, negc, xsl, sxl, d[4:], coef, half, ilv)
                    else:
                        tile8(q, s, o, r, rn, xlo, xhi, negc, xsl, sxl, d, coef, half, ilv)
                    y[r:r + step] = d[:step]
        return run

    return {"8 rows, whole chunks": runner("8"), "4 rows, halves": runner("4h"),
            "pairs, whole chunks": runner("pair", pair_tile(1)), "pairs, halves": runner("pair", pair_tile(2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="256x2048,128x4096,512x768,1024x576", help="ROWSxINPUTS,...")
    ap.add_argument("--scheme", default="int4_g64", choices=["int4_g64", "q4_0", "q4_1", "q8_0"])
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import numba

    from colibri.formats.qtensor import interleaved, quantize
    from colibri.kernels import idot

    numba.set_num_threads(1)
    kernels = _kernels()
    print(machine_line())
    print(f"{a.scheme} x int8 activations, 1 thread, the matrix in L2: GB/s of q and scales, median of "
          f"{a.rounds} alternated rounds (rows8 here: {'halves' if idot.PARTS == 2 else 'whole chunks'})")
    rng = np.random.default_rng(0)
    for item in a.shapes.split(","):
        rows, n = (int(v) for v in item.split("x"))
        t = quantize(rng.standard_normal((rows, n)).astype(np.float32), a.scheme)
        q, s, o, coef, half, _, _ = idot.weight_of(t)
        xa = idot.quantize_for(rng.standard_normal(n).astype(np.float32), coef, half)
        nbytes = q.nbytes + s.nbytes + (0 if o is s else o.nbytes)
        reps = max(1, int(1e9 / nbytes))
        layouts = {"8 rows, whole chunks": 1, "4 rows, halves": 1, "pairs, whole chunks": 2, "pairs, halves": 2}
        mats = {w: interleaved(t, w).q if w > 1 else q for w in set(layouts.values())}
        outs, rates = {}, {k: [] for k in kernels}
        for name, fn in kernels.items():
            y = np.zeros(rows, np.float32)
            fn(mats[layouts[name]], s, o, coef, half, layouts[name], xa, y, 1)
            outs[name] = y
        for _ in range(a.rounds):
            for name, fn in kernels.items():
                y = np.zeros(rows, np.float32)
                t0 = time.perf_counter()
                fn(mats[layouts[name]], s, o, coef, half, layouts[name], xa, y, reps)
                rates[name].append(nbytes * reps / (time.perf_counter() - t0) / 1e9)
        base = outs["8 rows, whole chunks"]
        cells = "  ".join(f"{name} {median(r):5.1f}{'' if np.array_equal(outs[name], base) else ' (bits DIFFER)'}"
                          for name, r in rates.items())
        print(f"{rows:>6} x {n:<5} {nbytes / 1e6:5.2f} MB  {cells}")


if __name__ == "__main__":
    main()
