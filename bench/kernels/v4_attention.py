"""DeepSeek V4's attention core alone (colibri/models/deepseek_v4.py: v4_attention) for one
decode query at V4-Flash's shapes (64 heads of 512 over one shared key=value head, a 128-token
window, learned sinks): a compressed-sparse-attention (CSA) layer at 2k-32k tokens of context,
whose 4:1 compressor gives N / 4 entries of which the indexer keeps --topk (512 in V4-Flash,
1024 in V4-Pro), and a heavily compressed (HCA, 128:1, every entry seen) layer. Random rows;
ms per call, the median of --repeats. Benchmark only: no asserts.

    python -m bench.kernels.v4_attention [--contexts 2048,8192,32768] [--topk 512] [--repeats 7] [--json OUT]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import add_json_arg, machine_line, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--topk", type=int, default=512, help="CSA entries the indexer keeps")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=512)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    add_json_arg(ap)
    a = ap.parse_args()

    from colibri.models.deepseek_v4 import v4_attention

    print(machine_line())
    rng = np.random.default_rng(0)
    H, Dh = a.heads, a.head_dim
    q = rng.standard_normal((1, H, Dh), dtype=np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    scale = np.float32(Dh ** -0.5)
    rows = []
    for n in (int(c) for c in a.contexts.split(",")):
        keys = rng.standard_normal((n, Dh), dtype=np.float32)
        row = {"context": n}
        for kind, rate in (("csa", 4), ("hca", 128)):
            entries = rng.standard_normal((n // rate, Dh), dtype=np.float32)
            seen = np.zeros((1, entries.shape[0]), bool)
            if kind == "csa":
                seen[0, rng.choice(entries.shape[0], min(a.topk, entries.shape[0]), replace=False)] = True
            else:
                seen[:] = True
            v4_attention(q, keys, n - 1, a.window, scale, sinks, entries, seen)  # first use
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                v4_attention(q, keys, n - 1, a.window, scale, sinks, entries, seen)
                times.append(time.perf_counter() - t0)
            row[f"{kind}_ms"] = float(np.median(times)) * 1e3
        rows.append(row)
        print(f"context {n:6d}: CSA ({n // 4} entries, {min(a.topk, n // 4)} kept) {row['csa_ms']:7.2f} ms, "
              f"HCA ({n // 128} entries) {row['hca_ms']:7.2f} ms")
    write_json(a.json, {"rows": rows})


if __name__ == "__main__":
    main()
