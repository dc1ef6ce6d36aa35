"""What a grammar costs a real generation: SmolLM2 decoding JSON under a schema, the mask time
per token beside the decode step (the goal: under 10% of a step).

    python bench/grammar_decode.py

bench/grammar_mask.py compares the grammar engines themselves (compile and mask times at a
49k and a ~150k vocabulary); this one measures colibri's Matcher inside Engine.generate.
"""
from __future__ import annotations

from colibri import Engine
from colibri.default_model import default_model_dir
from colibri.grammar import Grammar

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def main() -> None:
    engine = Engine.load(default_model_dir())
    ids = engine.encode_prompt("Describe a person as JSON.")
    engine.generate(ids, max_tokens=4)  # compile and warm
    print("temperature  tokens  finish  decode ms/token  mask us/token  mask/decode")
    for temperature in (0.0, 1.0):
        grammar = Grammar.compile(engine.tokenizer, {"json_schema": SCHEMA, "strict": True}, engine.vocab_size)
        g = engine.generate(ids, max_tokens=96, temperature=temperature, seed=1, constraint=grammar.matcher())
        n = g.completion_tokens
        print(f"{temperature:11.1f}  {n:6d}  {g.finish_reason:6s}  {g.decode_s / n * 1e3:15.2f}  "
              f"{g.grammar_s / n * 1e6:13.0f}  {g.grammar_s / g.decode_s:10.1%}")


if __name__ == "__main__":
    main()
