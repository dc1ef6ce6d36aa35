"""What a grammar costs a real generation: SmolLM2 decoding JSON under a schema, the mask time
per token beside the decode step (the goal: under 10% of a step).

    python -m bench.engine.grammar_decode [--model DIR] [--tokens 96]

bench/kernels/grammar_mask.py compares the grammar engines themselves (compile and mask times at a
49k and a ~150k vocabulary); this one measures colibri's Matcher inside Engine.generate.
"""
from __future__ import annotations

import argparse

from bench.common import add_json_arg, machine_line, write_json
from colibri import Engine
from colibri.default_model import default_model_dir
from colibri.grammar import Grammar

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="container (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=96, help="at most this many tokens per generation")
    add_json_arg(ap)
    a = ap.parse_args()
    engine = Engine.load(a.model or default_model_dir())
    ids = engine.encode_prompt("Describe a person as JSON.")
    engine.generate(ids, max_tokens=4)  # compile and warm
    print(machine_line())
    rows = []
    print("temperature  tokens  finish  decode ms/token  mask us/token  mask/decode")
    for temperature in (0.0, 1.0):
        grammar = Grammar.compile(engine.tokenizer, {"json_schema": SCHEMA, "strict": True}, engine.vocab_size)
        g = engine.generate(ids, max_tokens=a.tokens, temperature=temperature, seed=1, constraint=grammar.matcher())
        n = g.completion_tokens
        print(f"{temperature:11.1f}  {n:6d}  {g.finish_reason:6s}  {g.decode_s / n * 1e3:15.2f}  "
              f"{g.grammar_s / n * 1e6:13.0f}  {g.grammar_s / g.decode_s:10.1%}")
        rows.append({"temperature": temperature, "tokens": n, "finish": g.finish_reason,
                     "decode_ms_per_token": g.decode_s / n * 1e3, "mask_us_per_token": g.grammar_s / n * 1e6,
                     "mask_share": g.grammar_s / g.decode_s})
    write_json(a.json, {"model": engine.model_id, "rows": rows}, args=a)


if __name__ == "__main__":
    main()
