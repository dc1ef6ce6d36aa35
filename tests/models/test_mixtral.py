"""mixtral against transformers' MixtralForCausalLM."""
import pytest
from transformers import MixtralConfig, MixtralForCausalLM

from harness import check_against_transformers, prompts_for

CASES = {
    "e4k2": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_local_experts=4, num_experts_per_tok=2),
    "e8k3": dict(hidden_size=128, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                 num_local_experts=8, num_experts_per_tok=3,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


MODEL = MixtralForCausalLM


def config(case: str) -> MixtralConfig:
    return MixtralConfig(vocab_size=150, num_hidden_layers=2, max_position_embeddings=512,
                         sliding_window=None, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 21


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mixtral_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed))
