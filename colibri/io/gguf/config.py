"""GGUF metadata (`<arch>.*` keys, as llama.cpp's convert_hf_to_gguf.py writes them in each
family's set_gguf_parameters) -> the config.json the family's Hugging Face checkpoint would
hold, so colibri's model code and transformers read one GGUF the same way.

Where the file has no key for a setting, the value is the one llama.cpp runs the
architecture with (e.g. qwen3moe always renormalizes its top-k weights, qwen2moe and olmoe
never do), so colibri computes what llama.cpp computes on the same file.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from colibri.errors import ColibriError

# general.architecture -> colibri / HF model_type
ARCHITECTURES = {"llama": "llama", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe",
                 "glm4moe": "glm4_moe", "deepseek2": "deepseek_v3", "qwen35moe": "qwen3_5_moe",
                 "qwen3next": "qwen3_next", "gpt-oss": "gpt_oss"}
_HF_CLASS = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
             "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
             "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
             "qwen3_next": "Qwen3NextForCausalLM", "gpt_oss": "GptOssForCausalLM"}
_GATING = {1: "softmax", 2: "sigmoid", 3: "sqrtsoftplus"}  # gguf ExpertGatingFuncType


class _Meta:
    def __init__(self, path: Path, meta: dict, arch: str):
        self.path, self.meta, self.arch = path, meta, arch

    def get(self, key: str, default=None):
        return self.meta.get(f"{self.arch}.{key}", default)

    def need(self, key: str):
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            raise ColibriError(f"{self.path.name}: GGUF metadata lacks {full}; the file is incomplete "
                               f"or not a {self.arch} model")
        return self.meta[full]

    def one(self, key: str, default=None, required: bool = False):
        """A per-model value that llama.cpp also accepts as a per-layer array: the array must hold
        one value (zeros aside: layers without the part)."""
        value = self.need(key) if required else self.get(key, default)
        if isinstance(value, list):
            values = sorted({v for v in value if v})
            if len(values) > 1:
                raise ColibriError(f"{self.path.name}: {self.arch}.{key} varies by layer ({values}); colibri "
                                   "supports one value for every layer")
            return values[0] if values else default
        return value


def f32(value) -> float:
    """A float32 metadata value widened as transformers widens it."""
    return float(value)


def build_config(path: Path, meta: dict, arch: str, names: set[str]) -> dict:
    m = _Meta(path, meta, arch)
    layers_with = lambda stem: sorted(int(n.split(".")[1]) for n in names
                                      if n.startswith("blk.") and n.split(".")[2] == stem)
    has = lambda suffix: any(n.endswith(suffix) for n in names)
    if any(n.startswith("rope_freqs.") for n in names):
        raise ColibriError(f"{path.name}: RoPE frequency factors (tensor rope_freqs, e.g. Llama 3.1's rope "
                           "scaling) are not supported yet for GGUF import")
    heads = m.need("attention.head_count")
    hidden = m.need("embedding_length")
    kv_heads = m.one("attention.head_count_kv", heads)
    nextn = int(m.get("nextn_predict_layers", 0) or 0)
    blocks = int(m.need("block_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab_size = m.get("vocab_size", len(tokens) if tokens else None)
    if vocab_size is None:
        raise ColibriError(f"{path.name}: GGUF metadata gives no vocabulary size ({arch}.vocab_size or "
                           "tokenizer tokens)")
    rope_theta = float(m.get("rope.freq_base", 10000.0))
    experts = int(m.get("expert_count", 0) or 0)
    model_type = ARCHITECTURES[arch]
    if arch == "llama" and experts:
        model_type = "mixtral"
    head_dim = m.get("attention.key_length", hidden // heads)
    config = {
        "model_type": model_type,
        "architectures": [_HF_CLASS[model_type]],
        "hidden_size": hidden,
        # Qwen3.5 MoE has no dense feed-forward width (its converter writes none); gpt-oss's is
        # the experts' (expert_feed_forward_length, which llama.cpp reads)
        "intermediate_size": m.one("feed_forward_length", required=arch not in ("qwen35moe", "gpt-oss")),
        "num_hidden_layers": blocks - nextn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        # f32 in the file; widened as transformers widens it (the model computes in f32 anyway)
        "rms_norm_eps": f32(m.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": _rope_parameters(m, rope_theta),
        "max_position_embeddings": m.need("context_length"),
        "vocab_size": vocab_size,
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": has(".attn_q.bias") or has(".attn_k.bias") or has(".attn_v.bias"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if "general.name" in meta:
        config["_name_or_path"] = meta["general.name"]
    moe_ff = m.one("expert_feed_forward_length")
    top_k = m.get("expert_used_count")
    if experts and not top_k:
        raise ColibriError(f"{path.name}: GGUF metadata has {arch}.expert_count={experts} but no "
                           f"{arch}.expert_used_count")
    gating = m.get("expert_gating_func")

    if model_type == "llama":
        rope_dim = m.get("rope.dimension_count", m.get("attention.key_length", hidden // heads))
        config["head_dim"] = rope_dim
        config["mlp_bias"] = has(".ffn_up.bias") or has(".ffn_down.bias") or has(".ffn_gate.bias")
        if m.get("rope.scaling.type", "none") != "none":
            raise ColibriError(f"{path.name}: RoPE scaling (e.g. Llama 3.1's rope_freqs) is not supported yet "
                               "for GGUF import")
        return config
    if model_type == "gpt_oss":
        config.update(_gpt_oss(m, blocks, experts, top_k, head_dim, rope_theta))
        return config
    _check_gating(path, arch, gating, {"glm4moe": ("sigmoid",), "deepseek2": ("sigmoid",)}.get(arch, ("softmax",)))
    if model_type == "mixtral":
        config.update(num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None)
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        routed = set(layers_with("ffn_gate_inp"))
        config.update(num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(blocks) if i not in routed],
                      moe_intermediate_size=moe_ff or config["intermediate_size"],
                      use_sliding_window=False, sliding_window=None,
                      # llama.cpp: qwen3moe always renormalizes the top-k weights, qwen2moe never
                      norm_topk_prob=model_type == "qwen3_moe")
        if model_type == "qwen2_moe":
            config["shared_expert_intermediate_size"] = m.get("expert_shared_feed_forward_length") or \
                config["intermediate_size"]
            config["qkv_bias"] = config["attention_bias"]
            if head_dim == hidden // heads:
                del config["head_dim"]  # Qwen2MoeConfig has none
    elif model_type in ("qwen3_5_moe", "qwen3_next"):
        config.update(_hybrid(m, blocks - nextn, head_dim, rope_theta))
        routed = set(layers_with("ffn_gate_inp"))
        config.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_ff,
                      shared_expert_intermediate_size=m.get("expert_shared_feed_forward_length") or moe_ff,
                      norm_topk_prob=True)  # llama.cpp: both renormalize the top-k weights
        if model_type == "qwen3_next":
            config.update(decoder_sparse_step=1, mlp_only_layers=[i for i in range(blocks - nextn) if i not in routed])
        else:
            del config["intermediate_size"]
    elif model_type == "olmoe":
        config.update(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=False,
                      clip_qkv=m.get("attention.clamp_kqv"))
    elif model_type == "glm4_moe":
        rope_dim = m.get("rope.dimension_count", head_dim // 2)
        factor = rope_dim / head_dim
        config["rope_parameters"]["partial_rotary_factor"] = factor
        config.update(_grouped_routing(m, experts, top_k, moe_ff, config), partial_rotary_factor=factor,
                      use_qk_norm=bool(layers_with("attn_q_norm")), num_nextn_predict_layers=nextn)
    elif model_type == "deepseek_v3":
        rope_dim = m.need("rope.dimension_count")
        kv_lora = m.need("attention.kv_lora_rank")
        if "attention.key_length_mla" in {k[len(arch) + 1:] for k in meta if k.startswith(arch + ".")}:
            qk_head = m.need("attention.key_length_mla")
            v_head = m.need("attention.value_length_mla")
        else:  # files written before llama.cpp split attn_kv_b: key/value lengths are the MHA ones
            qk_head = m.need("attention.key_length")
            v_head = m.need("attention.value_length")
        config.update(_grouped_routing(m, experts, top_k, moe_ff, config),
                      num_key_value_heads=heads,  # llama.cpp writes 1 (MLA run as MQA); HF has one per head
                      head_dim=rope_dim, q_lora_rank=m.get("attention.q_lora_rank"), kv_lora_rank=kv_lora,
                      qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim, v_head_dim=v_head,
                      rope_interleave=True, num_nextn_predict_layers=nextn)
    return config


def _hybrid(m: _Meta, layers: int, head_dim: int, rope_theta: float) -> dict:
    """The Gated DeltaNet fields (Qwen3NextConfig / Qwen3_5MoeTextConfig) from the ssm keys
    Qwen3NextModel.set_gguf_parameters writes; key and value heads share ssm.state_size in
    llama.cpp. Text positions are one on every M-RoPE axis, so qwen35moe's sections do not
    change the rotation: it is the plain partial rope."""
    value_heads = int(m.need("ssm.time_step_rank"))
    recurrent = m.get("attention.recurrent_layers")
    interval = int(m.get("full_attention_interval", 4))
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    factor = m.need("rope.dimension_count") / head_dim
    return {
        "linear_conv_kernel_dim": m.need("ssm.conv_kernel"),
        "linear_key_head_dim": m.need("ssm.state_size"),
        "linear_value_head_dim": m.need("ssm.inner_size") // value_heads,
        "linear_num_key_heads": m.need("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        "full_attention_interval": interval,
        "partial_rotary_factor": factor,
        "rope_parameters": {**_rope_parameters(m, rope_theta), "partial_rotary_factor": factor},
    }


def gpt_oss_layer_types(period: int, layers: int) -> list[str]:
    """llama.cpp's gpt-oss layer order (llama_hparams::set_swa_pattern): layer i slides when
    i % period < period - 1; period 0 slides every layer. The default period, 2, is
    GptOssConfig's order, sliding first."""
    return ["sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
            for i in range(layers)]


