"""DeepSeek V4 at its real shapes, from a slice (tools/synthetic_moe.py --preset deepseek-v4-flash
--layers N): per-layer decode times by attention kind (sliding / CSA / HCA) and MoE kind (hash /
scored), the whole model projected from them, and what reading the hash layers' experts from the
token ids (before any layer runs) hides of their disk reads.

    python -m tools.synthetic_moe /tmp/v4flash --preset deepseek-v4-flash --layers 4
    python -m bench.engine.deepseek_v4_slice --model /tmp/v4flash [--tokens 16] [--stream-gb 4] [--json OUT]

Resident: every expert in RAM, `--tokens` decode steps after a 64-token prompt, phases timed per
layer (colibri/profile.py); the projection puts each layer of the full model (its schedule from
the config: plan/shapes.v4_schedule) at the measured mean of its kinds, plus embedding and head
once. Streamed: a `--stream-gb` RAM budget (experts read from the file as routed), the page cache
dropped before each run (root), the same tokens with the hash read-ahead on and off, alternated
`--repeats` times: the hash layers' routed-expert time per token (which includes waiting for the
disk) and the store's total disk wait.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, machine_line, write_json

PROMPT = 64


def _layers(engine) -> list[tuple[str, str]]:
    args = engine.model.args
    return [(args.layer_types[i], args.mlp_layer_types[i]) for i in range(len(engine.model.layers))]


def _decode(engine, prompt: list[int], tokens: list[int]) -> tuple[dict, float]:
    """(phase seconds per token by (phase, layer), decode seconds per token) for `tokens`."""
    from colibri.profile import PHASES

    engine.reset()
    engine.generate(prompt, max_tokens=1, stop_at_eos=False)
    PHASES.start()
    try:
        times = engine.feed(tokens)
    finally:
        seconds = PHASES.stop()
    steady = times[1:] or times
    return {k: v / len(times) for k, v in seconds.items()}, sum(steady) / len(steady)


def resident(model: str, prompt: list[int], tokens: list[int]) -> dict:
    from colibri import Engine
    from colibri.plan.shapes import v4_schedule

    engine = Engine.load(model, max_context=PROMPT + len(tokens) + 8)
    _decode(engine, prompt, tokens[:2])  # warm: compile, fault the weights in
    per, step = _decode(engine, prompt, tokens)
    kinds = _layers(engine)
    attn, ffn = defaultdict(list), defaultdict(list)
    rows = []
    for i, (a, m) in enumerate(kinds):
        t_attn, t_ffn = per.get(("attention", i), 0.0), per.get(("ffn", i), 0.0)
        attn[a].append(t_attn)
        ffn[m].append(t_ffn)
        rows.append({"layer": i, "attention": a, "mlp": m, "attention_ms": 1e3 * t_attn, "ffn_ms": 1e3 * t_ffn,
                     "routed_experts_ms": 1e3 * per.get(("routed_experts", i), 0.0)})
    outside = per.get(("embed", -1), 0.0) + per.get(("head", -1), 0.0)
    glue = step - outside - sum(per.get(("attention", i), 0.0) + per.get(("ffn", i), 0.0) for i in range(len(kinds)))
    cfg = engine.container.config
    full_n = (cfg.get("colibri_synthetic") or {}).get("full_num_hidden_layers") or len(kinds)
    types, mlp, _ = v4_schedule(dict(cfg, num_hidden_layers=full_n, layer_types=None, mlp_layer_types=None)
                                if full_n > len(kinds) else cfg)
    mean = {k: float(np.mean(v)) for k, v in {**attn, **{f"mlp:{k}": v for k, v in ffn.items()}}.items()}
    missing = sorted({t for t in types if t not in attn} | {m for m in mlp if m not in ffn})
    any_attn = float(np.mean([t for v in attn.values() for t in v]))  # a kind the slice lacks: the mean of all
    any_ffn = float(np.mean([t for v in ffn.values() for t in v]))
    full = outside + max(glue, 0.0) * full_n / len(kinds) + sum(
        mean.get(t, any_attn) + mean.get(f"mlp:{m}", any_ffn) for t, m in zip(types, mlp))
    return {"slice_layers": len(kinds), "slice_tok_s": 1.0 / step, "layers": rows,
            "mean_ms": {k: 1e3 * v for k, v in mean.items()}, "embed_head_ms": 1e3 * outside,
            "full_layers": full_n, "full_s_per_token": full, "full_tok_s": 1.0 / full,
            "kinds_not_in_slice": missing,
            "note": "projection: every layer of the full model at the measured mean of its attention kind and its "
                    "MoE kind, embedding and head once, the glue scaled by layers; experts resident"}


def streamed(model: str, prompt: list[int], tokens: list[int], ram_gb: float, repeats: int,
             expert_io: str = "pread") -> dict:
    from colibri import Engine
    from colibri.bench import _drop_caches

    runs = {True: [], False: []}
    for _ in range(repeats):
        for ahead in (True, False):
            dropped = _drop_caches()
            engine = Engine.load(model, max_context=PROMPT + len(tokens) + 8, ram_gb=ram_gb, stream_experts=True,
                                 expert_io=expert_io)
            engine.model.read_hash_ahead = ahead
            hashed = [i for i, (_, m) in enumerate(_layers(engine)) if m == "hash_moe"]
            s0 = engine.expert_stats
            per, step = _decode(engine, prompt, tokens)
            s1 = engine.expert_stats
            runs[ahead].append({
                "page_cache_dropped": dropped, "tok_s": 1.0 / step,
                "hash_layers_routed_ms": 1e3 * sum(per.get(("routed_experts", i), 0.0) for i in hashed),
                "other_layers_routed_ms": 1e3 * sum(v for (p, i), v in per.items()
                                                    if p == "routed_experts" and i not in hashed),
                "disk_wait_ms_per_token": 1e3 * (s1["wait_s"] - s0["wait_s"]) / (len(tokens) + 1 + len(prompt) / 64),
                "misses": s1["misses"] - s0["misses"]})
    summary = {}
    for ahead, rs in runs.items():
        summary["ahead" if ahead else "on_demand"] = {
            k: float(np.median([r[k] for r in rs])) for k in ("tok_s", "hash_layers_routed_ms",
                                                              "other_layers_routed_ms", "disk_wait_ms_per_token")}
    a, d = summary["ahead"]["hash_layers_routed_ms"], summary["on_demand"]["hash_layers_routed_ms"]
    summary["hash_read_time_hidden"] = (d - a) / d if d > 0 else None
    return {"ram_gb": ram_gb, "expert_io": expert_io, "repeats": repeats, "runs": {str(k): v for k, v in runs.items()}, "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a deepseek_v4 container (a synthetic slice)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--stream-gb", type=float, default=None, help="also the streamed comparison under this RAM budget")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--expert-io", default="pread", choices=("pread", "direct", "mmap"), help="how missed experts are read")
    p.add_argument("--skip-resident", action="store_true", help="only the streamed comparison")
    add_json_arg(p)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    vocab = min(int(cfg["vocab_size"]), 49152)  # ids the generator's tokenizer types
    prompt, tokens = rng.integers(100, vocab, PROMPT).tolist(), rng.integers(100, vocab, a.tokens).tolist()
    print(machine_line())
    report = {"machine": machine_line(), "model": a.model}
    if not a.skip_resident:
        report["resident"] = r = resident(a.model, prompt, tokens)
        print(f"resident {r['slice_layers']}-layer slice: {r['slice_tok_s']:.2f} tok/s")
        for row in r["layers"]:
            print(f"  layer {row['layer']}: {row['attention']:<29} {row['mlp']:<8} attention "
                  f"{row['attention_ms']:6.2f} ms  ffn {row['ffn_ms']:6.2f} ms (routed experts {row['routed_experts_ms']:.2f})")
        print(f"  embedding + head {r['embed_head_ms']:.2f} ms; full {r['full_layers']}-layer model projected: "
              f"{r['full_tok_s']:.3f} tok/s ({r['full_s_per_token']:.3f} s/token)"
              + (f"; kinds not in the slice, at the mean of the others: {r['kinds_not_in_slice']}"
                 if r["kinds_not_in_slice"] else ""))
    if a.stream_gb:
        report["streamed"] = s = streamed(a.model, prompt, tokens, a.stream_gb, a.repeats, a.expert_io)
        for name, v in s["summary"].items():
            if isinstance(v, dict):
                print(f"streamed {a.stream_gb} GB, hash experts {name}: {v['tok_s']:.2f} tok/s, hash layers' routed "
                      f"experts {v['hash_layers_routed_ms']:.1f} ms/token, others {v['other_layers_routed_ms']:.1f}, "
                      f"disk wait {v['disk_wait_ms_per_token']:.1f} ms/token")
        if s["summary"]["hash_read_time_hidden"] is not None:
            print(f"hash layers' expert time hidden by reading from the token ids: "
                  f"{100 * s['summary']['hash_read_time_hidden']:.0f}%")
    write_json(a.json, report, args=a)


if __name__ == "__main__":
    main()
