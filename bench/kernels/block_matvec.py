"""Decode matvec over the GGUF block schemes (colibri/kernels/cpu/blocks.py) against int4_g64
and q8_0 on the same shapes: GB/s of weight bytes (QTensor.nbytes: GGUF blocks; int4/q8 q +
scales). Benchmark only: no asserts.

    python -m bench.kernels.block_matvec [--shapes 2048x2048,768x2048] [--schemes q4_k,q6_k,...]
                                        [--threads 2] [--repeats 7] [--mib 96] [--activations f32,int8]

Per shape (rows x inputs) and scheme, random valid weights (block schemes: random payload
bytes with sane f16 scales; int4/q8: quantized normals), in enough distinct copies to pass
--mib MiB (past a 32 MB L3, so every call reads DRAM), cycled through by matvec calls. Each
round times one pass over the copies per scheme, the schemes interleaved (bench.common);
prints the median over --repeats rounds and the ratio to int4_g64's GB/s. `--activations
f32,int8` adds a column for the int8-activation kernels (kernels/idot.py for int4 and q8_0,
kernels/block_idot.py for its INT8_SCHEMES; "-" for the schemes that run exactly in int8 mode), run
interleaved with the exact ones, and its ratio to the scheme's exact GB/s.
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
    ap.add_argument("--activations", default="f32", help="f32, or f32,int8 for an int8-activation column too")
    a = ap.parse_args()
    import numba

    from colibri.kernels import block_idot, idot, matvec

    modes = [m for m in a.activations.split(",") if m]
    if modes[0] != "f32" or not set(modes) <= {"f32", "int8"}:
        ap.error("--activations: f32 or f32,int8")

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
        kernels = {(s, "f32"): lambda t: matvec(t, x, y) for s in schemes}
        if "int8" in modes:
            kernels.update({(s, "int8"): lambda t: idot.matvec_q(t, x) for s in schemes if s in idot.SCHEMES})
            kernels.update({(s, "int8"): lambda t: block_idot.matvec_q(t, x)
                            for s in schemes if s in block_idot.INT8_SCHEMES})
        for (s, _), fn in kernels.items():  # compile and warm
            fn(ts[s][0])

        def one_pass(variant):
            s, fn = variant[0], kernels[variant]
            t0 = time.perf_counter()
            for t in ts[s]:
                fn(t)
            return (time.perf_counter() - t0) / len(ts[s])

        times = interleaved(list(kernels), a.repeats, one_pass, alternate=True)
        for (s, mode) in kernels:
            table[s, mode, rows, inputs] = (ts[s][0].nbytes,
                                            ts[s][0].nbytes / float(np.median(times[s, mode])) / 1e9)
    int8 = "int8" in modes
    print(f"{'shape':>10s}  {'scheme':9s} {'MiB':>6s} {'GB/s':>6s} {'x':>5s}"
          + (f" {'int8':>6s} {'/f32':>5s}" if int8 else ""))
    for rows, inputs in shapes:
        base = table.get(("int4_g64", "f32", rows, inputs))
        for s in schemes:
            nbytes, gbs = table[s, "f32", rows, inputs]
            ratio = f"{gbs / base[1]:5.2f}" if base else "    -"
            line = f"{f'{rows}x{inputs}':>10s}  {s:9s} {nbytes / 2**20:6.2f} {gbs:6.2f} {ratio}"
            if int8:
                i8 = table.get((s, "int8", rows, inputs))
                line += f" {i8[1]:6.2f} {i8[1] / gbs:5.2f}" if i8 else f" {'-':>6s} {'-':>5s}"
            print(line)

if __name__ == "__main__":
    main()
