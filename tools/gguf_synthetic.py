"""The GGUF twin of a synthetic colibri container (tools/synthetic_moe.py): the same model, the
same numbers, as a GGUF llama.cpp runs, so the two engines are compared on identical weights.

    python -m tools.gguf_synthetic CONTAINER_DIR OUT.gguf

colibri's int4 g64 (a float scale per 64 weights, byte k of a group holding weights k and
k + 32) is rewritten as pairs of Q4_0 blocks (an f16 scale per 32 weights, byte j holding
weights j and j + 16) with the nibbles reordered; both cost 4.5 bits per weight and the
generator's scales are f16-exact, so every weight is the same. q8_0 maps block for block where
its scales are f16 values; the embedding's (1/60) are not, and it goes as F32. The
tensors stream to the file one at a time (a 17 GB model never sits in memory). Architectures:
olmoe, qwen3moe, qwen35moe, qwen3next and gpt-oss (llama.cpp's names for colibri's olmoe,
qwen3_moe, qwen3_5_moe, qwen3_next and gpt_oss families). gpt-oss's MXFP4 experts are GGUF
MXFP4 blocks already (the container keeps GGUF's layout), copied as they are; its sinks,
q/k/v/o, router and expert biases go as F32, with the converter's names (conversion/gpt_oss.py)
and metadata (sliding window, yarn). The hybrids get the transforms llama.cpp's converter
applies (conversion/qwen.py): zero-centred norms written as 1 + w, A_log as ssm_a = -exp(A_log),
qwen35moe's value heads reordered from grouped by key head to tiled (whole rows, whole 64-column
groups of ssm_out: Q4_0 blocks move intact), qwen3next's in_proj_qkvz split into attn_qkv and
attn_gate; bench/io/gguf_twin_logits.py runs llama.cpp on the result.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tools.gguf_writer import add_rope_metadata, rope_of

from colibri.errors import ColibriError
from colibri.formats.ggml_blocks import row_bytes
from colibri.formats.qtensor import QTensor, dequantize
from colibri.io.container import Container
from colibri.io.gguf.config import GPT_OSS_SWA_PERIOD, gpt_oss_layer_types
from colibri.plan.shapes import num_experts

ARCH = {"olmoe": "olmoe", "qwen3_moe": "qwen3moe", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next",
        "gpt_oss": "gpt-oss"}
HYBRID_ARCHS = ("qwen35moe", "qwen3next")  # Gated DeltaNet + gated attention (models/linear_attention.py)
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


class Entry(NamedTuple):
    """One tensor of the twin: its GGUF name, the container tensor it comes from and the
    transform llama.cpp's converter applies on the way (`_transformed`)."""

    name: str
    source: str                   # a tensor's name, or a MoE block's prefix for stacked experts
    transform: str | None = None
    projection: str | None = None  # stacked experts: gate_proj, up_proj or down_proj


