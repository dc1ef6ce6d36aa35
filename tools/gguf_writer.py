"""A GGUF from a (tiny) Hugging Face safetensors checkpoint, laid out as llama.cpp's
convert_hf_to_gguf.py lays it out, for tests that must not need llama.cpp:

    python -m tools.gguf_writer HF_DIR OUT.gguf [--arch qwen3moe] [--type f32] [--split 3]

Per architecture (llama.cpp's conversion/*.py, which bench/io/gguf_layout_oracle.py checks this
against tensor for tensor): tensor names through gguf-py's TensorNameMap, routed experts stacked
per layer into blk.N.ffn_{gate,up,down}_exps ([E, rows, cols]), llama's q/k rope permutation,
deepseek2's kv_b_proj split into attn_k_b (transposed per head) / attn_v_b with its MTP layers
dropped, glm4moe's MTP layers kept (block_count includes them), the Gated DeltaNet hybrids'
transforms (qwen35moe, qwen3next: 1 + w norms, ssm_a = -exp(A_log), tiled value heads, the
in_proj_qkvz split), gpt-oss's experts (conversion/gpt_oss.py: gate_up split into gate and up
rows ::2 / 1::2, the biases alike, `sinks` named `.weight`; float experts transposed to [E, out,
in], MXFP4 `*_blocks` / `*_scales` repacked into GGUF MXFP4 blocks, no requantization), the
metadata keys of each family's set_gguf_parameters, and llama.cpp's type rule (1-D tensors,
norms, routers, biases F32; everything else --type, F16 where a row is not whole blocks).

The tokenizer is the checkpoint's tokenizer.json (a byte-level BPE) when it has one, else a tiny
byte-level BPE trained to the config's vocab_size (`fixture_tokenizer`; `save_fixture_tokenizer`
puts it into the checkpoint directory so llama.cpp's converter reads the same one).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from colibri.errors import ColibriError
from colibri.io import gpt_oss_experts

ARCH_OF = {"llama": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
           "olmoe": "olmoe", "glm4_moe": "glm4moe", "deepseek_v3": "deepseek2", "qwen3_5_moe": "qwen35moe",
           "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next", "gpt_oss": "gpt-oss"}
# (gpt-oss: o200k_harmony, which llama.cpp's pre-tokenizer hash finds to be gpt-4o's o200k)
PRE_OF = {"llama": "llama-bpe", "qwen2moe": "qwen2", "qwen3moe": "qwen2", "olmoe": "olmo",
          "glm4moe": "glm4", "deepseek2": "deepseek-v3", "qwen35moe": "qwen35", "qwen3next": "qwen2",
          "gpt-oss": "gpt-4o"}
HYBRIDS = ("qwen35moe", "qwen3next")
# gguf-py quantizes the first ones; the K and IQ4 types go through colibri's own numpy
# quantizers (formats/ggml_blocks.py, ports of ggml's reference ones).
TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4",
         "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
_MOE_EXPERTS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"^.+\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_FUSED = re.compile(r"^.+\.experts\.(?P<proj>gate_up_proj|down_proj)(\.weight)?$")
_CORPUS = ("the quick brown fox jumps over the lazy dog. colibri runs mixture of experts models "
           "on small machines; experts stream from disk while attention stays resident. "
           "hello world, hello tokens: 0123456789 and some punctuation!? ") * 8


# ---------------------------------------------------------------- tokenizer

def fixture_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` tokens (>= 259): 3 specials, the 256 bytes, then
    merges learned from a fixed text (deterministic), padded with unused tokens if short."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 259:
        raise ColibriError(f"a byte-level fixture tokenizer needs vocab_size >= 259, not {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator([_CORPUS], trainer)
    return tok


def save_fixture_tokenizer(hf_dir: str | Path, vocab_size: int | None = None) -> None:
    """Write fixture_tokenizer(vocab_size or the config's) as HF_DIR/tokenizer.json + tokenizer_config.json."""
    hf_dir = Path(hf_dir)
    if vocab_size is None:
        vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    fixture_tokenizer(vocab_size).save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }, indent=2))


