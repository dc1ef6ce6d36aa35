"""qwen2_moe against transformers' Qwen2MoeForCausalLM (qkv bias, shared expert + sigmoid gate,
dense layers through decoder_sparse_step / mlp_only_layers)."""
import pytest
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from harness import check_against_transformers, prompts_for

CASES = {
    "all_sparse": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                       shared_expert_intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "mixed_dense": dict(hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                        decoder_sparse_step=2, num_hidden_layers=3),
}


MODEL = Qwen2MoeForCausalLM


def config(case: str) -> Qwen2MoeConfig:
    kw = {"num_hidden_layers": 2, **CASES[case]}
    return Qwen2MoeConfig(vocab_size=140, max_position_embeddings=512, **kw)


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 41


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen2_moe_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed))
