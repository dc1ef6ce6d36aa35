"""What `--activations int8` changes in greedy output: a fixed set of chat prompts, N greedy
tokens each with exact (f32) and int8 activations; prints per prompt where the two first
differ, and the share of tokens identical up to that point. (The KL divergence of the
next-token distribution over a fixed text is `colibri perplexity --activations int8
--kl-divergence REF`: README, Quality.)

    python -m bench.engine.int8_fidelity [-m MODEL] [--tokens 48]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import machine_line


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How many days are there in a leap year, and why?",
]


def main() -> None:
    from colibri.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args()
    if a.model is None:
        from colibri.default_model import default_model_dir

        a.model = default_model_dir(progress=False)
    engines = {m: Engine.load(a.model, activations=m) for m in ("f32", "int8")}
    same_total = first_total = 0
    print(machine_line())
    print(f"{a.model.name}: {len(PROMPTS)} prompts, {a.tokens} greedy tokens each, exact vs int8 activations")
    for p in PROMPTS:
        out = {m: e.generate(p, max_tokens=a.tokens, temperature=0, stop_at_eos=False).token_ids
               for m, e in engines.items()}
        x, y = out["f32"], out["int8"]
        first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        same_total += sum(u == v for u, v in zip(x, y))
        first_total += first
        print(f"  first difference at token {first:>3} of {len(x)}: {p}")
    n = len(PROMPTS) * a.tokens
    print(f"tokens before the first difference: {first_total}/{n} ({100 * first_total / n:.0f}%); "
          f"same token at the same position: {same_total}/{n}")


if __name__ == "__main__":
    main()
