"""One decode step of an MLA model at long contexts: DeepSeek-V3 / Kimi-K2 (dense MLA), GLM-5
(MLA over the DSA indexer's top-k tokens) and GLM-5.3-Flash (NoPE MLA over the pooled
indexer's pools, between KDA layers), each a slice of its real shapes; likewise DeepSeek V4's
compressed attention (a sliding window, plus the 4:1 entries its indexer picks from or the
128:1 entries).

    python -m bench.engine.mla_decode --model SLICE [--contexts 2048,8192,32768] [--repeats 5]

SLICE: `python -m tools.synthetic_moe DIR --preset P --layers N` (deepseek-v3 --layers 3, glm-5
--layers 3: their leading dense layers; glm-5.3-flash --layers 4: three KDA layers and the first
indexed one; deepseek-v4-flash --layers 4: three HCA layers, then a CSA one); `--shrink N`
instead builds a glm-5.3-flash slice at 1/N of the width in a temporary directory (the tests'
smoke run).

The cache's rows (latents, rope keys, indexer keys; V4's key=value rows, compressor rows and
compressed entries) are filled with random values up to the context rather than by a prefill
(an 8k prompt takes minutes on 2 cores at these widths): the work of a step depends on the
context's length, not on what the rows hold. Each step is one forward of one token (the whole
slice: its attention, FFNs and head); the time printed is the median over --repeats steps.
Where the cache keeps the pooled indexer's pool keys between steps (GLM-5.3-Flash), a second
column clears them before each step: every complete pool's key recomputed, as each step did
before they were kept.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, machine_line, write_json


def fill(cache, n: int, rng, args) -> None:
    """Random rows for the cache's first n positions, in every attention layer's arrays."""
    from colibri.models.deepseek_v4 import CSA, V4Cache

    cache.reserve(n)
    if not isinstance(cache, V4Cache):
        for a in list(cache.k) + list(cache.v):
            a[:, :n] = rng.standard_normal(a[:, :n].shape, dtype=np.float32).astype(a.dtype)
        cache.length = n
        return
    # DeepSeek V4: every position's key=value row, each compressed layer's ring of compressor
    # rows (the last RING positions) and the entries of every window the n positions finish
    for a in cache.k:
        a[:, :n] = rng.standard_normal(a[:, :n].shape, dtype=np.float32)
    for layer in range(args.num_hidden_layers):
        if not args.rate(layer):
            continue
        held = min(n, cache.ring)
        cache.write_rows(layer, n - held, rng.standard_normal((held, args.row_width(layer)), dtype=np.float32))
        cache.entries(layer, "kv", n, lambda w: rng.standard_normal(args.head_dim, dtype=np.float32))
        if args.layer_types[layer] == CSA:
            cache.entries(layer, "index", n, lambda w: rng.standard_normal(args.index_head_dim, dtype=np.float32))
    cache.length = n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an MLA model's slice (or --shrink)")
    ap.add_argument("--shrink", type=int, default=0, help="build a 4-layer glm-5.3-flash slice at 1/N of the width")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=5, help="decode steps timed per context and way (median)")
    add_json_arg(ap)
    a = ap.parse_args()

    from colibri import Engine

    print(machine_line())
    if a.shrink:
        import tempfile

        from tools import synthetic_moe

        a.model = synthetic_moe.write_container(Path(tempfile.mkdtemp()) / "glm53", "glm-5.3-flash", progress=False,
                                                layers=4, width_divisor=a.shrink, vocab=512)
    elif not a.model:
        ap.error("--model or --shrink is required")
    engine = Engine.load(a.model)
    model = engine.model
    model_type = json.loads((Path(a.model) / "config.json").read_text())["model_type"]
    print(f"{a.model}: {model_type}, {model.args.num_hidden_layers} layers")
    rng = np.random.default_rng(0)
    rows = []
    for n in (int(c) for c in a.contexts.split(",")):
        cache = model.new_cache(n + 2 * a.repeats + 2)
        fill(cache, n, rng, model.args)
        ways = ["kept", "recomputed"] if hasattr(cache, "pool_keys") else ["step"]
        times = {w: [] for w in ways}
        model.forward(np.asarray([1]), cache)  # first use: compiles, and fills what a cache keeps
        for _ in range(a.repeats):
            for way in ways:
                if way == "recomputed":
                    cache.pool_keys.clear()
                t0 = time.perf_counter()
                model.forward(np.asarray([1]), cache)
                times[way].append(time.perf_counter() - t0)
        row = {"context": n, **{f"{w}_ms": float(np.median(t)) * 1e3 for w, t in times.items()}}
        rows.append(row)
        print(f"context {n:6d}: " + ", ".join(f"{w} {row[f'{w}_ms']:7.2f} ms" for w in ways) + " a token")
    write_json(a.json, {"model_type": model_type, "rows": rows})


if __name__ == "__main__":
    main()
