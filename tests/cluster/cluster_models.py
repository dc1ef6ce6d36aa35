"""The MoE models the cluster tests run (tests/cluster/*, fixtures in its conftest.py): tiny
slices of the synthetic real-shape presets and tiny random transformers checkpoints of the
other MoE families."""
from __future__ import annotations

# Tiny slices of the real-shape presets, one per MoE family the synthetic tool writes, and the
# OLMoE shape (16 experts, top-8 at 1/8 of its width).
FAMILIES = {"qwen3-30b-a3b": dict(layers=2, width_divisor=16), "deepseek-v3": dict(layers=4, width_divisor=16),
            "glm-4.5-air": dict(layers=2, width_divisor=16), "olmoe-1b-7b": dict(layers=2, width_divisor=8)}
# The other MoE families of the suite (tests/models), as tiny random transformers checkpoints
# converted at 4 bits: (transformers class, config class, config).
HF_FAMILIES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",  # shared expert + sigmoid gate, a dense layer
                  dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, num_hidden_layers=3)),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig",  # MLA + the DSA indexer, grouped routing
                    dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16,
                         qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=3,
                         norm_topk_prob=True, index_head_dim=32, index_n_heads=16, index_topk=12,
                         num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2)),
}
HF_VOCAB = 150
