"""Decode matvec over the GGUF block schemes (colibri/kernels/cpu/blocks.py) against int4_g64
and q8_0 on the same shapes: GB/s of weight bytes (QTensor.nbytes: GGUF blocks; int4/q8 q +
scales). Benchmark only: no asserts.

    python -m bench.kernels.block_matvec [--shapes 2048x2048,768x2048] [--schemes q4_k,q6_k,...]
                                        [--threads 2] [--repeats 7] [--mib 96]

Per shape (rows x inputs) and scheme, random valid weights (block schemes: random payload
bytes with sane f16 scales; int4/q8: quantized normals), in enough distinct copies to pass
--mib MiB (past a 32 MB L3, so every call reads DRAM), cycled through by matvec calls. Each
round times one pass over the copies per scheme, the schemes interleaved (bench.common);
prints the median over --repeats rounds and the ratio to int4_g64's GB/s.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import interleaved, machine_line

DEFAULT_SCHEMES = "int4_g64,q8_0,q4_k,q6_k,q5_k,q2_k,q3_k,iq4_xs,mxfp4"
# The f16 fields of each block type (byte offsets): d, and dmin / m where the type has one.
_F16_FIELDS = {"q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
               "iq4_nl": (0,), "iq4_xs": (0,), "q5_0": (0,), "q5_1": (0, 2), "mxfp4": ()}


def random_blocks(scheme: str, rows: int, inputs: int, rng) -> np.ndarray:
    """uint8 [rows, row bytes] of valid GGUF blocks: random bytes, f16 scales in +-[1e-3, 0.1],
    MXFP4's E8M0 exponent in [118, 132]."""
    from colibri.formats.ggml_blocks import BLOCK_TYPES

    bt = BLOCK_TYPES[scheme]
    q = rng.integers(0, 256, (rows, inputs // bt.elements, bt.nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[scheme]:
        v = rng.uniform(1e-3, 0.1, q.shape[:2]) * rng.choice([-1.0, 1.0], q.shape[:2])
        q[:, :, off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(*q.shape[:2], 2)
    if scheme == "mxfp4":
        q[:, :, 0] = rng.integers(118, 133, q.shape[:2])
    return q.reshape(rows, -1)


def tensors(scheme: str, rows: int, inputs: int, mib: float, rng) -> list:
    from colibri.formats.ggml_blocks import BLOCK_TYPES
    from colibri.kernels import QTensor, quantize

    if scheme in BLOCK_TYPES:
        first = QTensor(scheme, (rows, inputs), random_blocks(scheme, rows, inputs, rng))
    else:
        first = quantize(rng.standard_normal((rows, inputs), dtype=np.float32), scheme)
    copies = max(2, int(mib * 2**20 // first.nbytes))
    return [first] + [QTensor(first.scheme, first.shape, *(None if a is None else a.copy()
                                                         for a in (first.q, first.scales, first.mins)))
                      for _ in range(copies - 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x2048,768x2048", help="ROWSxINPUTS,...")
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help="comma-separated schemes")
    ap.add_argument("--threads", type=int, default=2, help="numba threads")
    ap.add_argument("--repeats", type=int, default=7, help="rounds (the median is printed)")
    ap.add_argument("--mib", type=float, default=96, help="weight copies per scheme and shape, in MiB")
    a = ap.parse_args()
    import numba

    from colibri.kernels import matvec

    numba.set_num_threads(min(a.threads, numba.config.NUMBA_NUM_THREADS))
    schemes = [s for s in a.schemes.split(",") if s]
    print(machine_line())
    print(f"decode matvec, {numba.get_num_threads()} threads, weights from DRAM (>= {a.mib:g} MiB of copies per "
          f"scheme): GB/s of weight bytes, median of {a.repeats} rounds (x: ratio to int4_g64)")
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    table: dict = {}
    for rows, inputs in shapes:
        x = rng.standard_normal(inputs, dtype=np.float32)
        y = np.empty(rows, np.float32)
        ts = {s: tensors(s, rows, inputs, a.mib, rng) for s in schemes}
        for s in schemes:  # compile and warm
            matvec(ts[s][0], x, y)

        def one_pass(s):
            t0 = time.perf_counter()
            for t in ts[s]:
                matvec(t, x, y)
            return (time.perf_counter() - t0) / len(ts[s])

        times = interleaved(schemes, a.repeats, one_pass, alternate=True)
        for s in schemes:
            table[s, rows, inputs] = (ts[s][0].nbytes, ts[s][0].nbytes / float(np.median(times[s])) / 1e9)
    print(f"{'shape':>10s}  {'scheme':9s} {'MiB':>6s} {'GB/s':>6s} {'x':>5s}")
    for rows, inputs in shapes:
        base = table.get(("int4_g64", rows, inputs))
        for s in schemes:
            nbytes, gbs = table[s, rows, inputs]
            ratio = f"{gbs / base[1]:5.2f}" if base else "    -"
            print(f"{f'{rows}x{inputs}':>10s}  {s:9s} {nbytes / 2**20:6.2f} {gbs:6.2f} {ratio}")

if __name__ == "__main__":
    main()
