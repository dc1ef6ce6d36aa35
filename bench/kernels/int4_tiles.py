"""The int4 decode tiles alone (colibri.kernels.cpu.matvec.int4_rows8, what every int4 matvec
of a token runs), against other copies of the colibri/kernels/cpu/ package in the same process: GB/s of weights (q, scales
and mins) over one interleaved matrix, from the CPU caches (a few MB) or streamed from memory
(hundreds of MB), 2 threads in one parallel region, so no per-call cost is in the figure.
Benchmark only: no asserts.

    mkdir /tmp/before && git archive HEAD~1 colibri/kernels/cpu | tar -x -C /tmp/before
    python -m bench.kernels.int4_tiles --versions /tmp/before/colibri/kernels/cpu [--shapes 576:4,1536:4,576:400]

Each --shapes item is INPUTS:MB (SmolLM2's rows have 576 and 1536 inputs; 4 MB stays in the
L3, 400 MB does not, 0.4 MB stays in two cores' L2). One core's arithmetic alone:
NUMBA_NUM_THREADS=1, a matrix in L2 and --calls 200, so that a run lasts milliseconds. The
copies run alternately, each first in turn (the second of two runs was up to ~10% faster), and
their outputs are compared bit for bit: a change that only reorders work must print "same
bits". Medians and best of --repeats runs.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from numba import get_num_threads

from bench.common import REPO, machine_line, median
from bench.common import interleaved as interleaved_runs  # (colibri.formats.qtensor has an `interleaved` too)


def load(path: Path, name: str):
    """A copy of the cpu/ package at `path` as its own package (compiled here, not cached), with
    a 2-thread runner of its 8-row tiles over a whole matrix."""
    import importlib
    import importlib.util
    import shutil
    import sys
    import tempfile

    from numba import njit, prange

    copy = Path(tempfile.mkdtemp(prefix=f"{name}-")) / "cpu"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for f in copy.glob("*.py"):
        f.write_text(f.read_text().replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location(name, copy / "__init__.py", submodule_search_locations=[str(copy)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    module = importlib.import_module(f"{name}.matvec")
    rows8 = module.int4_rows8

    @njit(parallel=True, cache=False)
    def run(q, scales, offs, coef, half, cshift, ilv, xp, xs, y):
        nblk = q.shape[0] // 8
        per = (nblk + 1) // 2
        for t in prange(2):
            d = np.empty(8, np.float32)
            for blk in range(t * per, min(nblk, (t + 1) * per)):
                rows8(q, scales, offs, coef, half, cshift, ilv, xp, xs, 8 * blk, d)
                for j in range(8):
                    y[8 * blk + j] = d[j]

    module.run = run
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", default="", help="other copies of the colibri/kernels/cpu/ package (directories), comma-separated")
    ap.add_argument("--shapes", default="576:4,1536:4,576:400,1536:400", help="INPUTS:MB, comma-separated")
    ap.add_argument("--scheme", default="q4_1", choices=["q4_1", "q4_0", "int4_g64"])
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--calls", type=int, default=1, help="back-to-back passes per timed run (a matrix in L2 takes\n"
                    "tens of microseconds a pass: time many)")
    a = ap.parse_args()

    from colibri.kernels import quantize
    from colibri.formats.qtensor import interleaved

    paths = [REPO / "colibri" / "kernels" / "cpu"] + [Path(p) for p in a.versions.split(",") if p]
    names = ["this"] + [p.name for p in paths[1:]]
    modules = [load(p, f"cpu_copy{i}") for i, p in enumerate(paths)]
    rng = np.random.default_rng(0)
    print(machine_line())
    print(f"{a.scheme}, {min(2, get_num_threads())} threads, {a.repeats} alternated runs of {a.calls} passes: "
          "median (best) GB/s of q, scales and mins")
    for item in a.shapes.split(","):
        cols, mb = int(item.split(":")[0]), float(item.split(":")[1])
        rows = int(mb * 1e6 / (cols * 0.5625)) // 64 * 64
        w = np.empty((rows, cols), np.float32)
        for r in range(0, rows, 4096):
            w[r:r + 4096] = rng.standard_normal((min(4096, rows - r), cols), dtype=np.float32)
        t = interleaved(quantize(w, a.scheme))
        del w
        x = rng.standard_normal(cols).astype(np.float32)
        nbytes = t.nbytes
        args = [m.int4_weight(t) for m in modules]
        prepared = [(m.prepare_x(x, arg[4]), m.group_sums(x, 2 * arg[4])) for m, arg in zip(modules, args)]
        outs: list[np.ndarray] = [np.zeros(rows, np.float32) for _ in modules]

        def once(i):
            modules[i].run(*args[i], *prepared[i], outs[i])  # compiled, and the matrix touched
            t0 = time.perf_counter()
            for _ in range(a.calls):
                modules[i].run(*args[i], *prepared[i], outs[i])
            return a.calls * nbytes / (time.perf_counter() - t0) / 1e9

        runs = interleaved_runs(range(len(modules)), a.repeats, once, alternate=True)
        rates = [runs[i] for i in range(len(modules))]
        same = all(np.array_equal(outs[0], o) for o in outs[1:])
        cells = "  ".join(f"{n} {median(r):5.1f} ({max(r):5.1f})" for n, r in zip(names, rates))
        bits = "" if len(modules) == 1 else ("  same bits" if same else "  outputs DIFFER")
        print(f"{rows:>8} x {cols:<5} {nbytes / 1e6:6.1f} MB  {cells}{bits}")


if __name__ == "__main__":
    main()
