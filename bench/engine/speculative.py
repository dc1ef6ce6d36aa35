"""Speculative decoding, measured: decode tok/s with and without prompt-lookup drafts, the drafts'
acceptance, and (on a model whose experts stream from disk) MB of experts read per generated
token. Modes run interleaved (off, ngram, auto, off, ...), each generation from an empty slot;
the tokens are checked to be identical across modes. Benchmark only: no asserts.

    python -m bench.engine.speculative [--repeats 3] [--tokens 200]                # SmolLM2: edit/repeat and free-form prompts
    python -m bench.engine.speculative --model /work/medium-moe --ram-gb 0.14      # streamed experts (random ids prompt)
    python -m bench.engine.speculative --row-cost                                  # ms of one forward_rows pass, 1-9 rows
"""
from __future__ import annotations

import argparse

import numpy as np

from bench.common import add_json_arg, interleaved, machine_line, median, write_json


CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config needs a name")
    data.setdefault("threads", 4)
    data.setdefault("verbose", False)
    return data


def save_config(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
'''
TODO = ("- buy milk\n- call the bank\n- water the plants\n- book train tickets\n- pay the electricity bill\n"
        "- send the report to Anna\n- fix the bike tyre\n- return the library books")
# Prompts that ask to repeat and edit a given text, and one that does not. How much of the
# answer a drafter can find depends on how faithfully the model copies: SmolLM2-135M drops and
# rewrites lines when asked for type hints, and copies when asked to repeat.
PROMPTS = {
    "copy-edit": "Rewrite this Python code with type hints added to every function. Keep everything else "
                 "exactly the same.\n\n" + CODE,
    "repeat-doc": "Repeat the following code exactly, then add a docstring to each function.\n\n" + CODE,
    "list-edit": "Copy this list and add [ ] before each item:\n\n" + TODO,
    "free-form": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="container (default: the embedded SmolLM2)")
    ap.add_argument("--ram-gb", type=float, default=None, help="stream experts under this budget")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--draft-tokens", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-eos", dest="stop_at_eos", action="store_false",
                    help="generate --tokens tokens past the end of the answer (default: stop at it)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--row-cost", action="store_true", help="time DecoderModel.forward_rows with 1-9 rows instead")
    add_json_arg(ap)
    a = ap.parse_args()

    from colibri import Engine

    options = dict(threads=a.threads)
    if a.ram_gb is not None:
        options.update(ram_gb=a.ram_gb, stream_experts=True)
    engine = Engine.load(a.model, **options)
    if a.row_cost:
        row_cost(engine)
        return
    if engine.tokenizer is None or a.ram_gb is not None:
        # Random-weight MoE shapes have no meaningful text: random ids; their greedy output
        # falls into loops after a while, which is what lookup drafts find.
        prompts = {"random ids": np.random.default_rng(1).integers(0, engine.vocab_size, 16).tolist()}
        a.stop_at_eos = False  # a random model's end token means nothing: always --tokens tokens
    else:
        prompts = PROMPTS
    modes = ["off", "ngram", "auto"]
    print(machine_line())
    print(f"model {engine.model_id}; {a.tokens} tokens per generation, {a.draft_tokens} drafts per pass, "
          f"{a.repeats} interleaved repeats, medians")
    print(f"{'prompt':11} {'mode':6} {'decode tok/s':>12} {'x off':>6} {'acceptance':>10} {'MB read/token':>13} {'same tokens':>11}")
    report = []
    for name, prompt in prompts.items():
        def once(m):
            for i in range(len(engine.slots)):
                engine.reset(i)
            before = engine.expert_stats
            g = engine.generate(prompt, max_tokens=a.tokens, stop_at_eos=a.stop_at_eos, speculative=m,
                                draft_tokens=a.draft_tokens)
            after = engine.expert_stats
            read = (after["bytes_read"] - before["bytes_read"]) / len(g.token_ids) / 1e6 if after else None
            return g, read

        runs = interleaved(modes, a.repeats, once)
        ref = runs["off"][0][0].token_ids
        base = median(runs["off"], lambda r: r[0].decode_tok_s)
        for m in modes:
            tok_s = median(runs[m], lambda r: r[0].decode_tok_s)
            acc = runs[m][-1][0].speculative
            acc_text = f"{100 * acc['acceptance']:9.0f}%" if acc and acc["drafted"] else f"{'-':>10}"
            reads = [r for _, r in runs[m] if r is not None]
            read_text = f"{median(reads):13.2f}" if reads else f"{'-':>13}"
            same = all(g.token_ids == ref for g, _ in runs[m])
            report.append({"prompt": name, "mode": m, "decode_tok_s": tok_s, "vs_off": tok_s / base,
                           "acceptance": acc["acceptance"] if acc and acc["drafted"] else None,
                           "mb_read_per_token": median(reads) if reads else None, "same_tokens": same,
                           "runs_tok_s": [g.decode_tok_s for g, _ in runs[m]]})
            print(f"{name:11} {m:6} {tok_s:12.1f} {tok_s / base:5.2f}x {acc_text} {read_text} {str(same):>11}")
    write_json(a.json, {"model": engine.model_id, "rows": report}, args=a)


def row_cost(engine) -> None:
    """What a drafted pass (or a batch step) costs per row: forward_rows over 1-9 consecutive
    positions after a ~300-token context, median of 30."""
    import time

    model = engine.model
    cache = model.new_cache(4096)
    model.forward(np.asarray(engine.encode_prompt("Write a long story about a fox. " * 30)), cache)
    base = cache.length
    one = None
    for rows in (1, 2, 3, 5, 9):
        times = []
        for _ in range(30):
            cache.truncate(base)
            t0 = time.perf_counter()
            model.forward_rows([5] * rows, [cache] * rows)
            times.append(time.perf_counter() - t0)
        t = median(times)
        one = one or t
        extra = f", each extra row {(t - one) / (rows - 1) / one:.2f} of a step" if rows > 1 else ""
        print(f"{rows} rows: {t * 1e3:6.2f} ms{extra}")


if __name__ == "__main__":
    main()
