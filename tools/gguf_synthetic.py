"""The GGUF twin of a synthetic colibri container (tools/synthetic_moe.py): the same model, the
same numbers, as a GGUF llama.cpp runs, so the two engines are compared on identical weights.

    python -m tools.gguf_synthetic CONTAINER_DIR OUT.gguf

colibri's int4 g64 (a float scale per 64 weights, byte k of a group holding weights k and
k + 32) is rewritten as pairs of Q4_0 blocks (an f16 scale per 32 weights, byte j holding
weights j and j + 16) with the nibbles reordered; both cost 4.5 bits per weight and the
generator's scales are f16-exact, so every weight is the same. q8_0 maps block for block. The
tensors stream to the file one at a time (a 17 GB model never sits in memory). Architectures:
olmoe and qwen3moe (llama.cpp's names for colibri's olmoe and qwen3_moe families).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.formats.qtensor import QTensor

ARCH = {"olmoe": "olmoe", "qwen3_moe": "qwen3moe"}
TOKENIZER_VOCAB = 49152  # SmolLM2's, which the twin carries
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def q4_0_blocks(t: QTensor) -> np.ndarray:
    """int4_g64 [rows, cols] -> Q4_0 bytes [rows, cols // 32 * 18], the same weights."""
    if t.scheme != "int4_g64":
        raise ColibriError(f"expected an int4_g64 tensor, got {t.scheme}")
    rows, cols = t.shape
    c = t.q.reshape(rows, cols // 64, 32)
    lo, hi = c & 0x0F, c >> 4                               # weights k and k + 32 of each group
    out = np.empty((rows, cols // 64, 2, 18), np.uint8)
    d = t.scales.astype(np.float16).view(np.uint8).reshape(rows, cols // 64, 2)
    out[:, :, 0, :2] = d
    out[:, :, 1, :2] = d
    out[:, :, 0, 2:] = lo[..., :16] | (lo[..., 16:] << 4)  # block of weights 0..31
    out[:, :, 1, 2:] = hi[..., :16] | (hi[..., 16:] << 4)  # block of weights 32..63
    return out.reshape(rows, -1)


def q8_0_blocks(t: QTensor) -> np.ndarray:
    rows, cols = t.shape
    out = np.empty((rows, cols // 32, 34), np.uint8)
    out[:, :, :2] = t.scales.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    out[:, :, 2:] = t.q.view(np.uint8).reshape(rows, cols // 32, 32)
    return out.reshape(rows, -1)


def _encode(t) -> tuple[np.ndarray, object]:
    import gguf

    Q = gguf.GGMLQuantizationType
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t, np.float32), Q.F32
    if t.scheme == "int4_g64":
        return q4_0_blocks(t), Q.Q4_0
    if t.scheme == "q8_0":
        return q8_0_blocks(t), Q.Q8_0
    if t.scheme == "f32":
        return np.ascontiguousarray(t.q, np.float32), Q.F32
    raise ColibriError(f"no GGUF encoding for scheme {t.scheme}")


def _tensors(c: Container):
    """(gguf name, producer of the encoded array) in file order."""
    cfg = c.config
    out = [("token_embd.weight", lambda: c.tensor("model.embed_tokens.weight")),
           ("output_norm.weight", lambda: c.tensor("model.norm.weight")),
           ("output.weight", lambda: c.tensor("lm_head.weight"))]
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}", f"blk.{i}"
        for src, dst in _ATTN.items():
            out.append((f"{b}.{dst}.weight", lambda n=f"{p}.self_attn.{src}.weight": c.tensor(n)))
        out.append((f"{b}.attn_norm.weight", lambda n=f"{p}.input_layernorm.weight": c.tensor(n)))
        out.append((f"{b}.ffn_norm.weight", lambda n=f"{p}.post_attention_layernorm.weight": c.tensor(n)))
        out.append((f"{b}.ffn_gate_inp.weight", lambda n=f"{p}.mlp.gate.weight": c.tensor(n)))
        for proj, dst in _EXPERTS.items():
            out.append((f"{b}.{dst}.weight", lambda pre=f"{p}.mlp", pr=proj: _stacked_experts(c, pre, pr)))
    return out


def _stacked_experts(c: Container, prefix: str, proj: str) -> np.ndarray:
    """One projection of every expert of a layer, Q4_0, as [E, rows, bytes]."""
    layout = c.expert_layouts[prefix]
    path, _, nbytes = c.expert_range(prefix, 0)
    blob = np.empty(nbytes, np.uint8)
    parts = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for e in range(layout.num_experts):
            _, off, n = c.expert_range(prefix, e)
            os.preadv(fd, [memoryview(blob)], off)
            parts.append(q4_0_blocks(layout.unpack(blob)[proj]))
    finally:
        os.close(fd)
    return np.stack(parts)


def write_gguf(path: Path, container_dir: Path) -> Path:
    import gguf
    from rich.progress import Progress

    c = Container(container_dir)
    c.interleave_rows = False  # the bytes as stored: the encoders below read rows in order
    cfg = c.config
    arch = ARCH.get(cfg["model_type"])
    if arch is None:
        raise ColibriError(f"no GGUF twin for model_type {cfg['model_type']!r} (supported: {', '.join(ARCH)})")
    path = Path(path)
    if path.exists():
        raise ColibriError(f"{path} already exists; choose a new file")
    if cfg["vocab_size"] < TOKENIZER_VOCAB:
        raise ColibriError(f"the model's vocabulary ({cfg['vocab_size']}) is smaller than SmolLM2's tokenizer "
                           f"({TOKENIZER_VOCAB} tokens): llama.cpp needs one embedding row per token; write the "
                           "model with --vocab 49152 or more")
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    Dh = cfg.get("head_dim") or D // H
    I = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"colibri-synthetic-{cfg.get('colibri_synthetic', {}).get('preset', arch)}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(D)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(Dh)
    w.add_value_length(Dh)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_expert_count(cfg.get("num_experts") or cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    _copy_tokenizer(w, cfg["vocab_size"])
    tensors = _tensors(c)
    # Shapes first (the header lists every tensor), computed without materializing them.
    for name, make in tensors:
        shape, qtype = _shape_of(c, name, make)
        nbytes = int(np.prod(shape))
        w.add_tensor_info(name, shape, np.dtype(np.uint8) if qtype != gguf.GGMLQuantizationType.F32
                          else np.dtype(np.float32), nbytes if qtype != gguf.GGMLQuantizationType.F32 else 4 * nbytes,
                          raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with Progress(transient=True) as bar:
        task = bar.add_task(f"writing {path.name}", total=len(tensors))
        for _, make in tensors:
            t = make()
            w.write_tensor_data(t if isinstance(t, np.ndarray) and t.ndim == 3 else _encode(t)[0])
            bar.advance(task)
    w.close()
    return path


def _shape_of(c: Container, name: str, make):
    """(byte shape, GGML type) of one tensor, from the manifest."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if name.endswith("_exps.weight"):
        layer = int(name.split(".")[1])
        proj = {v: k for k, v in _EXPERTS.items()}[name.split(".")[2]]
        layout = c.expert_layouts[f"model.layers.{layer}.mlp"]
        rows, cols = layout.projections[proj]["shape"]
        return (layout.num_experts, rows, cols // 32 * 18), Q.Q4_0
    src = _source_name(name)
    spec = c.manifest["tensors"][src]
    shape = spec["shape"]
    if spec["scheme"] == "int4_g64":
        return (shape[0], shape[1] // 32 * 18), Q.Q4_0
    if spec["scheme"] == "q8_0":
        return (shape[0], shape[1] // 32 * 34), Q.Q8_0
    return tuple(shape), Q.F32


def _source_name(gguf_name: str) -> str:
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    _, layer, part, _ = gguf_name.split(".")
    p = f"model.layers.{layer}"
    attn = {v: k for k, v in _ATTN.items()}
    if part in attn:
        return f"{p}.self_attn.{attn[part]}.weight"
    return {"attn_norm": f"{p}.input_layernorm.weight", "ffn_norm": f"{p}.post_attention_layernorm.weight",
            "ffn_gate_inp": f"{p}.mlp.gate.weight"}[part]


def _copy_tokenizer(w, vocab: int) -> None:
    """SmolLM2's tokenizer metadata (49152 tokens), copied field by field, padded with unused
    tokens to the model's vocabulary (llama.cpp wants one token per embedding row)."""
    import gguf

    from colibri.default_model import default_gguf

    r = gguf.GGUFReader(str(default_gguf()))
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
            if key == "tokenizer.ggml.tokens":
                if vocab < len(value):
                    raise ColibriError(f"the model's vocabulary ({vocab}) is smaller than the tokenizer's "
                                       f"{len(value)} tokens: llama.cpp needs one embedding row per token; "
                                       "write the model with --vocab 49152 or more")
                value += [f"<colibri_unused_{i}>" for i in range(len(value), vocab)]
            elif key == "tokenizer.ggml.token_type":
                value += [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
            elif key == "tokenizer.ggml.scores":
                value += [0.0] * (vocab - len(value))
            w.add_key_value(key, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype)
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("container", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    try:
        write_gguf(a.out, a.container)
    except ColibriError as e:
        sys.exit(f"error: {e}")
    print(a.out)


if __name__ == "__main__":
    main()
