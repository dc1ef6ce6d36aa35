"""deepseek_v3 (and its alias kimi_k2) against transformers' DeepseekV3ForCausalLM: MLA with the
compressed-latent cache, q_lora or plain q_proj, interleaved or half-split rope, YaRN with mscale,
dense first layers, grouped sigmoid routing with e_score_correction_bias, shared experts, MTP."""
import json

import numpy as np
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.models import family
from colibri.models.mla import causal_mask
from harness import (add_mtp_layer, check_against_transformers, check_decode_matches_recompute,
                     make_hf_model, prompts_for)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}
CASES = {
    # grouped routing (4 groups of 4, 2 kept), yarn, q_lora, interleaved rope, 1 dense layer, MTP layer
    "grouped_yarn": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
                         qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=16,
                         n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
                         routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN),
    # no q_lora (q_proj), half-split rope, one group, no renormalisation, attention biases
    "plain_q": dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=64,
                    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_group=1,
                    topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0, routed_scaling_factor=1.5,
                    norm_topk_prob=False, rope_interleave=False, attention_bias=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def random_bias(model):
    """e_score_correction_bias is a buffer (zeros at init): make it steer the choice."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn_like(b))


def config(case: str) -> DeepseekV3Config:
    return DeepseekV3Config(vocab_size=150, max_position_embeddings=256, **CASES[case])


MODEL = DeepseekV3ForCausalLM


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 61


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_deepseek_v3_matches_transformers(tmp_path, case, bits):
    seed = case_seed(case)
    engine = check_against_transformers(DeepseekV3ForCausalLM, config(case), tmp_path, seed, bits,
                                        prompts_for(150, seed), prepare=random_bias, after_save=add_mtp_layer)
    check_decode_matches_recompute(engine, prompts_for(150, seed + 1, lengths=(7,))[0])


def test_mla_cache_holds_only_the_latent(tmp_path):
    hf = make_hf_model(DeepseekV3ForCausalLM, config("grouped_yarn"), 3, tmp_path / "hf")
    engine = Engine.load(convert(hf, tmp_path / "c", bits=32, progress=False))
    cache = engine.model.new_cache(64)
    a = CASES["grouped_yarn"]
    assert cache.bytes_per_token == a["num_hidden_layers"] * (a["kv_lora_rank"] + a["qk_rope_head_dim"]) * 4
    # DeepSeek-V3's real shapes: 512 + 64 values per token per layer
    full = family("deepseek_v3").ModelArgs.from_dict(DeepseekV3Config().to_dict())
    real = engine.model.__class__(full, engine.container, [None] * 61, engine.model.rope).new_cache(16)
    assert real.bytes_per_token // 61 == (512 + 64) * 4 == 2304


@pytest.mark.parametrize("bits", [32, 4])
def test_absorbed_attention_equals_expanded(tmp_path, bits):
    """The decode form (scores in latent space) and the prefill form (expanded K/V) agree."""
    hf = make_hf_model(DeepseekV3ForCausalLM, config("grouped_yarn"), 13, tmp_path / "hf")
    engine = Engine.load(convert(hf, tmp_path / "c", bits=bits, progress=False))
    attn = engine.model.layers[1].attn
    rng = np.random.default_rng(0)
    cache = engine.model.new_cache(40)
    cache.reserve(40)
    x = rng.standard_normal((40, 64)).astype(np.float32)
    cos, sin = engine.model.rope.cos_sin(np.arange(40))
    _, q_nope, q_rope = attn.query(x, cos, sin)
    attn.store_latent(x, cache, 1, 0, cos, sin)
    q_rope = np.ascontiguousarray(q_rope.transpose(1, 0, 2)) * attn.scale  # [H, L, R]
    c, k_rope, visible = cache.latent(1)[:40], cache.k_rope(1)[:40], causal_mask(0, 40, 40)
    np.testing.assert_allclose(attn._absorbed(q_nope, q_rope, c, k_rope, visible),
                               attn._expanded(q_nope, q_rope, c, k_rope, visible), rtol=1e-4, atol=1e-5)


def test_mtp_layer_kept_in_container(tmp_path):
    hf = make_hf_model(DeepseekV3ForCausalLM, config("grouped_yarn"), 5, tmp_path / "hf", prepare=random_bias)
    added = add_mtp_layer(hf)
    c = Container(convert(hf, tmp_path / "c", bits=4, progress=False))
    n = CASES["grouped_yarn"]["num_hidden_layers"]
    assert f"model.layers.{n}.mlp" in c.expert_layouts
    dense = [a for a in added if ".experts." not in a]
    assert all(c.has(a) for a in dense)
    # routers, routing biases stay f32 at --bits 4
    assert c.manifest["tensors"][f"model.layers.{n}.mlp.gate.weight"]["scheme"] == "f32"
    assert c.manifest["tensors"]["model.layers.1.mlp.gate.e_score_correction_bias"]["scheme"] == "f32"


def test_kimi_k2_alias(tmp_path):
    hf = make_hf_model(DeepseekV3ForCausalLM, config("plain_q"), 7, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    engine_ds = Engine.load(convert(hf, tmp_path / "ds", bits=32, progress=False))
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    engine_kimi = Engine.load(convert(hf, tmp_path / "kimi", bits=32, progress=False))
    prompt = [3, 1, 4, 1, 5]
    np.testing.assert_array_equal(engine_kimi.logits(prompt), engine_ds.logits(prompt))


@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("topk_method", "group_limited_greedy"),
                                         ("moe_layer_freq", 2), ("index_topk", 2048),
                                         ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4})])
def test_unimplemented_config_fields_are_rejected(tmp_path, field, value):
    hf = make_hf_model(DeepseekV3ForCausalLM, config("plain_q"), 9, tmp_path / "hf")
    out = convert(hf, tmp_path / "c", bits=32, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field.split("_parameters")[0]):
        Engine.load(out)


def test_compressed_cache_survives_slot_persistence(tmp_path):
    """A saved and restored MLA slot (latent + rope key only) continues exactly like the live one."""
    hf = make_hf_model(DeepseekV3ForCausalLM, config("grouped_yarn"), 11, tmp_path / "hf", prepare=random_bias)
    out = convert(hf, tmp_path / "c", bits=4, progress=False)
    prompt = prompts_for(150, 11, lengths=(9,))[0]
    live = Engine.load(out)
    first = live.generate(prompt, max_tokens=8, stop_at_eos=False).token_ids
    live.save_slot(0, tmp_path / "slot.npz")
    restored = Engine.load(out)
    assert restored.load_slot(0, tmp_path / "slot.npz") == len(prompt) + len(first) - 1
    more = prompt + first + [5, 6]
    assert restored.generate(more, max_tokens=8, stop_at_eos=False).token_ids == \
        live.generate(more, max_tokens=8, stop_at_eos=False).token_ids
    assert restored.last.prompt_tokens_reused > len(prompt)