def _vocab(hf_dir: Path, vocab_size: int):
    """(tokens, token types, merges, tokenizer_config) in llama.cpp's gpt2 layout."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(path)) if path.exists() else fixture_tokenizer(vocab_size)
    tc_path = hf_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    spec = json.loads(tok.to_str())
    if spec["model"]["type"] != "BPE":
        raise ColibriError(f"{hf_dir}: the tokenizer is a {spec['model']['type']}, not a byte-level BPE")
    vocab = dict(spec["model"]["vocab"])
    added = {a["content"]: a for a in spec.get("added_tokens", [])}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    by_id = {i: t for t, i in vocab.items()}
    if by_id and max(by_id) >= vocab_size:
        raise ColibriError(f"{hf_dir}: the tokenizer has ids up to {max(by_id)}, beyond vocab_size {vocab_size}")
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # UNUSED
        else:
            tokens.append(t)
            types.append((3 if added[t].get("special") else 4) if t in added else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return tokens, types, merges, tc


# ---------------------------------------------------------------- tensors

class Packed(NamedTuple):
    """A tensor already in a GGUF type, written as it is: gpt-oss's MXFP4 experts, repacked from
    the checkpoint's blocks and scales as the converter repacks them."""

    data: np.ndarray  # uint8 [..., rows, row bytes]
    type_name: str    # "MXFP4"


