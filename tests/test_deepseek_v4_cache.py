"""DeepSeek V4's compressed attention keeps running state (models/deepseek_v4.py, V4Cache): the
same tokens whatever the expert budget and read path, with drafts, batched with other sequences,
after a slot is saved and restored, after a prefix is reused at any length, and after a pass
fails part way. On the golden file's tiny V4 (sliding, CSA with the indexer, HCA; hash and
scored routing), regenerated with numpy and converted at --bits 4: no torch needed."""
import json

import numpy as np
import pytest

from colibri import ColibriError, Engine
from colibri.errors import EngineFault
from colibri.io.container import Container
from colibri.io.convert import convert
from colibri.models.deepseek_v4 import ModelArgs, V4Cache
from tools.make_golden import GOLDEN_DIR, load, write_checkpoint

CHUNK = 7
LONG = 41  # prompt tokens: several chunks, 10 CSA windows (the indexer keeps 3), 5 HCA windows


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    work = tmp_path_factory.mktemp("v4")
    hf = write_checkpoint(load(GOLDEN_DIR / "deepseek_v4-flash_layout.json"), work / "hf")
    return convert(hf, work / "c4", bits=4, progress=False)


@pytest.fixture(scope="module")
def engine(v4):
    return Engine.load(v4, prefill_chunk=CHUNK, kv_slots=3)


def prompt(seed: int, n: int = LONG) -> list[int]:
    return np.random.default_rng(seed).integers(0, 130, n).tolist()


def fresh(v4, ids, n=12, **kw):
    return Engine.load(v4, prefill_chunk=CHUNK).generate(ids, max_tokens=n, stop_at_eos=False, **kw).token_ids


def test_a_cut_back_cache_decodes_as_one_that_never_went_further(engine):
    model = engine.model
    ids = prompt(1)
    cut = model.new_cache(64)
    model.forward(np.asarray(ids), cut)            # 41 positions: CSA entries of 10 windows
    cut.truncate(22)                               # mid-window: CSA keeps 5 entries, HCA 2
    assert list(cut._counts.values()) == [5, 5, 2, 5, 5]
    plain = model.new_cache(64)
    model.forward(np.asarray(ids[:22]), plain)
    for t in ids[22:30]:  # (prefills of 41 and 22 rows may round differently: close, not equal)
        a, b = model.forward(np.asarray([t]), cut), model.forward(np.asarray([t]), plain)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))


