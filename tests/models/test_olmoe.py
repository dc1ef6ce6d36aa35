"""olmoe against transformers' OlmoeForCausalLM (q/k norm over all heads, clip_qkv)."""
import pytest
from transformers import OlmoeConfig, OlmoeForCausalLM

from harness import check_against_transformers, prompts_for

CASES = {
    "plain": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "clip_norm_gqa": dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, clip_qkv=0.5),
}


MODEL = OlmoeForCausalLM


def config(case: str) -> OlmoeConfig:
    return OlmoeConfig(vocab_size=170, num_hidden_layers=2, max_position_embeddings=512, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 31


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_olmoe_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed))
