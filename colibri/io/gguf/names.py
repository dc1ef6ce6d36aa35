"""llama.cpp's tensor names (gguf-py's TensorNameMap, per architecture) -> the Hugging Face names
colibri's model code and container read. Routed experts are stacked per layer in GGUF
(`blk.N.ffn_{gate,up,down}_exps`) and stay stacked (GGUFStack); DeepSeek's attn_k_b / attn_v_b
are rejoined into kv_b_proj, Qwen3-Next's attn_qkv / attn_gate into in_proj_qkvz, and the
hybrids' converter transforms undone (checkpoint.py). gpt-oss's expert biases
(`blk.N.ffn_*_exps.bias`, [E, out]) are dense tensors beside their stacks."""
from __future__ import annotations

GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
EXPERT_STEMS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
MLA_SPLIT = ("attn_k_b", "attn_v_b")   # deepseek2: kv_b_proj split for the absorbed MLA form
ROUTING_BIAS = "exp_probs_b"          # blk.N.exp_probs_b.bias -> mlp.gate.e_score_correction_bias

_ATTN = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
_QK_NORM = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_SHARED = {"ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
           "ffn_down_shexp": "mlp.shared_experts.down_proj"}
_NEXTN = {"nextn.eh_proj": "eh_proj", "nextn.enorm": "enorm", "nextn.hnorm": "hnorm",
          "nextn.embed_tokens": "embed_tokens", "nextn.shared_head_head": "shared_head.head",
          "nextn.shared_head_norm": "shared_head.norm"}
_MLA = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj"}

_HYBRID = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
           "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", **_QK_NORM, "ssm_conv1d": "linear_attn.conv1d",
           "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj", "ffn_gate_inp": "mlp.gate",
           "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
           **{k: v.replace("shared_experts", "shared_expert") for k, v in _SHARED.items()}}
HYBRIDS = ("qwen35moe", "qwen3next")  # Gated DeltaNet + gated attention (models/linear_attention.py)
# The hybrids' tensors that name no `.weight` / `.bias` in HF: GGUF name tail -> HF name tail
HYBRID_PARAMETERS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}
# Zero-centred RMSNorm weights, which llama.cpp's converter writes as 1 + w (UnitOffsetNorms)
UNIT_OFFSET_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")
QKVZ_SPLIT = ("attn_qkv", "attn_gate")  # qwen3next: in_proj_qkvz split by the converter
# gpt-oss's sinks: a bare HF parameter (self_attn.sinks), which the converter names `.weight`
UNSUFFIXED = ("attn_sinks",)

# arch -> per-layer GGUF stem -> HF name under model.layers.N
LAYER = {
    "llama": {**_ATTN, "ffn_norm": "post_attention_layernorm", **_DENSE_MLP,
              "ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2moe": {**_ATTN, "ffn_norm": "post_attention_layernorm", **_DENSE_MLP, "ffn_gate_inp": "mlp.gate",
                 "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                 **{k: v.replace("shared_experts", "shared_expert") for k, v in _SHARED.items()}},
    "qwen3moe": {**_ATTN, **_QK_NORM, "ffn_norm": "post_attention_layernorm", **_DENSE_MLP,
                 "ffn_gate_inp": "mlp.gate"},
    "olmoe": {**_ATTN, **_QK_NORM, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
    "glm4moe": {**_ATTN, **_QK_NORM, "post_attention_norm": "post_attention_layernorm", **_DENSE_MLP,
                "ffn_gate_inp": "mlp.gate", **_SHARED, **_NEXTN},
    "deepseek2": {**_MLA, "ffn_norm": "post_attention_layernorm", **_DENSE_MLP, "ffn_gate_inp": "mlp.gate",
                  **_SHARED, **_NEXTN},
    "qwen35moe": {**_HYBRID, "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                  "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"},
    "qwen3next": {**_HYBRID, "ssm_ba": "linear_attn.in_proj_ba", **_DENSE_MLP},
    # the expert stems name the experts' biases here ([E, out], dense, GptOssMoE reads them); their
    # weights are the stacks
    "gpt-oss": {**_ATTN, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj",
                "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"},
}
WITH_ROUTING_BIAS = ("glm4moe", "deepseek2")


def expert_prefix(model_type: str, layer: int) -> str:
    """The HF prefix of a layer's MoE block, as the container names it (ContainerWriter.add_expert)."""
    return f"model.layers.{layer}.{'block_sparse_moe' if model_type == 'mixtral' else 'mlp'}"
