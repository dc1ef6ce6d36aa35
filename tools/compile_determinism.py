"""Does a start that compiles the kernels give the same bits as one that loads them from numba's
cache? Run it twice with the same empty cache directory; the second run compares its logits with
the first's:

    export NUMBA_CACHE_DIR=$(mktemp -d)
    python -m tools.compile_determinism /tmp/logits.npy   # compiles, saves the logits
    python -m tools.compile_determinism /tmp/logits.npy   # loads from the cache, compares

The model is a tiny OLMoE-shaped synthetic (written once to --model-dir), decoded greedily
from a fixed prompt; the final token's logits are compared bit for bit. Found 2026-12-01: they
differ in the last bit (<= 2.4e-7), tokens equal (docs/design.md section 11, "Same input, same bits").
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logits", type=Path, help="where the first run saves its logits and the second reads them")
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/colibri-determinism-model"))
    a = ap.parse_args()

    from tools import synthetic_moe

    from colibri import generate as gen
    from colibri.engine import Engine

    if not a.model_dir.exists():
        synthetic_moe.write_container(a.model_dir, "olmoe-1b-7b", progress=False, vocab=512, layers=2,
                                      width_divisor=8)
    prompt = np.random.default_rng(1).integers(0, 512, size=24).tolist()
    engine = Engine.load(a.model_dir, max_context=64, stream_experts=False)
    cache = engine.slots[0].cache
    gen.prefill(engine.model, cache, prompt[:4])
    for tok in prompt[4:-1]:
        gen.decode_one(engine.model, cache, tok)
    logits = gen.decode_one(engine.model, cache, prompt[-1])
    if not a.logits.exists():
        np.save(a.logits, logits)
        print(f"saved the logits to {a.logits}; run again (same NUMBA_CACHE_DIR) to compare")
        return
    first = np.load(a.logits)
    if np.array_equal(first, logits):
        print("identical bits")
    else:
        print(f"differ: {int((first != logits).sum())} of {logits.size} logits, max |diff| "
              f"{float(np.abs(first - logits).max()):.3g}; argmax {int(first.argmax())} vs {int(logits.argmax())}")


if __name__ == "__main__":
    main()
