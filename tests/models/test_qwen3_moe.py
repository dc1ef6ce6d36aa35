"""qwen3_moe against transformers' Qwen3MoeForCausalLM (per-head q/k norm, yarn rope, mlp_only_layers)."""
import pytest
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from harness import check_against_transformers, prompts_for

CASES = {
    "norm_topk": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, head_dim=32,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True),
    "yarn_dense_layer": dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, head_dim=16,
                             num_attention_heads=8, num_key_value_heads=2, num_experts=4, num_experts_per_tok=1,
                             norm_topk_prob=False, mlp_only_layers=[1],
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                              "original_max_position_embeddings": 128}),
}


MODEL = Qwen3MoeForCausalLM


def config(case: str) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(vocab_size=130, num_hidden_layers=2, max_position_embeddings=512, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 51


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen3_moe_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed))
