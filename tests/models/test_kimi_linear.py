"""kimi_linear against transformers' KimiLinearForCausalLM: Kimi Delta Attention (q/k/v short
convolutions, per-channel decay from the low-rank f_a / f_b gate with A_log and dt_bias, beta,
chunked and recurrent KDA, sigmoid-gated RMSNorm from g_a / g_b) in most layers, MLA without
rope (NoPE) in the others, grouped sigmoid routing with e_score_correction_bias, a shared expert,
dense first layers; and the recurrent-plus-latent cache through slots and prefix reuse."""
import json

import numpy as np
import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.convert import convert
from colibri.models.kimi_linear import LatentRecurrentCache
from harness import check_against_transformers, check_plan_sizes_the_engine, make_hf_model, prompts_for

BASE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            linear_conv_kernel_dim=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
CASES = {
    # q_lora, 2 groups of 4 experts (1 kept), layer 0 dense (first_k_dense_replace's default), MLA third
    "grouped_q_lora": dict(BASE, num_hidden_layers=4, q_lora_rank=32, linear_num_heads=2, linear_head_dim=32,
                           num_local_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                           routed_scaling_factor=2.446, norm_topk_prob=True,
                           layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
    # The original checkpoint's config: layers from linear_attn_config (1-indexed), the head dim 64
    # (the low-rank gates int4 at --bits 4), plain q_proj, no groups, no renormalisation, a dense middle.
    "checkpoint_layout": dict(BASE, num_hidden_layers=3, q_lora_rank=None, num_local_experts=4, n_group=1,
                              topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                              mlp_layer_types=["sparse", "dense", "sparse"],
                              linear_attn_config={"full_attn_layers": [2], "kda_layers": [1, 3], "num_heads": 2,
                                                  "head_dim": 64, "short_conv_kernel_size": 4}),
}

MODEL = KimiLinearForCausalLM


def config(case: str) -> KimiLinearConfig:
    return KimiLinearConfig(vocab_size=130, **CASES[case])


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 121


def random_bias(model):
    """e_score_correction_bias is a buffer (zeros at init): make it steer the choice."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn_like(b))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kimi_linear_matches_transformers(tmp_path, case, bits):
    cfg, seed = config(case), case_seed(case)
    # 90 tokens: longer than one chunk of the chunked delta rule (64)
    check_against_transformers(MODEL, cfg, tmp_path, seed, bits, prompts_for(cfg.vocab_size, seed, (1, 5, 90)),
                               prepare=random_bias)


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi_linear")
    hf = make_hf_model(MODEL, config("grouped_q_lora"), 5, tmp / "hf", prepare=random_bias)
    return convert(hf, tmp / "c", bits=4, progress=False)


def test_config_layers_and_cache(container):
    engine = Engine.load(container)
    args = engine.model.args
    assert args.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    assert [args.mlp_kind(i) for i in range(4)] == ["dense", "moe", "moe", "moe"]
    assert (args.n_routed_experts, args.n_group, args.num_experts_per_tok) == (8, 2, 2)  # from config.json's names
    cache = engine.model.new_cache(64)
    assert isinstance(cache, LatentRecurrentCache) and list(cache.kv_layer) == [2] and cache.linear_layers == [0, 1, 3]
    assert cache.latent(2).shape[1] == 32 and cache.k_rope(2).shape[1] == 8  # MLA's latent and rope key only
    assert cache.state[0].shape == (2, 32, 32) and cache.conv[0].shape == (3, 3 * 2 * 32)
    engine.model.forward(np.asarray(prompts_for(130, 1, (20,))[0]), cache)
    assert cache.length == 20 and 20 in cache.snapshots and np.abs(cache.state[3]).sum() > 0


def test_slot_round_trip_and_prefix_reuse(container, tmp_path):
    """A saved slot (MLA latent, KDA conv and delta states, their snapshots) continues as a fresh
    prefill of the whole conversation; a prompt that leaves the conversation mid-way reuses the
    prefill chunk that ended before it."""
    chunk = 8

    def fresh(ids, n):
        return Engine.load(container, prefill_chunk=chunk).generate(ids, max_tokens=n, stop_at_eos=False).token_ids

    ids = prompts_for(130, 7, (30,))[0]
    live = Engine.load(container, prefill_chunk=chunk)
    first = live.generate(ids, max_tokens=6, stop_at_eos=False, slot=0)
    held = len(live.slots[0].ids)
    live.save_slot(0, tmp_path / "slot.npz")
    more = ids + first.token_ids + prompts_for(130, 8, (5,))[0]
    restored = Engine.load(container, prefill_chunk=chunk)
    assert restored.load_slot(0, tmp_path / "slot.npz") == held
    got = restored.generate(more, max_tokens=8, stop_at_eos=False, slot=0)
    assert got.prompt_tokens_reused == held  # the restored state, not a prefill
    assert got.token_ids == fresh(more, 8)
    other = ids[:21] + prompts_for(130, 9, (6,))[0]  # leaves at token 21: back to the chunk that ended at 16
    third = live.generate(other, max_tokens=6, stop_at_eos=False, slot=0)
    assert third.prompt_tokens_reused == 16
    assert third.token_ids == fresh(other, 6)


@pytest.mark.parametrize("field,value", [
    ("mla_use_nope", False), ("moe_router_activation_func", "softmax"), ("num_key_value_heads", 2),
    ("linear_attn_config", {"num_heads": 2, "head_dim": 32, "gate_lower_bound": -5.0}),
    ("use_grouped_topk", False), ("moe_layer_freq", 2), ("num_shared_experts", 0), ("swiglu_limit", 7.0),
    ("layer_types", ["linear_attention", "sliding_attention", "full_attention", "linear_attention"])])
def test_unimplemented_config_fields_are_rejected(container, tmp_path, field, value):
    cfg = json.loads((container / "config.json").read_text())
    out = tmp_path / "c"
    out.mkdir()
    for p in container.iterdir():
        (out / p.name).symlink_to(p)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field):
        Engine.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_planner_sizes_what_the_engine_builds(tmp_path, case):
    """colibri plan sizes the MLA latent per token and the KDA state per slot (models/recurrent.py)
    as the engine builds them."""
    check_plan_sizes_the_engine(MODEL, config(case), tmp_path)


def test_the_planner_reads_the_layer_rules_the_model_reads():
    """Which layers are KDA / MLA and dense / MoE, from an original checkpoint's config.json
    (linear_attn_config, first_k_dense_replace, the MoE fields' own names) or from defaults."""
    from colibri.models.kimi_linear import ModelArgs
    from colibri.plan.shapes import layer_types, linear_state_shapes, mlp_kinds

    base = {"model_type": "kimi_linear", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
            "vocab_size": 256, "num_hidden_layers": 9, "num_experts": 8, "num_experts_per_token": 2}
    configs = [base, {**base, "first_k_dense_replace": 3},
               {**base, "linear_attn_config": {"full_attn_layers": [4, 8, 9], "kda_layers": [1, 2, 3, 5, 6, 7],
                                               "num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 3}}]
    for config in configs:
        args = ModelArgs.from_dict(config)
        assert layer_types(config) == args.layer_types
        assert mlp_kinds(config, 9) == [args.mlp_kind(i) for i in range(9)]
    assert layer_types(base)[4] == "full_attention" and layer_types(configs[2])[8] == "full_attention"
    assert linear_state_shapes(configs[2]) == ((2, 3 * 3 * 16), (3, 16, 16))
