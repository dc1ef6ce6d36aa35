"""glm5_next (GLM-5.3-Flash) against transformers' Glm5NextForConditionalGeneration, the checkpoint
as published (its language model converted, the vision tower skipped): KDA layers with the safe
forget gate (and the softplus one when linear_lower_bound is null), NoPE MLA over the pooled
indexer's choice ("full" and "shared" layers, prompts with more complete pools than a query
keeps), hyper-connection streams, clipped SwiGLUs, grouped sigmoid routing. Its cache through
slots, prefix reuse, drafts and batching: tests/test_recurrent_state.py, on a real-shape slice."""
import json

import numpy as np
import pytest
import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

from colibri import Engine
from colibri.errors import ColibriError
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.models.glm5_next import PooledIndexer
from colibri.models.kimi_linear import LatentRecurrentCache
from harness import check_against_transformers, check_plan_sizes_the_engine, make_hf_model, prompts_for

LIN, IDX = "linear_attention", "indexed_attention"
BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
            index_head_dim=16, index_n_heads=8, linear_head_dim=16, linear_num_heads=2, pad_token_id=None,
            bos_token_id=None, eos_token_id=None)
CASES = {
    # A "shared" MLA layer after a "full" one, dense layers between MoE ones, 2 groups of 4
    # experts, the SwiGLUs clipped hard (0.5: most gates and ups reach it), two streams; a query
    # keeps 2 pools of 4 tokens, so from 12 tokens on the indexer chooses.
    "shared_indexer": dict(BASE, num_hidden_layers=5, layer_types=[LIN, IDX, IDX, LIN, IDX],
                           indexer_types=["full", "full", "shared", "full", "full"],
                           mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse"], n_routed_experts=8,
                           num_experts_per_tok=2, n_group=2, topk_group=1, swiglu_limit=0.5, hc_mult=2,
                           index_topk=8, index_kpool=4),
    # The config's defaults for the layout (MLA every fourth layer, three dense layers first), the
    # softplus forget gate (no lower bound), three streams, pools of 8 of which a query keeps 2.
    "defaults_softplus_gate": dict(BASE, num_hidden_layers=4, n_routed_experts=4, num_experts_per_tok=2,
                                   linear_lower_bound=None, hc_mult=3, index_topk=16, index_kpool=8),
}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              projection_intermediate_size=64)
MODEL = Glm5NextForConditionalGeneration


def config(case: str) -> Glm5NextConfig:
    return Glm5NextConfig(text_config=CASES[case], vision_config=VISION)


def case_seed(case: str) -> int:
    return sorted(CASES).index(case) + 151