def test_same_tokens_streamed_under_a_small_budget_and_resident(v4, tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
    ids = prompt(2)
    resident = fresh(v4, ids, 16)
    c = Container(v4)  # room for the dense weights and about a quarter of the experts
    budget = (c.dense_bytes + c.expert_bytes // 4) / 2**30
    streamed = Engine.load(v4, prefill_chunk=CHUNK, ram_gb=budget, stream_experts=True)
    assert streamed.generate(ids, max_tokens=16, stop_at_eos=False).token_ids == resident
    assert streamed.expert_stats["misses"] > 0  # the budget really streamed


def test_hash_layers_ask_for_their_experts_before_they_run(v4):
    e = Engine.load(v4)
    model, asked = e.model, []
    hashed = model.layers[0].mlp
    assert hashed.hashed and not model.layers[1].mlp.hashed
    store = hashed.experts
    real = store.prefetch
    store.prefetch = lambda prefix, ids: (asked.append((prefix, sorted(ids))), real(prefix, ids))
    model.prefetch = True
    try:
        tokens = np.asarray(prompt(3, 5))
        model.forward(tokens, model.new_cache(8))
    finally:
        model.prefetch, store.prefetch = False, real
    assert (hashed.prefix, sorted(np.unique(hashed.tid2eid[tokens]).tolist())) in asked


def test_drafts_change_no_token(v4, engine):
    engine.reset()
    path = engine.generate(prompt(0, 8), max_tokens=48, stop_at_eos=False).token_ids
    ids = path + prompt(4, 8)  # a prompt holding a path greedy decoding falls into: prompt lookup drafts
    plain = fresh(v4, ids, 24)
    engine.reset()
    got = engine.generate(ids, max_tokens=24, stop_at_eos=False, speculative="ngram", draft_tokens=4)
    assert got.token_ids == plain
    assert got.speculative["passes"] > 0


def test_batched_sequences_get_their_solo_tokens(v4):
    from test_batching import run_together

    jobs = [(prompt(5), {}), (prompt(6, 9), {"speculative": "ngram"}), (prompt(7, 17), {"temperature": 0.8, "seed": 3})]
    alone = [fresh(v4, p, 10, **kw) for p, kw in jobs]
    e = Engine.load(v4, prefill_chunk=CHUNK, kv_slots=3)
    e.start_batching()
    try:
        together = run_together(e, jobs, 10)
    finally:
        e.stop_batching()
    assert [g.token_ids for g in together] == alone


def test_prefix_reuse_at_any_length(v4, engine):
    a = prompt(8)
    engine.reset()
    engine.generate(a, max_tokens=4, stop_at_eos=False, slot=0)
    other = a[:23] + prompt(9, 9)  # leaves the conversation mid-window: every position up to it is kept
    got = engine.generate(other, max_tokens=8, stop_at_eos=False, slot=0)
    assert got.prompt_tokens_reused == 23
    assert got.token_ids == fresh(v4, other, 8)


def test_saved_slot_restores_the_compressors(v4, engine, tmp_path):
    ids = prompt(13)
    engine.reset()
    g = engine.generate(ids, max_tokens=5, stop_at_eos=False, slot=1)
    held = len(engine.slots[1].ids)
    engine.save_slot(1, tmp_path / "slot.npz")
    more = ids + g.token_ids + prompt(14, 4)
    other = Engine.load(v4, prefill_chunk=CHUNK)
    assert other.load_slot(0, tmp_path / "slot.npz") == held
    got = other.generate(more, max_tokens=8, stop_at_eos=False, slot=0)
    assert got.prompt_tokens_reused == held
    assert got.token_ids == fresh(v4, more, 8)


def test_a_pass_that_fails_part_way_leaves_a_usable_cache(v4, engine, monkeypatch):
    ids = prompt(15)
    engine.reset()
    engine.generate(ids[:16], max_tokens=1, stop_at_eos=False, slot=2)
    moe = engine.model.layers[3].mlp  # after the CSA / HCA layers derived entries from the failed rows
    calls = {"n": 0}
    real = type(moe).__call__

    def fail_once(self, x, ids=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise EngineFault("a damaged expert (test)")
        return real(self, x, ids)

    monkeypatch.setattr(type(moe), "__call__", fail_once)
    with pytest.raises(EngineFault):
        engine.generate(ids, max_tokens=4, stop_at_eos=False, slot=2)
    monkeypatch.undo()
    got = engine.generate(ids, max_tokens=6, stop_at_eos=False, slot=2)
    assert got.token_ids == fresh(v4, ids, 6)


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("scoring_func", "sparsemax", "scoring_func='sparsemax'"),
    ("layer_types", ["sliding_attention", "linear_attention", "sliding_attention", "sliding_attention"],
     "layer_types="),
    ("compress_rates", {"compressed_sparse_attention": 0, "heavily_compressed_attention": 8}, "compress_rates="),
    ("o_groups", 3, "o_groups=3"),
    ("n_shared_experts", 2, "n_shared_experts=2"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config="),
])
def test_unimplemented_config_fields_are_named(field, value, message):
    cfg = load(GOLDEN_DIR / "deepseek_v4-flash_layout.json")["config"]
    with pytest.raises(ColibriError, match=message.replace("[", r"\[").replace("(", r"\(")):
        ModelArgs.from_dict({**cfg, field: value})


def test_the_cache_refuses_a_float16_kv_cache():
    cfg = load(GOLDEN_DIR / "deepseek_v4-flash_layout.json")["config"]
    with pytest.raises(ColibriError, match="f16 is not implemented for deepseek_v4"):
        V4Cache(ModelArgs.from_dict(cfg), 16, dtype="f16")


@pytest.fixture
def small_ring(monkeypatch):
    """Rings of 2 windows + 2 positions (18 here): prompts and chunks run past them."""
    from colibri.models import deepseek_v4

    monkeypatch.setattr(deepseek_v4, "ROW_SLACK", 2)


def test_the_ring_changes_no_bit(v4, small_ring):
    e = Engine.load(v4)
    ids = prompt(16)
    whole = e.model.new_cache(64)  # one 41-position pass: its own rows feed the windows the ring no longer holds
    assert whole.ring == 18
    logits = [e.model.forward(np.asarray(ids), whole)] + [e.model.forward(np.asarray([t]), whole) for t in ids[:9]]
    from colibri.models import deepseek_v4
    big = deepseek_v4.V4Cache(e.model.args, 64, slack=64)
    expected = [e.model.forward(np.asarray(ids), big)] + [e.model.forward(np.asarray([t]), big) for t in ids[:9]]
    assert all(np.array_equal(a, b) for a, b in zip(logits, expected))
    assert fresh(v4, ids, 10) == Engine.load(v4, prefill_chunk=CHUNK).generate(ids, max_tokens=10,
                                                                                 stop_at_eos=False).token_ids


def test_a_cut_is_exact_within_the_ring_and_refused_past_it(v4, small_ring):
    model = Engine.load(v4).model
    cache = model.new_cache(64)
    ids = prompt(17)
    model.forward(np.asarray(ids), cache)  # 41: the rings hold positions 23..40
    # 30 needs CSA's windows from 24 (the one before its unfinished one) and HCA's from 24; 25
    # needs CSA's from 20
    assert cache.exact(30) and not cache.exact(25) and cache.exact(0)
    with pytest.raises(ColibriError, match="left the ring"):
        cache.truncate(25)
    cache.truncate(30)
    plain = model.new_cache(64)
    model.forward(np.asarray(ids[:30]), plain)
    for t in ids[30:36]:
        a, b = model.forward(np.asarray([t]), cache), model.forward(np.asarray([t]), plain)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))
    assert cache.rewind(25) == 0 and cache.length == 0  # a prefix reuse that far back starts over


