"""glm4_moe against transformers' Glm4MoeForCausalLM: partial rotary, per-head q/k norm, q/k/v bias,
grouped sigmoid routing with e_score_correction_bias and routed_scaling_factor, dense first layer,
yarn rope, MTP layer kept by convert."""
import json

import pytest
import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.convert import convert
from harness import (add_mtp_layer, check_against_transformers, check_decode_matches_recompute,
                     make_hf_model, prompts_for)

CASES = {
    "grouped_qknorm": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, head_dim=32,
                           num_attention_heads=4, num_key_value_heads=2, n_routed_experts=16, n_group=4,
                           topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, num_hidden_layers=3,
                           routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True),
    "yarn_quarter_rotary": dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=64, head_dim=32,
                                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=1,
                                topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0, num_hidden_layers=2,
                                routed_scaling_factor=1.0, norm_topk_prob=False, use_qk_norm=False,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                 "original_max_position_embeddings": 32,
                                                 "partial_rotary_factor": 0.25}),
}


def random_bias(model):
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn_like(b))


def config(case: str) -> Glm4MoeConfig:
    return Glm4MoeConfig(vocab_size=140, max_position_embeddings=256, **CASES[case])


MODEL = Glm4MoeForCausalLM


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 71


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_glm4_moe_matches_transformers(tmp_path, case, bits):
    seed = case_seed(case)
    engine = check_against_transformers(Glm4MoeForCausalLM, config(case), tmp_path, seed, bits,
                                        prompts_for(140, seed), prepare=random_bias, after_save=add_mtp_layer)
    check_decode_matches_recompute(engine, prompts_for(140, seed + 1, lengths=(6,))[0])


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                         ("sliding_window", 4096), ("n_group", 3)])
def test_unimplemented_config_fields_are_rejected(tmp_path, field, value):
    hf = make_hf_model(Glm4MoeForCausalLM, config("grouped_qknorm"), 9, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field):
        Engine.load(out)