def prepare(model):
    """e_score_correction_bias is a buffer (zeros at init): make it steer the choice. A_log near 0
    and dt_bias small keep the decays in a useful range, as the checkpoint's initialisation does."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn_like(b))
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            p.copy_(0.3 * torch.randn_like(p))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_glm5_next_matches_transformers(tmp_path, capfd, case, bits):
    seed = case_seed(case)
    # 90 tokens: longer than one chunk of the chunked delta rule (64) and than what a query keeps
    check_against_transformers(MODEL, config(case), tmp_path, seed, bits, prompts_for(160, seed, (1, 5, 90)),
                               prepare=prepare)
    err = capfd.readouterr().err
    assert "skipping the vision tower (" in err and "colibri runs the language model only" in err


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("glm5_next")
    hf = make_hf_model(MODEL, config("shared_indexer"), 5, tmp / "hf", prepare=prepare)
    return convert(hf, tmp / "c", bits=4, progress=False)


def test_the_language_model_and_its_cache(container):
    c = Container(container)
    assert {"model_type": "glm5_next_text"}.items() <= c.config.items()  # the alias: its language model
    assert not [n for n in c.dense.tensors if "visual" in n or "language_model" in n]
    assert c.has("model.layers.0.attn_hc.fn") and c.has("model.layers.0.self_attn.A_log")
    engine = Engine.load(container)
    args = engine.model.args
    assert args.layer_types == [LIN, IDX, IDX, LIN, IDX]
    assert [args.mlp_kind(i) for i in range(5)] == ["dense", "moe", "moe", "dense", "moe"]
    assert engine.model.layers[2].attn.indexer is None  # "shared": the layer before chooses
    cache = engine.model.new_cache(64)
    assert isinstance(cache, LatentRecurrentCache) and list(cache.kv_layer) == [1, 2, 4]
    assert cache.linear_layers == [0, 3]
    assert cache.latent(1).shape[1] == 32 and cache.index_rows(1).shape[1] == 2 * 16
    engine.model.forward(np.asarray(prompts_for(160, 1, (20,))[0]), cache)
    assert cache.length == 20 and 20 in cache.snapshots and np.abs(cache.state[3]).sum() > 0


def test_the_indexer_keeps_its_best_pools_and_its_own():
    """PooledIndexer.select against a plain reading of transformers' rule, on scores chosen so
    the best pools are known: the query sees its best complete pools that end before it and
    the tokens of its own pool so far."""
    P, keep = 4, 2
    ix = PooledIndexer.__new__(PooledIndexer)
    ix.h, ix.d, ix.pool, ix.pools = 1, 2, P, keep
    ix.scale = np.float32(1.0)
    N = 19  # 4 complete pools and 3 tokens of a fifth
    rows = np.zeros((N, 4), np.float32)
    strength = [0.5, 3.0, 1.0, 2.0]  # pool 1 best, then 3, then 2
    for j, s in enumerate(strength):
        rows[j * P:(j + 1) * P, 0] = s
    ix.ape = np.zeros((P, 2), np.float32)
    ix.pool_keys(rows, 4)
    q = np.asarray([[1.0, 0.0]], np.float32)
    ix.wq_b = ix.weights_proj = None

    def select(pos):  # the indexer's projections replaced by the fixed query and weight
        import colibri.models.glm5_next as g
        saved = g.linear
        g.linear = lambda x, w: q if w is None and x is q else np.ones((1, 1), np.float32)
        try:
            return ix.select(np.zeros((1, 2), np.float32), q, rows, pos)[0]
        finally:
            g.linear = saved

    last = select(N - 1)
    assert last.tolist() == [t // P in (1, 3) or t >= 16 for t in range(N)]
    # at position 14 pool 3 (12..15) is not complete: pools 1 and 2, and 12..14 as its own
    mid = select(14)
    assert mid[:15].tolist() == [t // P in (1, 2) or t >= 12 for t in range(15)]


def test_kept_pool_keys_change_no_bit(container):
    """The indexer's pool keys kept in the cache between steps (PooledIndexer.kept_pool_keys)
    against recomputing every pool each step: the same logits bit for bit, through a prefill,
    decode steps, several rows in one pass, and a cut back to a kept state followed by other
    tokens (whose pools the cut must make the cache forget)."""
    model = Engine.load(container).model
    seq = prompts_for(160, 3, (52,))[0]

    def run(keep: bool) -> list:
        cache, out = model.new_cache(96), []

        def step(ids):
            if not keep:
                cache.pool_keys.clear()
            out.append(model.forward(np.asarray(ids), cache))
        step(seq[:30])  # 7 complete pools of 4: the indexer chooses 2
        for t in seq[30:38]:
            step([t])
        step(seq[38:41])  # several rows in one pass
        assert cache.rewind(30) == 30  # the prefill's end is a kept state
        for t in seq[41:52]:  # other tokens where pools 7.. were
            step([t])
        if keep:
            assert cache.pool_keys and all(kept[1] == 40 for kept in cache.pool_keys.values())
        return out

    for a, b in zip(run(True), run(False), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("field,value", [
    ("qk_rope_head_dim", 8), ("num_key_value_heads", 2), ("index_topk", 10),
    ("index_kpool_always_select_tail", False), ("indexer_types", ["full", "full", "shared", "full", "shared"]),
    ("indexer_types", ["full", "shared", "full", "full", "full"]),
    ("layer_types", [LIN, "sliding_attention", IDX, LIN, IDX]), ("linear_attn_config", {"num_heads": 2, "rank": 4}),
    ("mlp_layer_types", ["dense", "moe", "sparse", "dense", "sparse"]), ("scoring_func", "softmax"),
    ("n_shared_experts", 2), ("hidden_act", "gelu")])
def test_unimplemented_config_fields_are_rejected(container, tmp_path, field, value):
    cfg = json.loads((container / "config.json").read_text())
    out = tmp_path / "c"
    out.mkdir()
    for p in container.iterdir():
        (out / p.name).symlink_to(p)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ColibriError, match=field.split(".")[0]):
        Engine.load(out)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_planner_sizes_what_the_engine_builds(tmp_path, case):
    """colibri plan sizes the MLA latent and indexer rows per token and the KDA state per slot as
    the engine builds them, and reads the layer kinds the model reads."""
    from colibri.plan.shapes import layer_types

    args, converted = check_plan_sizes_the_engine(MODEL, config(case), tmp_path)
    assert layer_types(converted) == ["full_attention" if t == IDX else t for t in args.layer_types]
