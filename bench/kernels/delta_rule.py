"""The chunked recurrent kernels alone (colibri/kernels/delta_rule.py): KDA's per-channel decay
(kda_chunked: Kimi-Linear, GLM-5.3-Flash) and Gated DeltaNet's per-head decay (delta_chunked:
Qwen3-Next, Qwen3.5 / 3.6) at a real head size (128 x 128), for decays of several strengths:
g = -s * |N(0, 1)| per token (and channel), s from --decays. Strong decays push the states and a
chunk's pair factors into float32's subnormal range (cpu/fpenv.py). ms per 64-token chunk and
head, the best of --repeats. Benchmark only: no asserts.

    python -m bench.kernels.delta_rule [--heads 16] [--tokens 512] [--decays 0.1,3,10] [--repeats 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import add_json_arg, machine_line, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--dim", type=int, default=128, help="key and value head width")
    ap.add_argument("--decays", default="0.1,3,10", help="decay strengths s")
    ap.add_argument("--repeats", type=int, default=3)
    add_json_arg(ap)
    a = ap.parse_args()

    from colibri.kernels import delta_rule as dr

    print(machine_line())
    rng = np.random.default_rng(0)
    L, H, D = a.tokens, a.heads, a.dim
    q, k, v = (rng.standard_normal((L, H, D), dtype=np.float32) for _ in range(3))
    beta = rng.random((L, H), dtype=np.float32)
    state = np.zeros((H, D, D), np.float32)
    per = L / dr.CHUNK * H
    rows = []
    for strength in (float(s) for s in a.decays.split(",")):
        g = -np.abs(rng.standard_normal((L, H, D), dtype=np.float32)) * np.float32(strength)
        row = {"decay": strength}
        for name, fn, gg in (("kda_chunked", dr.kda_chunked, g), ("delta_chunked", dr.delta_chunked,
                                                                  np.ascontiguousarray(g[:, :, 0]))):
            fn(state.copy(), q[:dr.CHUNK], k[:dr.CHUNK], v[:dr.CHUNK], gg[:dr.CHUNK], beta[:dr.CHUNK])  # compile
            best = min(_timed(fn, state.copy(), q, k, v, gg, beta) for _ in range(a.repeats))
            row[f"{name}_ms"] = best / per * 1e3
        rows.append(row)
        print(f"decay -{strength} x |N(0,1)|: kda_chunked {row['kda_chunked_ms']:.2f} ms, "
              f"delta_chunked {row['delta_chunked_ms']:.2f} ms per chunk and head")
    write_json(a.json, {"heads": H, "tokens": L, "dim": D, "rows": rows})


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
