"""The synthetic MoE of synthetic_moe.py as a GGUF (architecture `olmoe`, Q4_0 matrices, Q8_0
embeddings), so llama.cpp runs a model of the same shapes and bytes per weight (Q4_0 and
colibri's int4 g64 both cost 4.5 bits) next to colibri. Weights are random blocks written
directly as bytes (nothing is quantized), tokenizer metadata is SmolLM2's."""
from __future__ import annotations

from pathlib import Path

import numpy as np

Q4_0_BLOCK = 18  # f16 scale + 16 bytes of nibbles per 32 weights
Q8_0_BLOCK = 34  # f16 scale + 32 int8


def _blocks(rng: np.random.Generator, shape: tuple[int, ...], cols: int, block: int, std: float) -> np.ndarray:
    """Random quantized rows: uint8 [*shape, cols // 32 * block] with f16 scales of about std/4.6."""
    nb = cols // 32
    raw = rng.integers(0, 256, size=(*shape, nb, block), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, size=(*shape, nb)) * std / 4.6).astype(np.float16)
    raw[..., :2] = scales.view(np.uint8).reshape(*shape, nb, 2)
    return raw.reshape(*shape, nb * block)


def write_gguf(path: Path, cfg: dict, seed: int = 0) -> Path:
    import gguf

    from colibri.default_model import default_gguf

    rng = np.random.default_rng(seed + 1000)
    D, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    H, KV, E, V = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["vocab_size"]
    Dh = D // H
    w = gguf.GGUFWriter(str(path), "olmoe")
    w.add_name("colibri-synthetic-olmoe")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(D)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_expert_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    _copy_tokenizer(w, default_gguf())
    Q40, Q80, F32 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    w.add_tensor("token_embd.weight", _blocks(rng, (V,), D, Q8_0_BLOCK, 1.0), raw_dtype=Q80)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32), raw_dtype=F32)
    w.add_tensor("output.weight", _blocks(rng, (V,), D, Q8_0_BLOCK, 0.02), raw_dtype=Q80)
    for i in range(L):
        b = f"blk.{i}"
        for name, rows in (("attn_q", H * Dh), ("attn_k", KV * Dh), ("attn_v", KV * Dh)):
            w.add_tensor(f"{b}.{name}.weight", _blocks(rng, (rows,), D, Q4_0_BLOCK, 0.02), raw_dtype=Q40)
        w.add_tensor(f"{b}.attn_output.weight", _blocks(rng, (D,), H * Dh, Q4_0_BLOCK, 0.02), raw_dtype=Q40)
        w.add_tensor(f"{b}.attn_q_norm.weight", np.ones(H * Dh, np.float32), raw_dtype=F32)
        w.add_tensor(f"{b}.attn_k_norm.weight", np.ones(KV * Dh, np.float32), raw_dtype=F32)
        w.add_tensor(f"{b}.attn_norm.weight", np.ones(D, np.float32), raw_dtype=F32)
        w.add_tensor(f"{b}.ffn_norm.weight", np.ones(D, np.float32), raw_dtype=F32)
        w.add_tensor(f"{b}.ffn_gate_inp.weight", rng.normal(0, 0.5, size=(E, D)).astype(np.float32), raw_dtype=F32)
        w.add_tensor(f"{b}.ffn_gate_exps.weight", _blocks(rng, (E, I), D, Q4_0_BLOCK, 0.02), raw_dtype=Q40)
        w.add_tensor(f"{b}.ffn_up_exps.weight", _blocks(rng, (E, I), D, Q4_0_BLOCK, 0.02), raw_dtype=Q40)
        w.add_tensor(f"{b}.ffn_down_exps.weight", _blocks(rng, (E, D), I, Q4_0_BLOCK, 0.02), raw_dtype=Q40)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _copy_tokenizer(w, src: Path) -> None:
    """SmolLM2's tokenizer metadata (vocab 49152), copied field by field."""
    import gguf

    r = gguf.GGUFReader(str(src))
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype)
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)