GPT_OSS_SWA_PERIOD = 2  # llama.cpp's, when the file has no attention.sliding_window_pattern
GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp's clamp for LLM_FFN_SWIGLU_OAI_MOE (the released configs' too)


def _gpt_oss(m: _Meta, layers: int, experts: int, top_k, head_dim: int, rope_theta: float) -> dict:
    """GptOssConfig's fields as llama.cpp runs the file (src/models/openai-moe.cpp): the experts'
    width from expert_feed_forward_length, the sliding layers from the window pattern's period,
    the clamped SwiGLU's limit and the softmax over the top-k logits hard-coded (llama.cpp reads
    no key for them, so expert_gating_func is not consulted)."""
    period = m.get("attention.sliding_window_pattern", GPT_OSS_SWA_PERIOD)
    if not isinstance(period, int):
        raise ColibriError(f"{m.path.name}: {m.arch}.attention.sliding_window_pattern is a per-layer array; "
                           "llama.cpp reads a period (one number) for gpt-oss and colibri follows it")
    swa_base = m.get("rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != rope_theta:
        raise ColibriError(f"{m.path.name}: {m.arch}.rope.freq_base_swa={swa_base} differs from rope.freq_base="
                           f"{rope_theta}; colibri's gpt_oss runs one rope base for every layer")
    rope_dims = m.get("rope.dimension_count", head_dim)
    if rope_dims != head_dim or m.get("attention.value_length", head_dim) != head_dim:
        raise ColibriError(f"{m.path.name}: {m.arch}.rope.dimension_count={rope_dims} / attention.value_length="
                           f"{m.get('attention.value_length')} differ from the head size {head_dim}; colibri's "
                           "gpt_oss rotates and attends over whole heads of one size")
    rope = _rope_parameters(m, rope_theta)
    if rope["rope_type"] == "yarn":
        # llama.cpp rounds the yarn correction range outward (ggml_rope_yarn_corr_dims); gpt-oss
        # was trained without that rounding (its config.json: truncate false, which transformers,
        # vLLM and SGLang follow): the file cannot say so, every gpt-oss checkpoint does
        rope["truncate"] = False
    return {"intermediate_size": m.one("expert_feed_forward_length", required=True),
            "num_local_experts": experts, "num_experts_per_tok": top_k,
            "sliding_window": m.need("attention.sliding_window"),
            "layer_types": gpt_oss_layer_types(period, layers), "swiglu_limit": GPT_OSS_SWIGLU_LIMIT,
            "rope_parameters": rope}


def _check_gating(path: Path, arch: str, gating, allowed: tuple[str, ...]) -> None:
    if gating is None:
        if arch == "deepseek2":  # llama.cpp's default for a deepseek2 file without the key
            raise ColibriError(f"{path.name}: GGUF metadata has no deepseek2.expert_gating_func, which llama.cpp "
                               "reads as DeepSeek-V2's softmax routing; colibri runs DeepSeek-V3's sigmoid routing only")
        return
    name = _GATING.get(gating, str(gating))
    if name not in allowed:
        raise ColibriError(f"{path.name}: {arch}.expert_gating_func={gating} ({name}) is not implemented for "
                           f"{arch}; colibri routes it with {' or '.join(allowed)}")


def _grouped_routing(m: _Meta, experts: int, top_k, moe_ff, config: dict) -> dict:
    """The grouped sigmoid routing fields (DeepseekV3Config / Glm4MoeConfig)."""
    scale = m.get("expert_weights_scale")
    return {
        "n_routed_experts": experts,
        "num_experts_per_tok": top_k,
        "n_shared_experts": m.get("expert_shared_count", 0),
        "moe_intermediate_size": moe_ff or config["intermediate_size"],
        "first_k_dense_replace": m.get("leading_dense_block_count", 0),
        "routed_scaling_factor": 1.0 if scale is None else f32(scale),
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "n_group": m.get("expert_group_count", 1) or 1,
        "topk_group": m.get("expert_group_used_count", 1) or 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def _rope_parameters(m: _Meta, rope_theta: float) -> dict:
    kind = m.get("rope.scaling.type", "none")
    if kind in (None, "none"):
        return {"rope_type": "default", "rope_theta": rope_theta}
    factor = m.get("rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": rope_theta, "factor": f32(factor)}
    if kind != "yarn":
        raise ColibriError(f"{m.path.name}: {m.arch}.rope.scaling.type={kind!r} is not supported for GGUF import "
                           "(supported: none, linear, yarn)")
    p = {"rope_type": "yarn", "rope_theta": rope_theta, "factor": f32(factor),
         "original_max_position_embeddings": m.need("rope.scaling.original_context_length")}
    for key, hf in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                    ("rope.scaling.yarn_attn_factor", "attention_factor"),
                    ("rope.scaling.yarn_ext_factor", "extrapolation_factor")):
        if m.get(key) is not None:
            p[hf] = f32(m.get(key))
    log_mul = m.get("rope.scaling.yarn_log_multiplier")
    if log_mul is not None and m.arch == "deepseek2":
        # convert_hf_to_gguf writes 0.1 * mscale_all_dim; llama.cpp divides by 0.1f (in float32).
        # The file has no mscale: DeepSeek's checkpoints set it equal to mscale_all_dim (no net
        # attention factor), which is what llama.cpp computes.
        mscale = float(str(np.float32(np.float32(log_mul) / np.float32(0.1))))  # shortest repr
        p.update(mscale=mscale, mscale_all_dim=mscale)
    return p
