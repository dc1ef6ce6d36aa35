"""llama (dense) against transformers' LlamaForCausalLM."""
import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from harness import check_against_transformers, check_fused_decode_matches, prompts_for

CASES = {
    "gqa": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "mha_llama3_rope": dict(hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=2,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
    "tied_linear_rope": dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=1,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
}


MODEL = LlamaForCausalLM


def config(case: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=160, num_hidden_layers=2, max_position_embeddings=512, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 11


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed))


def test_fused_decode_is_exact_on_smollm2(smollm2_container):
    """The real model: every layer of SmolLM2 (q4_1) takes both fused blocks, with the step-by-step
    path's results."""
    from colibri import Engine

    engine = Engine.load(smollm2_container)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over")
    assert check_fused_decode_matches(engine, prompt, steps=12) == 2 * len(engine.model.layers)
