"""glm_moe_dsa (GLM-5) against transformers' GlmMoeDsaForCausalLM: MLA with the compressed cache plus
the DSA indexer, with contexts both shorter and longer than index_topk (sparse attention), "shared"
indexer layers, grouped sigmoid routing, yarn; indexer weights stay f32 at --bits 4."""
import json

import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.models.glm_moe_dsa import default_indexer_types
from harness import (add_mtp_layer, check_against_transformers, check_decode_matches_recompute,
                     make_hf_model, prompts_for)

BASE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
            v_head_dim=32, n_routed_experts=16, num_experts_per_tok=3, routed_scaling_factor=2.5,
            norm_topk_prob=True, index_head_dim=32, index_n_heads=16)
CASES = {
    # prompts of 1, 5, 23 tokens + 32 new: index_topk 12 makes most queries sparse
    "sparse_grouped_yarn": dict(BASE, num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2,
                                index_topk=12, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                                "original_max_position_embeddings": 32,
                                                                "mscale": 1.0, "mscale_all_dim": 0.8}),
    # the third layer reuses the second's selection
    "shared_indexer": dict(BASE, num_hidden_layers=3, first_k_dense_replace=0, n_group=1, topk_group=1,
                           index_topk=20, indexer_types=["full", "full", "shared"]),
}


def random_bias(model):
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn_like(b))


def config(case: str) -> GlmMoeDsaConfig:
    return GlmMoeDsaConfig(vocab_size=150, max_position_embeddings=256, **CASES[case])


MODEL = GlmMoeDsaForCausalLM


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 81


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_glm_moe_dsa_matches_transformers(tmp_path, case, bits):
    seed = case_seed(case)
    engine = check_against_transformers(GlmMoeDsaForCausalLM, config(case), tmp_path, seed, bits,
                                        prompts_for(150, seed), prepare=random_bias, after_save=add_mtp_layer)
    check_decode_matches_recompute(engine, prompts_for(150, seed + 1, lengths=(9,))[0])
    if bits == 4:
        c = Container(tmp_path / "c4")
        schemes = {n: s["scheme"] for n, s in c.manifest["tensors"].items()}
        assert schemes["model.layers.0.self_attn.indexer.wq_b.weight"] == "f32"
        assert schemes["model.layers.0.self_attn.indexer.wk.weight"] == "f32"
        assert schemes["model.layers.0.self_attn.indexer.weights_proj.weight"] == "f32"
        assert schemes["model.layers.1.mlp.gate.e_score_correction_bias"] == "f32"
        assert schemes["model.layers.0.self_attn.kv_b_proj.weight"] == "int4_g64"


def test_cache_holds_latent_rope_and_indexer_key(tmp_path):
    hf = make_hf_model(GlmMoeDsaForCausalLM, config("shared_indexer"), 3, tmp_path / "hf")
    engine = Engine.load(convert(hf, tmp_path / "c", bits=32, progress=False))
    a = CASES["shared_indexer"]
    per_layer = (a["kv_lora_rank"] + a["qk_rope_head_dim"] + a["index_head_dim"]) * 4
    assert engine.model.new_cache(8).bytes_per_token == a["num_hidden_layers"] * per_layer


def test_sparse_selection_really_drops_tokens(tmp_path):
    """With index_topk < context the indexer must exclude tokens (else the sparse path is untested)."""
    hf = make_hf_model(GlmMoeDsaForCausalLM, config("sparse_grouped_yarn"), 5, tmp_path / "hf")
    engine = Engine.load(convert(hf, tmp_path / "c", bits=32, progress=False))
    attn = engine.model.layers[0].attn
    seen = []
    select = attn.indexer.select
    attn.indexer.select = lambda *a: seen.append(select(*a)) or seen[-1]
    engine.logits(list(range(30)))
    visible = seen[0]
    assert visible.shape == (30, 30)
    assert visible.sum(axis=1).max() == 12 and visible[:12].sum() == sum(range(1, 13))


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("topk_method", "greedy"),
                                         ("indexer_types", ["shared", "full", "full"]),
                                         ("index_topk_pattern", "FXF"),
                                         ("layer_types", ["sliding_attention"] * 3)])
def test_unimplemented_config_fields_are_rejected(tmp_path, field, value):
    hf = make_hf_model(GlmMoeDsaForCausalLM, config("shared_indexer"), 9, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    if field == "index_topk_pattern":
        del cfg["indexer_types"]  # a hub config.json that only has the pattern
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field):
        Engine.load(out)


@pytest.mark.parametrize("raw", [{}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                                 {"index_topk_pattern": "FSSFSF"}])
def test_indexer_types_derived_like_transformers(raw):
    """Hub config.json files may carry index_topk_freq / _pattern instead of indexer_types."""
    assert default_indexer_types(raw, 6) == GlmMoeDsaConfig(num_hidden_layers=6, **raw).indexer_types