def _load_state(hf_dir: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as float32, but byte tensors (gpt-oss's MXFP4 blocks and E8M0
    scales) as they are."""
    import torch
    from safetensors import safe_open

    shards = sorted(hf_dir.glob("*.safetensors"))
    if not shards:
        raise ColibriError(f"{hf_dir} holds no .safetensors files")
    state = {}
    for s in shards:
        with safe_open(str(s), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                state[name] = (t if t.dtype == torch.uint8 else t.float()).numpy()
    return state


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (HF rope halves -> interleaved pairs)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensors(arch: str, cfg: dict, state: dict[str, np.ndarray]):
    """(HF-style name llama.cpp maps, array) in llama.cpp's modify_tensors order, experts stacked."""
    n_layers = cfg["num_hidden_layers"]
    experts: dict[int, dict[str, np.ndarray]] = {}
    out = []
    block = "block_sparse_moe" if arch == "llama" else "mlp"

    def flush(layer):  # a layer's stacked experts, once all of its tensors are in (as llama.cpp)
        projs = experts.pop(layer, None)
        for proj in ("down_proj", "gate_proj", "up_proj") if projs else ():  # llama.cpp's order
            ws = projs[proj]
            stacked = ws if isinstance(ws, np.ndarray) else np.stack([ws[e] for e in sorted(ws)])
            if arch == "llama":
                wid = {v: k for k, v in _MOE_EXPERTS.items()}[proj]
                out.append((f"layers.{layer}.feed_forward.experts.{wid}.weight", stacked))
            else:
                out.append((f"model.layers.{layer}.{block}.experts.{proj}.weight", stacked))

    current = None
    for name in sorted(state, key=_order):
        w = state[name]
        layer = _layer(name)
        if layer != current:
            flush(current)
            current = layer
        if arch == "deepseek2" and layer is not None and layer >= n_layers:
            continue  # llama.cpp skips DeepSeek's MTP layers
        if arch == "deepseek2" and name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _permute(w, cfg["num_attention_heads"], cfg["num_attention_heads"])
        if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _permute(w, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if arch in HYBRIDS and (".linear_attn." in name or name.endswith("norm.weight")):
            out += _hybrid_tensor(arch, cfg, name, w)
            continue
        if arch == "gpt-oss" and (m := gpt_oss_experts.EXPERT_TENSOR.match(name)):
            out += _gpt_oss_experts(m["prefix"], m["proj"], m["part"], w, state)
            continue
        if arch == "gpt-oss" and name.endswith(".sinks"):
            name += ".weight"  # GptOssModel.filter_tensors
        if m := _EXPERT.match(name):  # model.layers.N.<block>.experts.E.<proj>.weight
            proj = _MOE_EXPERTS.get(m["proj"], m["proj"])
            experts.setdefault(layer, {}).setdefault(proj, {})[int(m["e"])] = w
            continue
        if m := _FUSED.match(name):  # transformers v5: gate_up_proj [E, 2I, D], down_proj [E, D, I]
            if m["proj"] == "gate_up_proj":
                gate, up = np.split(w, 2, axis=1)
                experts.setdefault(layer, {}).update(gate_proj=gate, up_proj=up)
            else:
                experts.setdefault(layer, {})["down_proj"] = w
            continue
        if name.endswith("kv_b_proj.weight") and arch == "deepseek2":
            h, dn, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = w.reshape(h, dn + dv, w.shape[-1])
            out.append((name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(kv_b[:, :dn].transpose(0, 2, 1))))
            out.append((name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(kv_b[:, dn:])))
            continue
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        out.append((name, w))
    flush(current)
    return out


def _gpt_oss_experts(prefix: str, proj: str, part: str, w: np.ndarray, state: dict) -> list[tuple[str, object]]:
    """One of a gpt-oss layer's stacked expert tensors as GptOssModel writes it: gate_up split
    into gate_proj / up_proj (rows ::2 / 1::2, the biases alike), float experts transposed to
    [E, out, in], MXFP4 blocks with their scales repacked into GGUF MXFP4 rows (its
    repack_mxfp4: the E8M0 byte, then the 16 nibble bytes, value j low and j + 16 high).
    gpt_oss_experts splits them for colibri's converter the same way."""
    if part == "_bias":
        return list(gpt_oss_experts.split_bias(prefix, proj, w).items())
    if part == "_scales":
        return []  # (read with its blocks)
    if part == "_blocks":
        experts = gpt_oss_experts.split_mxfp4(proj, w, state[f"{prefix}.experts.{proj}_scales"])
    else:
        experts = gpt_oss_experts.split_float(proj, w)
    stacks: dict[str, list] = {}
    for _, p, t in experts:
        stacks.setdefault(p, []).append(t.q if part == "_blocks" else t)
    return [(f"{prefix}.experts.{p}.weight", Packed(np.stack(ts), "MXFP4") if part == "_blocks" else np.stack(ts))
            for p, ts in stacks.items()]


def tiled_order(n_k_heads: int, per_key: int, dim: int) -> np.ndarray:
    """Rows (of `dim` each) of value heads grouped by key head [g0v0 g0v1 .. g1v0 ..] -> tiled
    [g0v0 g1v0 .. g0v1 g1v1 ..] (the converter's _reorder_v_heads): tiled = grouped[order]."""
    n = n_k_heads * per_key * dim
    return np.arange(n).reshape(n_k_heads, per_key, dim).transpose(1, 0, 2).reshape(n)


def _hybrid_tensor(arch: str, cfg: dict, name: str, w: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A Gated DeltaNet hybrid's norm or linear-attention tensor as the converter writes it
    (conversion/qwen.py Qwen3NextModel, _LinearAttentionVReorderBase.modify_tensors)."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    key = 2 * hk * dk
    if arch == "qwen35moe" and hv != hk:  # value heads grouped by key head -> tiled
        v, heads = tiled_order(hk, hv // hk, dv), tiled_order(hk, hv // hk, 1)
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            w = np.concatenate([w[:key], w[key:][v]])
        elif name.endswith("in_proj_z.weight"):
            w = w[v]
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            w = w[heads]
        elif name.endswith("out_proj.weight"):
            w = w[:, v]
    if name.endswith(".A_log"):  # torch's float32 exp, as the converter computes it (numpy's differs by ulps)
        import torch

        return [(name, (-torch.exp(torch.from_numpy(np.ascontiguousarray(w)))).numpy())]
    if name.endswith(".dt_bias"):
        return [(name.replace(".dt_bias", ".dt_proj.bias"), w)]
    if "conv1d" in name:
        return [(name, np.ascontiguousarray(w.reshape(w.shape[0], -1)))]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, w + np.float32(1.0))]
    if name.endswith("in_proj_qkvz.weight"):  # per key head [q k v z] -> attn_qkv [q | k | v], attn_gate z
        vz = hv // hk * dv
        q, k, v, z = np.split(w.reshape(hk, 2 * dk + 2 * vz, -1), [dk, 2 * dk, 2 * dk + vz], axis=1)
        qkv = np.concatenate([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hk * vz, -1)])
        return [(name.replace("in_proj_qkvz", "in_proj_qkv"), qkv),
                (name.replace("in_proj_qkvz", "in_proj_z"), np.ascontiguousarray(z.reshape(hk * vz, -1)))]
    return [(name, w)]


def hybrid_metadata(w, arch: str, cfg: dict, full_attention: set[int]) -> None:
    """Qwen3NextModel.set_gguf_parameters' keys (and _Qwen35MRopeMixin's M-RoPE sections)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    # transformers fills layer_types in from the interval when a config has none, so the
    # converter always writes the per-layer flags
    w.add_array(f"{arch}.attention.recurrent_layers",
                [i not in full_attention for i in range(cfg["num_hidden_layers"])])
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))))
    if arch == "qwen35moe":  # the loader requires the M-RoPE sections
        w.add_rope_dimension_sections((list(rope.get("mrope_section", [11, 11, 10])) + [0] * 4)[:4])


def _layer(name: str) -> int | None:
    parts = name.split(".")
    for p in parts:
        if p.isdecimal():
            return int(p)
    return None


def _order(name: str):
    layer = _layer(name)
    return (-1 if layer is None else layer, name)


def _qtype(gguf_name: str, ndim: int, qtype):
    """llama.cpp's prepare_tensors rule."""
    import gguf

    Q = gguf.GGMLQuantizationType
    stem = gguf_name.rsplit(".", 1)[0]
    if ndim <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return Q.F32
    if stem.endswith((".ffn_gate_inp", ".ffn_gate_inp_shexp", ".ssm_conv1d")):
        return Q.F32
    return qtype


# ---------------------------------------------------------------- metadata

def rope_of(cfg: dict) -> dict:
    """The rope settings of a config.json: transformers 5's rope_parameters, or 4's rope_scaling
    with the top-level rope_theta."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta"))
    return rope


def add_rope_metadata(w, rope: dict) -> None:
    """TextModel.set_gguf_parameters' rope keys: a linear or yarn scaling with its parameters,
    and the base frequency."""
    import gguf

    kind = rope.get("rope_type") or rope.get("type")
    if kind == "linear" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for hf, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                        ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                        ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(hf) is not None:
                add(rope[hf])
        attn = rope.get("attention_factor", rope.get("attn_factor"))
        if attn is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(rope["rope_theta"])


def _metadata(w, arch: str, cfg: dict, qtype_name: str) -> None:
    import gguf

    rope = rope_of(cfg)
    n_layers = cfg["num_hidden_layers"]
    blocks = n_layers + (cfg.get("num_nextn_predict_layers") or 0 if arch == "glm4moe" else 0)
    w.add_name(cfg.get("_name_or_path") or f"tiny-{cfg['model_type']}")
    w.add_block_count(blocks)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size") is not None:  # Qwen3.5 MoE's config has none
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if arch == "deepseek2" else cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    add_rope_metadata(w, rope)
    w.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else cfg.get("rms_norm_eps", 1e-6))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    if experts:
        w.add_expert_count(experts)
    if cfg.get("num_experts_per_tok"):
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        w.add_expert_group_used_count(cfg["topk_group"])
    scoring = cfg.get("scoring_func") or ("sigmoid" if arch in ("deepseek2", "glm4moe") else None)
    if scoring is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[scoring])
    head_dim = cfg.get("head_dim")
    if arch != "deepseek2" and head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
                     "mxfp4": 38, "q2_k": 10, "q3_k": 12, "q4_k": 15, "q5_k": 17, "q6_k": 18, "iq4_nl": 25,
                     "iq4_xs": 30}[qtype_name])

    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim or cfg["hidden_size"] // cfg["num_attention_heads"])
    elif arch in ("qwen2moe", "qwen3moe") + HYBRIDS:
        if cfg.get("moe_intermediate_size") is not None:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        if arch in HYBRIDS:
            interval = cfg.get("full_attention_interval", 4)
            types = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                               for i in range(n_layers)]
            hybrid_metadata(w, arch, cfg, {i for i, t in enumerate(types) if t == "full_attention"})
    elif arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
    elif arch == "glm4moe":
        rope_dim = head_dim or cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_rope_dimension_count(int(rope_dim * rope.get("partial_rotary_factor",
                                                           cfg.get("partial_rotary_factor", 0.5))))
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("n_shared_experts") is not None:
            w.add_expert_shared_count(cfg["n_shared_experts"])
        if cfg.get("first_k_dense_replace") is not None:
            w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
        if cfg.get("routed_scaling_factor") is not None:
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob") is not None:
            w.add_expert_weights_norm(cfg["norm_topk_prob"])
        if cfg.get("num_nextn_predict_layers") is not None:
            w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])
    elif arch == "deepseek2":
        w.add_leading_dense_block_count(cfg.get("first_k_dense_replace") if cfg.get("first_k_dense_replace")
                                        is not None else 0)
        w.add_vocab_size(cfg["vocab_size"])
        if cfg.get("q_lora_rank") is not None:
            w.add_q_lora_rank(cfg["q_lora_rank"])
        r, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        w.add_kv_lora_rank(r)
        w.add_key_length(r + rope_dim)
        w.add_value_length(r)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
        if cfg.get("routed_scaling_factor") is not None:
            w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(rope_dim)
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _tokenizer_metadata(w, arch: str, hf_dir: Path, cfg: dict, pre: str | None) -> None:
    tokens, types, merges, tc = _vocab(hf_dir, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre or PRE_OF[arch])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    index = {t: i for i, t in enumerate(tokens)}

    def token(v):
        return (v.get("content") if isinstance(v, dict) else v) if v is not None else None

    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
        t = token(tc.get(key))
        if t in index:
            add(index[t])
    if tc.get("add_bos_token") is not None:
        w.add_add_bos_token(bool(tc["add_bos_token"]))
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


# ---------------------------------------------------------------- writing

def write_gguf(hf_dir: str | Path, out: str | Path, arch: str | None = None, qtype: str = "f32",
               split: int = 1, pre: str | None = None) -> list[Path]:
    """Write HF_DIR as a GGUF at OUT (split into `split` parts named OUT-0000i-of-0000N.gguf);
    returns the files written."""
    import gguf

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or ARCH_OF.get(cfg.get("model_type"))
    if arch not in PRE_OF:
        raise ColibriError(f"no GGUF layout for model_type {cfg.get('model_type')!r} / arch {arch!r} "
                           f"(supported: {', '.join(sorted(set(ARCH_OF.values())))})")
    if qtype not in TYPES:
        raise ColibriError(f"--type {qtype!r} is not one this writer quantizes; choose one of {', '.join(TYPES)}")
    Q = gguf.GGMLQuantizationType
    base_type = Q[qtype.upper()]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    blocks = cfg["num_hidden_layers"] + ((cfg.get("num_nextn_predict_layers") or 0) if arch == "glm4moe" else 0)
    names = gguf.get_tensor_name_map(model_arch, blocks)
    pairs = []
    for name, data in _hf_tensors(arch, cfg, _load_state(hf_dir)):
        if arch == "glm4moe" and name == "model.embed_tokens.weight":
            new = "token_embd.weight"
        else:
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ColibriError(f"{hf_dir}: cannot map tensor {name} to a {arch} GGUF name")
        pairs.append((new, data))
    per_part = math.ceil(len(pairs) / split) if split > 1 else 0
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=per_part)
    _metadata(w, arch, cfg, qtype)
    _tokenizer_metadata(w, arch, hf_dir, cfg, pre)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for new, data in pairs:
        if isinstance(data, Packed):
            w.add_tensor(new, data.data, raw_dtype=Q[data.type_name])
            continue
        t = _qtype(new, data.ndim, base_type)
        block = gguf.GGML_QUANT_SIZES[t][0]
        if data.shape[-1] % block:  # a row that is not whole blocks: a fallback, as llama.cpp's
            t = Q.Q8_0 if data.shape[-1] % 32 == 0 and t != Q.F32 and data.ndim > 1 else Q.F16 if t != Q.F32 else t
        q = _quantize(data.astype(np.float32), t)
        w.add_tensor(new, q, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(out) if split > 1 else [out]


def _quantize(data: np.ndarray, t) -> np.ndarray:
    """gguf-py's quantizer where it has one, else colibri's (ggml_blocks.quantize_blocks, over
    the rows of any stacked tensor)."""
    import gguf

    from colibri.formats.ggml_blocks import SCHEME_OF_GGUF, quantize_blocks

    try:
        return gguf.quants.quantize(data, t)
    except NotImplementedError:
        rows = data.reshape(-1, data.shape[-1])
        return quantize_blocks(rows, SCHEME_OF_GGUF[t.name]).reshape(*data.shape[:-1], -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("hf_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--arch", choices=sorted(PRE_OF), help="llama.cpp architecture (default: from model_type)")
    ap.add_argument("--type", default="f32", choices=TYPES)
    ap.add_argument("--split", type=int, default=1, help="write N parts (gguf-split naming)")
    ap.add_argument("--pre", help="tokenizer.ggml.pre (default: the family's)")
    a = ap.parse_args()
    try:
        for p in write_gguf(a.hf_dir, a.out, a.arch, a.type, a.split, a.pre):
            print(p)
    except ColibriError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
