"""qwen3_next against transformers' Qwen3NextForCausalLM: Gated DeltaNet linear attention (short
convolution, chunked and recurrent delta rule, gated RMSNorm) in three layers of four, gated full
attention with partial rotary in the fourth, a shared expert behind a sigmoid gate."""
import pytest
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

from harness import check_against_transformers, prompts_for

BASE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4)
CASES = {
    # Two value heads per key head (grouped), 4 layers: linear, linear, linear, full.
    "grouped_heads": dict(BASE, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                          num_hidden_layers=4),
    # One value head per key head, a dense layer (mlp_only_layers), full attention every second layer.
    "dense_layer": dict(BASE, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
                        num_hidden_layers=2, mlp_only_layers=[0],
                        layer_types=["linear_attention", "full_attention"]),
}

MODEL = Qwen3NextForCausalLM


def config(case: str) -> Qwen3NextConfig:
    return Qwen3NextConfig(vocab_size=130, max_position_embeddings=512, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 91


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen3_next_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    # 90 tokens: longer than one chunk of the chunked delta rule (64)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed, (1, 5, 90)))
