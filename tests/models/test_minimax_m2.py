"""minimax_m2 against transformers' MiniMaxM2ForCausalLM: q/k RMSNorm over all heads, partial
rotary (the checkpoint's rotary_dim), sigmoid routing with e_score_correction_bias and
renormalised top-k, block_sparse_moe / w1 w3 w2 checkpoint names renamed by convert."""
import json

import numpy as np
import pytest
import torch
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from harness import check_against_transformers, make_hf_model, prompts_for

CASES = {
    "quarter_rotary": dict(hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=3, rotary_dim=4),
    "yarn_half_rotary": dict(hidden_size=64, intermediate_size=64, head_dim=32, num_attention_heads=4,
                             num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 5e6, "factor": 4.0,
                                              "original_max_position_embeddings": 64,
                                              "partial_rotary_factor": 0.5}),
}

MODEL = MiniMaxM2ForCausalLM


def random_bias(model):
    """The routing bias is zeros at init; large enough here to change which experts are picked."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.3 * torch.randn_like(b))


def config(case: str) -> MiniMaxM2Config:
    return MiniMaxM2Config(vocab_size=150, num_hidden_layers=2, max_position_embeddings=256,
                           bos_token_id=1, eos_token_id=2, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 91


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_minimax_m2_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed),
                               prepare=random_bias)


def test_checkpoint_names_become_the_decoders(tmp_path):
    hf = make_hf_model(MODEL, config("quarter_rotary"), 5, tmp_path / "hf", prepare=random_bias)
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    c = Container(out)
    assert c.has("model.layers.1.mlp.gate.weight") and c.has("model.layers.1.mlp.gate.e_score_correction_bias")
    assert not c.has("model.layers.1.block_sparse_moe.gate.weight")
    assert sorted(c.expert_layouts) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert Engine.load(out).model.layers[1].mlp.bias.any()  # the routing bias, not the zeros default


def test_the_checkpoints_rotary_dim_sets_the_rotated_width(tmp_path):
    """MiniMax's own config.json says rotary_dim and rope_theta, not transformers' rope_parameters:
    the same model under either spelling gives the same logits."""
    hf = make_hf_model(MODEL, config("quarter_rotary"), 7, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    prompt = prompts_for(150, 7, lengths=(9,))[0]
    expected = Engine.load(out).logits(prompt)
    cfg = json.loads((out / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    (out / "config.json").write_text(json.dumps({**cfg, "rope_theta": theta, "rotary_dim": 4}))
    np.testing.assert_array_equal(Engine.load(out).logits(prompt), expected)


@pytest.mark.parametrize("field,value", [("attn_type_list", [1, 0]), ("shared_intermediate_size", 1024),
                                         ("qk_norm_type", "per_head"), ("scoring_func", "softmax"),
                                         ("sliding_window", 4096)])
def test_unimplemented_config_fields_are_rejected(tmp_path, field, value):
    hf = make_hf_model(MODEL, config("quarter_rotary"), 9, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field):
        Engine.load(out)
