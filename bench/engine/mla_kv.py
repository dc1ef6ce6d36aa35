"""KV cache memory of the MLA families at long context, measured: the engine's own cache
(colibri.models.cache.MLACache: the compressed latent, the shared rope key and, for GLM-5, the
indexer key) for a full-size config, filled to N tokens in a child process, and its resident
growth read from /proc (VmRSS) beside the array bytes and what expanded per-head K/V would take.

    python -m bench.engine.mla_kv --presets deepseek-v3,glm-5 --contexts 8192,32768
"""
from __future__ import annotations

import argparse
import json
import subprocess

from bench.common import add_json_arg, child_env, machine_line, module_command, write_json


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(preset: str, n: int) -> dict:
    import numpy as np

    from colibri.models import family
    from tools import moe_presets

    cfg = moe_presets.preset_config(preset)
    args = family(cfg["model_type"]).ModelArgs.from_dict(cfg)
    from colibri.models.cache import MLACache

    index_dim = getattr(args, "index_head_dim", 0) if cfg["model_type"] == "glm_moe_dsa" else 0
    before = rss()
    cache = MLACache(args.num_hidden_layers, args.kv_lora_rank, args.qk_rope_head_dim, n, index_dim)
    cache.reserve(n)
    for store in (cache.k, cache.v):
        for a in store:
            a[:, :n] = np.float32(1.0)  # touch every page, as n decoded tokens do
    arrays = sum(a.nbytes for a in cache.k + cache.v)
    expanded = args.num_hidden_layers * n * args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) * 4
    return {"preset": preset, "tokens": n, "layers": args.num_hidden_layers, "array_bytes": arrays,
            "rss_growth": rss() - before, "bytes_per_token": cache.bytes_per_token, "expanded_bytes": expanded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="deepseek-v3,glm-5")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--child", nargs=2)
    add_json_arg(ap)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]))))
        return
    print(machine_line())
    rows = []
    print(f"{'model':12} {'context':>8} {'cache GB (RSS growth)':>22} {'bytes/token':>12} {'expanded K/V GB':>16}")
    for preset in a.presets.split(","):
        for n in (int(v) for v in a.contexts.split(",")):
            p = subprocess.run([*module_command(__spec__.name), "--child", preset, str(n)], capture_output=True,
                               text=True, env=child_env())
            if p.returncode != 0:
                print(f"{preset:12} {n:8d} failed: {p.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(p.stdout)
            rows.append(r)
            print(f"{preset:12} {n:8d} {r['array_bytes'] / 1e9:10.2f} ({r['rss_growth'] / 1e9:5.2f} measured) "
                  f"{r['bytes_per_token']:12d} {r['expanded_bytes'] / 1e9:16.1f}")
    write_json(a.json, {"rows": rows}, args=a)


if __name__ == "__main__":
    main()