def _entries(c: Container, arch: str) -> list[Entry]:
    """The twin's tensors in file order."""
    cfg = c.config
    hybrid = arch in HYBRID_ARCHS
    norm = "unit_offset" if hybrid else None  # zero-centred norms: the converter writes 1 + w
    out = [Entry("token_embd.weight", "model.embed_tokens.weight"),
           Entry("output_norm.weight", "model.norm.weight", norm),
           Entry("output.weight", "lm_head.weight")]
    full = _full_attention_layers(cfg) if hybrid else range(cfg["num_hidden_layers"])
    for i in range(cfg["num_hidden_layers"]):
        p, b = f"model.layers.{i}", f"blk.{i}"
        if arch == "gpt-oss":
            out += _gpt_oss_layer(b, p)
            continue
        if i in full:
            for src, dst in _ATTN.items():
                out.append(Entry(f"{b}.{dst}.weight", f"{p}.self_attn.{src}.weight",
                                 norm if src.endswith("_norm") else None))
        else:
            out += _linear_attention(b, f"{p}.linear_attn", arch)
        out.append(Entry(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight", norm))
        post = "post_attention_norm" if hybrid else "ffn_norm"
        out.append(Entry(f"{b}.{post}.weight", f"{p}.post_attention_layernorm.weight", norm))
        out.append(Entry(f"{b}.ffn_gate_inp.weight", f"{p}.mlp.gate.weight"))
        if hybrid:
            out.append(Entry(f"{b}.ffn_gate_inp_shexp.weight", f"{p}.mlp.shared_expert_gate.weight"))
            out += [Entry(f"{b}.ffn_{proj}_shexp.weight", f"{p}.mlp.shared_expert.{proj}_proj.weight")
                    for proj in ("gate", "up", "down")]
        out += [Entry(f"{b}.{dst}.weight", f"{p}.mlp", projection=proj) for proj, dst in _EXPERTS.items()]
    return out


def _gpt_oss_layer(b: str, p: str) -> list[Entry]:
    """A gpt-oss layer as GptOssModel writes it: q/k/v/o with their biases, the sinks as
    attn_sinks.weight, the router (ffn_gate_inp) with its bias, the stacked experts and their
    biases ([E, out])."""
    out = [Entry(f"{b}.{dst}.{part}", f"{p}.self_attn.{src}.{part}")
           for src, dst in _ATTN.items() if src.endswith("_proj") for part in ("weight", "bias")]
    out += [Entry(f"{b}.attn_sinks.weight", f"{p}.self_attn.sinks"),
            Entry(f"{b}.attn_norm.weight", f"{p}.input_layernorm.weight"),
            Entry(f"{b}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight"),
            Entry(f"{b}.ffn_gate_inp.weight", f"{p}.mlp.router.weight"),
            Entry(f"{b}.ffn_gate_inp.bias", f"{p}.mlp.router.bias")]
    out += [Entry(f"{b}.{dst}.weight", f"{p}.mlp", projection=proj) for proj, dst in _EXPERTS.items()]
    return out + [Entry(f"{b}.{dst}.bias", f"{p}.mlp.experts.{proj}.bias") for proj, dst in _EXPERTS.items()]


def _full_attention_layers(cfg: dict) -> set[int]:
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        return {i for i in range(cfg["num_hidden_layers"]) if (i + 1) % interval == 0}
    return {i for i, t in enumerate(types) if t == "full_attention"}


def _linear_attention(b: str, p: str, arch: str) -> list[Entry]:
    """A Gated DeltaNet layer as the converter writes it (conversion/qwen.py Qwen3NextModel,
    _LinearAttentionVReorderBase): A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the
    conv kernel squeezed to [C, K]; qwen35moe's value heads reordered from grouped by key head
    to tiled (`v_tiled*`); qwen3next's grouped in_proj_qkvz split into [q | k | v] and z."""
    v = arch == "qwen35moe"
    if v:
        proj = [Entry(f"{b}.attn_qkv.weight", f"{p}.in_proj_qkv.weight", "v_tiled_qkv"),
                Entry(f"{b}.attn_gate.weight", f"{p}.in_proj_z.weight", "v_tiled_rows"),
                Entry(f"{b}.ssm_beta.weight", f"{p}.in_proj_b.weight", "v_tiled_heads"),
                Entry(f"{b}.ssm_alpha.weight", f"{p}.in_proj_a.weight", "v_tiled_heads")]
    else:
        proj = [Entry(f"{b}.attn_qkv.weight", f"{p}.in_proj_qkvz.weight", "qkvz_qkv"),
                Entry(f"{b}.attn_gate.weight", f"{p}.in_proj_qkvz.weight", "qkvz_z"),
                Entry(f"{b}.ssm_ba.weight", f"{p}.in_proj_ba.weight")]
    return proj + [
        Entry(f"{b}.ssm_conv1d.weight", f"{p}.conv1d.weight", "v_tiled_conv" if v else "squeeze"),
        Entry(f"{b}.ssm_a", f"{p}.A_log", "neg_exp_tiled" if v else "neg_exp"),
        Entry(f"{b}.ssm_dt.bias", f"{p}.dt_bias", "v_tiled_heads" if v else None),
        Entry(f"{b}.ssm_norm.weight", f"{p}.norm.weight"),  # the gated norm: a plain weight
        Entry(f"{b}.ssm_out.weight", f"{p}.out_proj.weight", "v_tiled_cols" if v else None)]


def tiled_order(n_k_heads: int, per_key: int, dim: int) -> np.ndarray:
    """Rows (of `dim` each) of value heads grouped by key head [g0v0 g0v1 .. g1v0 ..] -> tiled
    [g0v0 g1v0 .. g0v1 g1v1 ..] (the converter's _reorder_v_heads): tiled = grouped[order]."""
    n = n_k_heads * per_key * dim
    return np.arange(n).reshape(n_k_heads, per_key, dim).transpose(1, 0, 2).reshape(n)


def _transformed(c: Container, e: Entry):
    """The container tensor of `e` after the converter's transform, still a QTensor where it
    was one (rows and 32-column blocks move whole, so Q4_0 stays exact)."""
    t = c.tensor(e.source)
    cfg = c.config
    hk, hv = cfg.get("linear_num_key_heads"), cfg.get("linear_num_value_heads")
    dk, dv = cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim")
    kind = e.transform
    if kind is None:
        return t
    if kind == "unit_offset":
        return (np.float32(1.0) + t).astype(np.float32)
    if kind in ("neg_exp", "neg_exp_tiled"):
        a = (-np.exp(t.astype(np.float32))).astype(np.float32)
        return a[tiled_order(hk, hv // hk, 1)] if kind == "neg_exp_tiled" else a
    if kind == "squeeze":
        return np.ascontiguousarray(_values(t).reshape(t.shape[0], -1))
    if kind in ("qkvz_qkv", "qkvz_z"):
        order = _qkvz_order(hk, hv, dk, dv)
        conv = 2 * hk * dk + hv * dv
        return _rows(t, order[:conv] if kind == "qkvz_qkv" else order[conv:])
    key = 2 * hk * dk
    v_rows = tiled_order(hk, hv // hk, dv)
    if kind == "v_tiled_qkv":
        return _rows(t, np.concatenate([np.arange(key), key + v_rows]))
    if kind == "v_tiled_rows":
        return _rows(t, v_rows)
    if kind == "v_tiled_heads":
        order = tiled_order(hk, hv // hk, 1)
        return t[order] if isinstance(t, np.ndarray) else _rows(t, order)
    if kind == "v_tiled_conv":
        w = _values(t).reshape(t.shape[0], -1)
        return np.ascontiguousarray(w[np.concatenate([np.arange(key), key + v_rows])])
    if kind == "v_tiled_cols":
        return _column_blocks(t, tiled_order(hk, hv // hk, dv))
    raise ValueError(kind)


def _qkvz_order(hk: int, hv: int, dk: int, dv: int) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz rows, grouped per key head as [q_g | k_g | v_g | z_g]: the row
    order giving [q | k | v | z] (the converter's split of ssm_in into attn_qkv and attn_gate)."""
    vz = hv // hk * dv
    base = np.arange(hk)[:, None] * (2 * dk + 2 * vz)
    parts = [base + np.arange(dk), base + dk + np.arange(dk), base + 2 * dk + np.arange(vz),
             base + 2 * dk + vz + np.arange(vz)]
    return np.concatenate([q.reshape(-1) for q in parts])


def _values(t) -> np.ndarray:
    return np.asarray(t.q if isinstance(t, QTensor) else t, np.float32)


def _rows(t: QTensor, order: np.ndarray) -> QTensor:
    pick = lambda a: None if a is None else np.ascontiguousarray(a[order])
    return QTensor(t.scheme, (len(order), t.shape[1]), pick(t.q), pick(t.scales), pick(t.mins))


def _column_blocks(t: QTensor, order: np.ndarray) -> QTensor:
    """t with its columns in `order`, which must move whole 64-column groups (int4_g64)."""
    if t.scheme != "int4_g64":
        raise ColibriError(f"column reorder of a {t.scheme} tensor is not supported in the twin")
    groups = order.reshape(-1, 64)
    if np.any(groups[:, 0] % 64) or np.any(groups - groups[:, :1] != np.arange(64)):
        raise ColibriError("the value heads are not whole 64-column groups; write the model with a "
                           "linear_value_head_dim that is a multiple of 64")
    g = groups[:, 0] // 64
    rows = t.shape[0]
    q = t.q.reshape(rows, -1, 32)[:, g].reshape(rows, -1)
    return QTensor(t.scheme, t.shape, np.ascontiguousarray(q), np.ascontiguousarray(t.scales[:, g]))


def _expert_blocks(t: QTensor) -> np.ndarray:
    """An expert matrix's GGUF bytes [rows, row bytes]: int4 g64 as Q4_0 pairs, MXFP4 as it is
    (copied: it is a view of the read buffer, which the next expert reuses)."""
    if t.scheme == "mxfp4":
        return t.q.copy()
    return q4_0_blocks(t)


def _stacked_experts(c: Container, prefix: str, proj: str) -> np.ndarray:
    """One projection of every expert of a layer, in its GGUF type, as [E, rows, bytes]."""
    layout = c.expert_layouts[prefix]
    path, _, nbytes = c.expert_range(prefix, 0)
    blob = np.empty(nbytes, np.uint8)
    parts = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for e in range(layout.num_experts):
            _, off, n = c.expert_range(prefix, e)
            os.preadv(fd, [memoryview(blob)], off)
            parts.append(_expert_blocks(layout.unpack(blob)[proj]))
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
    if arch == "gpt-oss":
        _check_gpt_oss_layer_order(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, c)
    _copy_tokenizer(w, cfg["vocab_size"])
    entries = _entries(c, arch)
    # Q8_0 holds f16 scales: a q8_0 tensor whose scales are not f16 values (the generator's
    # embedding, 1/60 per block) goes as its exact F32 values instead.
    widened = {e.source for e in entries if c.manifest["tensors"].get(e.source, {}).get("scheme") == "q8_0"
               and not _f16_scales(c.tensor(e.source))}
    # Shapes first (the header lists every tensor), computed without materializing them.
    for e in entries:
        shape, qtype = _shape_of(c, e, e.source in widened)
        f32 = qtype == gguf.GGMLQuantizationType.F32
        w.add_tensor_info(e.name, shape, np.dtype(np.float32 if f32 else np.uint8),
                          int(np.prod(shape)) * (4 if f32 else 1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    with Progress(transient=True) as bar:
        task = bar.add_task(f"writing {path.name}", total=len(entries))
        for e in entries:
            if e.name.endswith("_exps.weight"):
                w.write_tensor_data(_stacked_experts(c, e.source, e.projection))
            elif e.source in widened:
                w.write_tensor_data(np.ascontiguousarray(dequantize(c.tensor(e.source)), np.float32))
            else:
                w.write_tensor_data(_encode(_transformed(c, e))[0])
            bar.advance(task)
    w.close()
    return path


def _metadata(w, arch: str, c: Container) -> None:
    """The keys the converter's set_gguf_parameters writes for the family (TextModel's, then
    Qwen2MoeModel's expert lengths and Qwen3NextModel's ssm keys for the hybrids, GptOssModel's
    sliding window)."""
    import gguf

    cfg = c.config
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    Dh = cfg.get("head_dim") or D // H
    I = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    mxfp4 = any(spec["scheme"] == "mxfp4" for layout in c.manifest["experts"].values()
                for spec in layout["projections"].values())
    w.add_name(f"colibri-synthetic-{cfg.get('colibri_synthetic', {}).get('preset', arch)}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(D)
    if cfg.get("intermediate_size") is not None:  # Qwen3.5 MoE's config has none
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = rope_of(cfg)
    add_rope_metadata(w, rope)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(num_experts(cfg))
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(Dh)
    w.add_value_length(Dh)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if mxfp4 else gguf.LlamaFileType.MOSTLY_Q4_0)
    if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(I)
    if arch not in HYBRID_ARCHS:
        return
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    # transformers fills layer_types in from the interval when a config has none, so the
    # converter always writes the per-layer flags
    full = _full_attention_layers(cfg)
    w.add_array(f"{arch}.attention.recurrent_layers", [i not in full for i in range(cfg["num_hidden_layers"])])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(Dh * rope.get("partial_rotary_factor", 0.25)))
    if arch == "qwen35moe":  # _Qwen35MRopeMixin: the loader requires the M-RoPE sections
        w.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0] * 4)[:4])


def _check_gpt_oss_layer_order(cfg: dict) -> None:
    """The converter writes no layer order for gpt-oss: llama.cpp runs its default (sliding
    first, alternating), which the model's must be for the twin to be the same model."""
    n = cfg["num_hidden_layers"]
    default = gpt_oss_layer_types(GPT_OSS_SWA_PERIOD, n)
    if (cfg.get("layer_types") or default)[:n] != default:
        raise ColibriError(f"layer_types {cfg['layer_types']} is not llama.cpp's gpt-oss order (sliding first, "
                           "then alternating), which a GGUF made by its converter runs; no twin written")


def _f16_scales(t: QTensor) -> bool:
    return bool(np.array_equal(t.scales.astype(np.float16).astype(np.float32), t.scales))


def _shape_of(c: Container, e: Entry, widened: bool = False):
    """(byte shape, GGML type) of one tensor, from the manifest; `widened`: a q8_0 tensor
    written as F32."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if e.name.endswith("_exps.weight"):
        layout = c.expert_layouts[e.source]
        spec = layout.projections[e.projection]
        rows, cols = spec["shape"]
        if spec["scheme"] == "mxfp4":
            return (layout.num_experts, rows, row_bytes("mxfp4", cols)), Q.MXFP4
        return (layout.num_experts, rows, cols // 32 * 18), Q.Q4_0
    spec = c.manifest["tensors"][e.source]
    shape = list(spec["shape"])
    cfg = c.config
    if e.transform in ("squeeze", "v_tiled_conv"):
        shape = [shape[0], int(np.prod(shape[1:]))]
    elif e.transform in ("qkvz_qkv", "qkvz_z"):
        z = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
        shape[0] = shape[0] - z if e.transform == "qkvz_qkv" else z
    if spec["scheme"] == "int4_g64":
        return (shape[0], shape[1] // 32 * 18), Q.Q4_0
    if spec["scheme"] == "q8_0" and not widened:
        return (shape[0], shape[1] // 32 * 34), Q.Q8_0
    return tuple(shape), Q.F32


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
