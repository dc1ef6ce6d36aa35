"""Model shapes for the synthetic MoE generator (tools/synthetic_moe.py): the real configs of the
frontier MoE models colibri is for, the small presets the tests use, and the list of tensors
(name, shape) a config implies for each family colibri supports.

Real-shape presets copy the published config.json of each model (the shapes only: every
weight is random). `slice_config` keeps the first N decoder layers of one, and records what
was kept in `colibri_synthetic`, so `colibri plan` and `colibri bench` can project the whole
model from a slice that fits this machine's disk. `shrink` divides every width of a preset
(hidden size, heads, ranks, expert count) so the test suite can build each family's exact
layer structure in a few MB.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from colibri.errors import ColibriError
from colibri.plan import shapes

# What the Qwen3-MoE sizes share: the architecture fields of their config.json.
_QWEN3_MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
              "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645}
_YARN_DEEPSEEK = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                  "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                  "mscale": 1.0, "mscale_all_dim": 1.0}
# What the gpt-oss sizes share (their config.json without quantization_config: the experts'
# MXFP4 is a checkpoint format, the shapes are these).
_GPT_OSS = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
            "num_key_value_heads": 8, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
            "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096},
            "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
            "pad_token_id": 199999, "eos_token_id": 200002}


def _gpt_oss_layers(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


# Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults are its shapes); the
# published checkpoint wraps it with a vision tower, whose weights colibri does not run.
_QWEN3_5_MOE = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 248320,
                "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
                "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                "full_attention_interval": 4, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "num_experts": 256, "num_experts_per_tok": 8, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                "max_position_embeddings": 262144, "tie_word_embeddings": False, "bos_token_id": None,
                "eos_token_id": 248044}

# Real models: config.json fields as published (Hugging Face hub), MTP layers left out.
REAL = {
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32),          # Qwen/Qwen3-30B-A3B
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64),        # Qwen/Qwen3-235B-A22B
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (also V3-0324, R1: the same shapes)
        "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "rms_norm_eps": 1e-6, "rope_scaling": _YARN_DEEPSEEK, "rope_theta": 10000.0,
        "max_position_embeddings": 163840, "tie_word_embeddings": False, "hidden_act": "silu",
        "num_nextn_predict_layers": 0, "bos_token_id": 0, "eos_token_id": 1},
    "kimi-k2": {  # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture, 384 experts, 64 heads
        "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
        "norm_topk_prob": True, "first_k_dense_replace": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "scoring_func": "sigmoid",
        "topk_method": "noaux_tc", "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
        "rope_scaling": {**_YARN_DEEPSEEK, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
        "num_nextn_predict_layers": 0, "bos_token_id": 163584, "eos_token_id": 163585},
    "glm-5": {  # transformers' GlmMoeDsaConfig defaults, which are GLM-5's shapes
        "model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "vocab_size": 154880,
        "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "first_k_dense_replace": 3, "q_lora_rank": 2048, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 192, "v_head_dim": 256, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 202752, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1},
    "glm-4.5-air": {  # zai-org/GLM-4.5-Air (transformers' Glm4MoeConfig defaults, plus its q/k/v biases)
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552,
        "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": False, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "hidden_act": "silu", "num_nextn_predict_layers": 0, "bos_token_id": None,
        "eos_token_id": [151329, 151336, 151338]},
    # The Gated DeltaNet hybrids: three linear-attention layers (a recurrent state per sequence) to
    # one gated full-attention layer, a shared expert beside the routed ones.
    "qwen3.6-35b-a3b": dict(_QWEN3_5_MOE),  # Qwen/Qwen3.6-35B-A3B: Qwen3.5-35B-A3B's architecture and shapes
    "qwen3.5-397b-a17b": dict(_QWEN3_5_MOE, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                              linear_num_value_heads=64, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024, num_experts=512, num_experts_per_tok=10),
    "qwen3-next-80b-a3b": {  # Qwen/Qwen3-Next-80B-A3B-Instruct (transformers' Qwen3NextConfig shapes)
        **{k: v for k, v in _QWEN3_5_MOE.items() if k not in ("model_type", "architectures")},
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936,
        "num_hidden_layers": 48, "intermediate_size": 5120, "num_experts": 512, "num_experts_per_tok": 10,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 10000000.0,
        "max_position_embeddings": 262144, "bos_token_id": 151643, "eos_token_id": 151645},
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32,
                        layer_types=_gpt_oss_layers(24)),                       # openai/gpt-oss-20b
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128,
                         layer_types=_gpt_oss_layers(36)),                      # openai/gpt-oss-120b
    # deepseek-ai/DeepSeek-V4-Flash (transformers' DeepseekV4Config defaults, its Flash-Base shapes):
    # 284B total, 13B active; 3 hash-routed layers, two HCA then CSA / HCA in turn
    "deepseek-v4-flash": {
        "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280,
        "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
        "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "num_hash_layers": 3,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1},
    # zai-org/GLM-5.3-Flash's language model (transformers' Glm5NextTextConfig defaults, which name
    # that checkpoint): KDA in three layers of four, NoPE MLA with the pooled DSA indexer in the
    # fourth, 4 hyper-connection streams, 288 experts (top-8) plus a shared one, three dense layers
    "glm-5.3-flash": {
        "model_type": "glm5_next_text", "architectures": ["Glm5NextForConditionalGeneration"],
        "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
        "n_routed_experts": 288, "num_experts_per_tok": 8, "routed_scaling_factor": 2.5, "n_group": 1,
        "topk_group": 1, "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 256, "v_head_dim": 256, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
        "index_kpool": 16, "index_kpool_always_select_tail": True, "swiglu_limit": 10.0, "linear_head_dim": 128,
        "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0, "hc_mult": 4,
        "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
        "tie_word_embeddings": False, "hidden_act": "silu", "pad_token_id": 154820, "bos_token_id": None,
        "eos_token_id": None},
    "minimax-m2": {  # MiniMaxAI/MiniMax-M2 (transformers' MiniMaxM2Config defaults): 230B total, 10B active
        "model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 200064,
        "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256,
        "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
        "max_position_embeddings": 196608, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 200034, "eos_token_id": 200020},
}

# OLMoE-shaped presets (the streaming tests and the earlier benchmarks): SmolLM2's vocabulary.
_OLMOE = {"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "vocab_size": 49152,
          "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "norm_topk_prob": False, "tie_word_embeddings": False, "hidden_act": "silu",
          "bos_token_id": 1, "eos_token_id": 2}
SMALL = {
    "olmoe-1b-7b": dict(_OLMOE, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_experts=64,
                        num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16),
    "medium": dict(_OLMOE, hidden_size=1024, intermediate_size=512, num_hidden_layers=8, num_experts=64,
                   num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=8),
    "small": dict(_OLMOE, hidden_size=512, intermediate_size=256, num_hidden_layers=4, num_experts=16,
                  num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4),
    "tiny": dict(_OLMOE, hidden_size=128, intermediate_size=128, num_hidden_layers=3, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2),
}
# deepseek-ai/DeepSeek-V4-Pro: 1.6T total, 49B active; V4-Flash's architecture at 7168 wide, 61
# layers, 384 experts of 3072 and 128 heads in 16 output groups (its config.json as DeepSeek's
# V4 inference code and the model card give it); the fields they do not give (the indexer's
# heads and width, swiglu_limit, hc_eps) are V4-Flash's
REAL["deepseek-v4-pro"] = dict(REAL["deepseek-v4-flash"], hidden_size=7168, moe_intermediate_size=3072,
                               num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                               n_routed_experts=384, routed_scaling_factor=2.5, o_groups=16, index_topk=1024)

# moonshotai/Kimi-K2.6 (model_type kimi_k25): its text_config, which is what `colibri convert` keeps,
# is Kimi-K2's architecture (1T total, 32B active; the vision tower is not run). The shapes are
# K2's; so are the context fields (K2.6's own were not checked offline).
REAL["kimi-k2.6"] = copy.deepcopy(REAL["kimi-k2"])
PRESETS = {**REAL, **SMALL}


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ColibriError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])


# ----------------------------------------------------------------------------- structure
# The tensor list comes from colibri/plan/shapes.py (what `colibri plan` sizes a config by), so
# the generator and the planner cannot disagree, and tests/test_synthetic.py's comparison with
# transformers' models checks both.

def family(cfg: dict) -> str:
    return {"kimi_k2": "deepseek_v3"}.get(cfg["model_type"], cfg["model_type"])


num_experts = shapes.num_experts
expert_width = shapes.expert_width


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """Which decoder layers route (the same rule colibri's families apply)."""
    return shapes.mlp_kinds(cfg, layer + 1)[layer] == "moe"


def moe_layers(cfg: dict) -> list[int]:
    kinds = shapes.mlp_kinds(cfg, cfg["num_hidden_layers"])
    return [i for i, k in enumerate(kinds) if k == "moe"]


@dataclass(frozen=True)
class Spec:
    """One tensor of the container: `kind` says how to fill it (see synthetic_moe.dense_tensor)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix" | "embedding" | "norm" | "bias" | "router" | "router_bias" | "layer_norm_bias"
    #            | "hash_table" (DeepSeek V4's token -> experts)
    #            | "log_decay" (Gated DeltaNet's A_log) | "conv" (its short convolution)


def _kind(name: str, shape: tuple[int, ...]) -> str:
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name.endswith((".mlp.gate.weight", ".mlp.router.weight")):
        return "router"
    if name.endswith(".gate.e_score_correction_bias"):
        return "router_bias"
    if name.endswith(".gate.tid2eid"):
        return "hash_table"
    if name.endswith(".k_norm.bias"):
        return "layer_norm_bias"
    if name.endswith(".bias") or name.endswith(".dt_bias"):
        return "bias"
    if name.endswith(".A_log"):
        return "log_decay"
    if name.endswith("conv1d.weight"):  # (Kimi Delta Attention's q_conv1d / k_conv1d / v_conv1d too)
        return "conv"
    return "norm" if len(shape) == 1 else "matrix"


def _specs(tensors) -> list[Spec]:
    return [Spec(name, tuple(shape), _kind(name, shape)) for name, shape in tensors]


def layer_specs(cfg: dict, i: int) -> list[Spec]:
    """The dense (resident) tensors of decoder layer i; routed experts come from expert_shapes."""
    return _specs(shapes.layer_tensors(cfg, i, "moe" if is_moe_layer(cfg, i) else "dense"))


def expert_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    return {name.split(".")[-2]: tuple(shape) for name, shape in shapes.expert_tensors(cfg, "x")}


def model_specs(cfg: dict) -> list[Spec]:
    """Embedding, final norm and lm_head (the per-layer tensors come from layer_specs)."""
    return _specs(shapes.outside_layers(cfg))


# ----------------------------------------------------------------------------- slices and scale

def slice_config(cfg: dict, preset: str, layers: int | None, skew: float, seed: int) -> dict:
    """cfg with only its first `layers` decoder layers (None: all), recording what was kept."""
    full = cfg["num_hidden_layers"]
    if layers is not None:
        if layers < 1:
            raise ColibriError(f"--layers must be at least 1, not {layers}")
        if layers > full:
            raise ColibriError(f"--layers {layers}: {preset} has only {full} layers")
        first_moe = next((i for i in range(full) if is_moe_layer(cfg, i)), None)
        if first_moe is not None and layers <= first_moe:
            raise ColibriError(f"--layers {layers} keeps no MoE layer of {preset} (its first {first_moe} "
                               f"layers are dense): use --layers {first_moe + 1} or more")
        cfg = dict(cfg, num_hidden_layers=layers)
        for per_layer in ("mlp_layer_types", "layer_types"):
            if cfg.get(per_layer):
                cfg[per_layer] = cfg[per_layer][:layers]
    cfg["colibri_synthetic"] = {"preset": preset, "seed": seed, "skew": skew,
                                "layers_kept": cfg["num_hidden_layers"], "full_num_hidden_layers": full}
    return cfg


_WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "q_lora_rank", "kv_lora_rank", "o_lora_rank",
           "qk_nope_head_dim", "v_head_dim", "index_head_dim", "head_dim", "shared_expert_intermediate_size",
           "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim")


def shrink(cfg: dict, divisor: int, max_experts: int = 16) -> dict:
    """The same layer structure at 1/divisor of the width: widths stay multiples of 64 (the int4
    group), head counts of at least 2, at most `max_experts` routed experts (grouped routing keeps
    its group count when the experts still divide into groups of 2). For tests."""
    if divisor == 1:
        return dict(cfg)
    out = dict(cfg)
    for k in _WIDTHS:
        if out.get(k):
            out[k] = max(64, out[k] // divisor // 64 * 64)
    for k in ("num_attention_heads", "index_n_heads", "linear_num_key_heads", "linear_num_value_heads",
              "linear_num_heads"):
        if out.get(k):
            out[k] = max(2, out[k] // divisor)
    if out.get("linear_num_value_heads") and out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        out["linear_num_value_heads"] = out["linear_num_key_heads"]
    if out.get("num_key_value_heads"):
        kv = max(1, out["num_key_value_heads"] // divisor)
        out["num_key_value_heads"] = kv if out["num_attention_heads"] % kv == 0 else 1
    if family(out) in ("deepseek_v3", "glm_moe_dsa", "glm5_next_text"):
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out.get("head_dim") is None and out["hidden_size"] % out["num_attention_heads"]:
        out["head_dim"] = 64
    key = next(k for k in ("n_routed_experts", "num_local_experts", "num_experts") if k in out)
    out[key] = min(out[key], max_experts)
    out["num_experts_per_tok"] = min(out["num_experts_per_tok"], out[key] // 2)
    groups = out.get("n_group") or 1
    if groups > 1 and (out[key] % groups or out[key] // groups < 2):
        out["n_group"] = out["topk_group"] = 1
    if out.get("index_topk"):
        out["index_topk"] = 8  # small, so the tests' short prompts exercise the sparse selection
        if out.get("index_kpool"):
            out["index_kpool"] = 4  # (GLM-5.3-Flash's pools: a query keeps 2 of them)
    return out
