"""Resident MoE decode at real shapes: every expert in RAM, colibri (fused routed-experts kernel,
and the per-expert path it replaced) against llama.cpp on the GGUF twin of the same model
(tools/gguf_synthetic.py: the same weights), with the memory-bandwidth roof beside each figure.

Each engine runs in its own process, one after the other, interleaved over repeats (A B C A B
C). Decode is measured on a fixed forced token sequence fed one token at a time (BENCHMARKS.md
point 7), after one untimed pass over it (warm caches, compiled kernels). The roof is the
bytes a token must read (the dense weights it touches plus top-k experts per MoE layer) over
the measured read bandwidth (bench/membw.py).

    python -m tools.synthetic_moe /work/models/qwen3-30b-a3b --preset qwen3-30b-a3b \
        --gguf /work/models/qwen3-30b-a3b.gguf
    python -m bench.peers.moe_resident --model /work/models/qwen3-30b-a3b --gguf /work/models/qwen3-30b-a3b.gguf \
        --llama-python /work/peer-venv/bin/python

--model may be the .gguf itself (read in place by colibri, colibri/io/gguf_link.py): then both
engines run the same file, whatever its types (e.g. Q4_K_M from llama-quantize).
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


# colibri: the fused routed-experts kernel; -int8: the same with --activations int8;
# -per-expert: one SwiGLU call per expert (the path the fused kernel replaced); -rows: int4
# and q8_0 matrices row-major as stored, not interleaved (EngineConfig.weight_layout);
# llama: llama.cpp.
ENGINES = ["colibri", "colibri-int8", "colibri-per-expert", "colibri-rows", "llama"]


def token_sequence(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(0).integers(100, 49000, size=n).tolist()


def child_colibri(a, fused: bool, activations: str = "f32", layout: str = "interleaved") -> dict:
    from colibri import Engine
    from colibri.bench import layer_kinds
    from colibri.io.experts import ResidentExperts
    from colibri.profile import PHASES, breakdown, phase_bytes

    if not fused:  # the per-expert path: every layer's experts one SwiGLU call at a time
        ResidentExperts.stacked = lambda self, prefix, ids: None
    t0 = time.perf_counter()
    e = Engine.load(a.model, stream_experts=False, max_context=a.tokens + 8, threads=a.threads,
                    activations=activations, weight_layout=layout)
    load_s = time.perf_counter() - t0
    seq = token_sequence(a.tokens)
    e.reset()
    e.feed(seq)                       # untimed: compile, fault in
    e.reset()
    PHASES.start()
    times = e.feed(seq)
    seconds = PHASES.stop()
    kept, _ = layer_kinds(e)
    return {"tok_s": len(times) / sum(times), "load_s": load_s,
            "breakdown": breakdown(seconds, sum(times), len(times), 0.0, kept, weight_bytes=phase_bytes(e.container))}


def child_llama(a) -> dict:
    from bench.peers.expert_streaming import llama_forced_pass
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=str(a.gguf), n_ctx=a.tokens + 8, n_threads=a.threads, n_batch=64, verbose=False)
    load_s = time.perf_counter() - t0
    seq = token_sequence(a.tokens)
    llama_forced_pass(llm, seq)                # untimed, as for colibri
    times = llama_forced_pass(llm, seq)
    return {"tok_s": len(times) / sum(times), "load_s": load_s}


def active_bytes(model: Path) -> tuple[int, int]:
    """(bytes one decoded token reads: dense weights except the embedding + top-k experts per
    MoE layer, of which the experts)."""
    from colibri.io.container import Container

    c = Container(model)
    top_k = int(c.config.get("num_experts_per_tok", 8))
    if c.gguf:  # a GGUF read in place: the dense sizes from its index
        dense = c.dense_bytes - c.tensor_bytes("model.embed_tokens.weight")
    else:
        dense = sum(t.nbytes for n, t in c.dense.tensors.items() if not n.startswith("model.embed_tokens"))
    experts = sum(l.blob_bytes * top_k for l in c.expert_layouts.values())
    return dense + experts, experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--llama-python")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=ENGINES)
    ap.add_argument("--engines", default="colibri,colibri-int8,llama",
                    help=f"comma-separated, from {', '.join(ENGINES)} (llama needs --gguf and --llama-python)")
    add_target_args(ap)
    add_json_arg(ap)
    a = ap.parse_args()
    if a.model.suffix == ".gguf":  # colibri reads the file in place (its index in the cache)
        from colibri.default_model import gguf_model_dir

        a.gguf = a.gguf or a.model
        a.model = gguf_model_dir(a.model, progress=not a.child)
    if a.child:
        out = (child_llama(a) if a.child == "llama" else
               child_colibri(a, fused=a.child != "colibri-per-expert",
                             activations="int8" if a.child == "colibri-int8" else "f32",
                             layout="rows" if a.child == "colibri-rows" else "interleaved"))
        print(json.dumps(out))
        return
    from bench.membw import read_bandwidth

    bw = read_bandwidth(a.threads)
    per_token, experts = active_bytes(a.model)
    roof = bw / per_token
    wanted = a.engines.split(",")
    if unknown := set(wanted) - set(ENGINES):
        ap.error(f"unknown engine(s): {', '.join(sorted(unknown))}")
    engines = [(name, sys.executable) for name in wanted if name != "llama"]
    if "llama" in wanted and a.gguf and a.llama_python:
        engines.append(("llama", a.llama_python))
    env = target_env(child_env({**os.environ, "NUMBA_NUM_THREADS": str(a.threads),
                                "OMP_NUM_THREADS": str(a.threads)}), a)
    args = ["--model", str(a.model), "--tokens", str(a.tokens), "--threads", str(a.threads)]
    if a.gguf:
        args += ["--gguf", str(a.gguf)]

    def once(engine) -> dict:
        name, py = engine
        p = subprocess.run([*module_command(__spec__.name, py), "--child", name, *args], capture_output=True,
                           text=True, env=env, timeout=1800)
        if p.returncode != 0:
            return {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
        return json.loads(p.stdout.strip().splitlines()[-1])

    rows = {name: rs for (name, _), rs in interleaved(engines, a.repeats, once).items()}
    report = {"model": str(a.model), "threads": a.threads, "read_bandwidth_gbs": bw / 1e9,
              "bytes_per_token": per_token, "expert_bytes_per_token": experts, "roof_tok_s": roof, "runs": rows}
    if a.json:
        write_json(a.json, report, args=a)
        if a.json == "-":
            return
    print(machine_line())
    print("# " + target_line(a))
    print(f"{a.model.name}: {per_token / 1e9:.2f} GB read per token ({experts / 1e9:.2f} GB of experts); "
          f"read bandwidth {bw / 1e9:.1f} GB/s on {a.threads} threads -> roof {roof:.2f} tok/s")
    llama = [r["tok_s"] for r in rows.get("llama", []) if "tok_s" in r]
    for name, runs in rows.items():
        ok = [r["tok_s"] for r in runs if "tok_s" in r]
        if not ok:
            print(f"{name:20} failed: {runs[0].get('error')}")
            continue
        med = median(ok)
        vs = f"  {med / median(llama):.2f}x llama.cpp" if llama and name != "llama" else ""
        print(f"{name:20} {med:6.2f} tok/s (runs: {', '.join(f'{t:.2f}' for t in ok)})  "
              f"{100 * med / roof:3.0f}% of roof{vs}")
        bd = min((r for r in runs if "tok_s" in r), key=lambda r: abs(r["tok_s"] - med)).get("breakdown")
        if bd:  # of the run nearest the median
            print("    per token (ms): " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in bd["per_token_s"].items()))
            print("    weights read, GB/s (% of the read bandwidth): " + ", ".join(
                f"{k} {v:.1f} ({100 * v / (bw / 1e9):.0f}%)" for k, v in bd.get("gb_per_s", {}).items()))


if __name__ == "__main__":
    main()
