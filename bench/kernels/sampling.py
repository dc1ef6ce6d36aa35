"""Sampled decode against greedy: what the sampler costs per token at SmolLM2's 49152 and
Qwen3's 151936 vocabulary, and a model's decode tok/s greedy vs sampled (temperature 0.8, top-p
0.95, top-k 40), interleaved runs. --model takes any container (default: the embedded SmolLM2);
one without a tokenizer (the synthetic models) gets a fixed prompt of token ids.

    python -m bench.kernels.sampling [--repeats 3] [--tokens 128] [--model DIR]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import add_json_arg, interleaved, machine_line, median, write_json
from colibri import Engine
from colibri.default_model import default_model_dir
from colibri.generate import SamplingParams, sample

SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=40)


def per_token_ms(vocab: int, p: SamplingParams, n: int = 200) -> float:
    rng = np.random.default_rng(0)
    # logits shaped like a trained model's: a few likely tokens over a long flat tail
    z = (rng.standard_normal(vocab) * 2).astype(np.float32)
    z[rng.choice(vocab, 20, replace=False)] += 12
    t0 = time.perf_counter()
    for _ in range(n):
        sample(z, p, rng)
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="container (default: the embedded SmolLM2)")
    add_json_arg(ap)
    a = ap.parse_args()
    print(machine_line())
    samplers = {}
    for vocab in (49152, 151936):
        for name, p in (("T 0.8, top-p 0.95, top-k 40", SamplingParams(**SAMPLED)),
                        ("T 0.8, top-p 0.95", SamplingParams(0.8, 0.95)), ("T 1.0", SamplingParams(1.0))):
            samplers[f"{vocab} {name}"] = ms = per_token_ms(vocab, p)
            print(f"sampler at {vocab} tokens, {name}: {ms:.2f} ms/token")
    engine = Engine.load(a.model or default_model_dir())
    if engine.tokenizer is not None:
        ids = engine.encode_prompt("Write a short story about a lighthouse keeper.")
    else:
        ids = np.random.default_rng(0).integers(100, engine.vocab_size, 32).tolist()
    engine.generate(ids, max_tokens=8)

    def once(kind):
        kw = SAMPLED if kind == "sampled" else {}
        return engine.generate(ids, max_tokens=a.tokens, stop_at_eos=False, seed=1, **kw).decode_tok_s

    runs = interleaved(["greedy", "sampled"], a.repeats, once)
    greedy, sampled = (median(runs[k]) for k in ("greedy", "sampled"))
    print(f"{engine.model_id} ({engine.vocab_size} tokens) decode, median of {a.repeats}: greedy {greedy:.1f} tok/s, sampled {sampled:.1f} tok/s "
          f"({sampled / greedy:.1%} of greedy); runs {runs}")
    write_json(a.json, {"sampler_ms_per_token": samplers, "model": engine.model_id, "decode_tok_s": runs,
                        "greedy_tok_s": greedy, "sampled_tok_s": sampled}, args=a)


if __name__ == "__main__":
    main()