def test_prefix_reuse_past_the_ring_starts_over_with_the_same_tokens(v4, small_ring):
    e = Engine.load(v4, prefill_chunk=CHUNK)
    a = prompt(18)
    e.generate(a, max_tokens=3, stop_at_eos=False, slot=0)
    near = a + prompt(19, 6)  # leaves the conversation where its answer began: within the ring
    got = e.generate(near, max_tokens=6, stop_at_eos=False, slot=0)
    assert got.prompt_tokens_reused == len(a) and got.token_ids == fresh(v4, near, 6)
    far = a[:20] + prompt(20, 9)  # leaves it 27 positions back: past the ring
    got = e.generate(far, max_tokens=6, stop_at_eos=False, slot=0)
    assert got.prompt_tokens_reused == 0 and got.token_ids == fresh(v4, far, 6)


@pytest.mark.parametrize("over, types, mlp", [
    ({"layer_types": None, "mlp_layer_types": None, "num_hidden_layers": 5},  # DeepseekV4Config's defaults
     ["heavily_compressed_attention"] * 3 + ["compressed_sparse_attention", "heavily_compressed_attention"],
     ["hash_moe"] * 3 + ["moe"] * 2),
    ({"layer_types": None, "compress_ratios": [0, 4, 128, 4], "mlp_layer_types": None, "num_hash_layers": 1},
     ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
      "compressed_sparse_attention"], ["hash_moe"] + ["moe"] * 3),
])
def test_legacy_and_default_schedules(over, types, mlp):
    cfg = {k: v for k, v in {**load(GOLDEN_DIR / "deepseek_v4-flash_layout.json")["config"], **over}.items()
           if v is not None}
    args = ModelArgs.from_dict(cfg)
    assert (args.layer_types, args.mlp_layer_types) == (types, mlp)


def test_legacy_compression_fields():
    cfg = {k: v for k, v in load(GOLDEN_DIR / "deepseek_v4-flash_layout.json")["config"].items() if k != "compress_rates"}
    args = ModelArgs.from_dict({**cfg, "compress_rate_csa": 8, "compress_rate_hca": 64})
    assert args.compress_rates == {"compressed_sparse_attention": 8, "heavily_compressed_attention": 64}
    with pytest.raises(ColibriError, match="layer_types"):
        ModelArgs.from_dict({**cfg, "layer_types": None, "compress_ratios": [0, 4, 16, 4]})


def test_the_planner_counts_what_the_cache_holds():
    from colibri.plan.facts import _kv_bytes_per_token, _state_bytes_per_slot

    cfg = load(GOLDEN_DIR / "deepseek_v4-flash_layout.json")["config"]
    cache = V4Cache(ModelArgs.from_dict(cfg), 16)
    assert _kv_bytes_per_token(cfg, 4) == cache.bytes_per_token and _state_bytes_per_slot(cfg, 4) == cache.state_bytes


def test_deepseek_names_without_transformers_prefix_convert_the_same(v4, tmp_path):
    """DeepSeek's own release names the tensors at the top level (`layers.N.attn.wq_a.weight`,
    `embed.weight`, `norm.weight`, `hc_head_fn`); transformers saves them under `model.`. Both
    convert to the same container."""
    from safetensors.numpy import load_file, save_file

    hf = write_checkpoint(load(GOLDEN_DIR / "deepseek_v4-flash_layout.json"), tmp_path / "hf")
    state = load_file(str(hf / "model.safetensors"))
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    renamed = {top.get(k, k.removeprefix("model.")): v for k, v in state.items()}
    assert "layers.0.attn.wq_a.weight" in renamed and "head.weight" in renamed
    save_file(renamed, str(hf / "model.safetensors"))
    bare = Container(convert(hf, tmp_path / "c4", bits=4, progress=False))
    assert set(bare.manifest["tensors"]) == set(Container(v4).manifest["tensors"])
    ids = prompt(21, 9)
    assert fresh(bare.dir, ids, 6) == fresh(v4, ids, 6)


def test_one_query_gathers_the_rows_the_joined_mask_keeps():
    """_seen_of_two: the rows and mask seen_rows gives over the window's rows joined with the
    entries, without the join: the same arrays, so decode keeps its bits."""
    from colibri.kernels.attention import seen_rows
    from colibri.models.deepseek_v4 import _seen_of_two

    rng = np.random.default_rng(3)
    window, entries = rng.standard_normal((8, 4), dtype=np.float32), rng.standard_normal((40, 4), dtype=np.float32)
    for kept in (5, 30):  # a sparse pick (rows gathered), and most rows (all kept, masked)
        visible = np.zeros((1, 48), bool)
        visible[0, :8] = True
        visible[0, 8 + rng.choice(40, kept, replace=False)] = True
        want_mask, want_rows = seen_rows(visible, np.concatenate([window, entries]))
        mask, rows = _seen_of_two(visible, window, entries)
        assert np.array_equal(mask, want_mask) and np.array_equal(rows, want_rows)
