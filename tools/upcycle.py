"""Upcycle a dense llama container (e.g. SmolLM2-135M) into a real MoE: each layer's FFN is
copied into E identical experts behind a random router (mixtral layout, normalized top-k).
Since the top-k weights sum to one, the MoE computes the dense FFN, so the text stays the
dense model's while routing, streaming and caching are fully exercised.

    python -m tools.upcycle DENSE_CONTAINER OUT_DIR [--experts 8] [--top-k 2]
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from colibri.io.container import Container, ContainerWriter

_FFN = ("gate_proj", "up_proj", "down_proj")


def upcycle(src: Path, out: Path, experts: int = 8, top_k: int = 2, seed: int = 0) -> Path:
    c = Container(src)
    if c.config.get("model_type") != "llama":
        raise SystemExit(f"{src}: expected a dense llama container, got {c.config.get('model_type')}")
    rng = np.random.default_rng(seed)
    cfg = dict(c.config, model_type="mixtral", architectures=["MixtralForCausalLM"],
               num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    w = ContainerWriter(out, bits=c.manifest.get("bits", 0), source=f"upcycle:{src}")
    for name in c.manifest["tensors"]:
        if ".mlp." not in name:
            w.add_dense(name, c.tensor(name))
    D = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        ffn = {p: c.tensor(f"model.layers.{i}.mlp.{p}.weight") for p in _FFN}
        prefix = f"model.layers.{i}.block_sparse_moe"
        w.add_dense(f"{prefix}.gate.weight", rng.normal(0, 1.0, size=(experts, D)).astype(np.float32))
        w.add_expert_layer(prefix, i, [ffn] * experts)
    extra = {n: (src / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json",
                                                "generation_config.json") if (src / n).exists()}
    w.finish(cfg, extra)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    a = ap.parse_args()
    if a.out.exists():
        shutil.rmtree(a.out)
    print(upcycle(a.src, a.out, a.experts, a.top_k))


if __name__ == "__main__":
    main()
