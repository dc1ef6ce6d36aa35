"""A hybrid model's recurrent state goes everywhere a KV cache goes (models/recurrent.py): the
same tokens whatever the expert budget and read path, with drafts, batched with other
sequences, after a slot is saved and restored and after a pass fails part way; prefix reuse
takes the longest prefix that ends at a kept state. On Qwen3.6-35B-A3B's layer structure (three
Gated DeltaNet layers, then gated full attention) and GLM-5.3-Flash's (KDA, and sparse MLA with
its indexer rows, under hyper-connections; three dense layers first) at 1/16 of their widths,
SmolLM2's vocabulary."""
import numpy as np
import pytest
from tools import synthetic_moe

from colibri import ColibriError, Engine
from colibri.errors import EngineFault
from colibri.io.container import Container
from colibri.models.recurrent import RecurrentCache

LONG = 40     # prompt tokens: several prefill chunks
CHUNK = 8


# preset -> (layers kept, the full-attention layers, the linear ones): each slice has MoE layers
SLICES = {"qwen3.6-35b-a3b": (4, [3], [0, 1, 2]), "glm-5.3-flash": (5, [3], [0, 1, 2, 4])}


@pytest.fixture(scope="module", params=sorted(SLICES))
def hybrid(request, tmp_path_factory):
    layers = SLICES[request.param][0]
    return synthetic_moe.write_container(tmp_path_factory.mktemp("hybrid") / "m", request.param, layers=layers,
                                         width_divisor=16, vocab=49152, progress=False)


@pytest.fixture(scope="module")
def engine(hybrid):
    return Engine.load(hybrid, prefill_chunk=CHUNK, kv_slots=3)


def prompt(seed: int, n: int = LONG) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


def fresh(hybrid, ids, n=16, **kw):
    return Engine.load(hybrid, prefill_chunk=CHUNK).generate(ids, max_tokens=n, stop_at_eos=False, **kw).token_ids


def test_the_cache_holds_kv_for_full_layers_only_and_a_state_for_the_others(hybrid, engine):
    cache = engine.model.new_cache(64)
    assert isinstance(cache, RecurrentCache)
    _, full, linear = SLICES[Container(hybrid).config["colibri_synthetic"]["preset"]]
    assert list(cache.kv_layer) == full and cache.linear_layers == linear and len(cache.k) == len(full)
    engine.model.forward(np.asarray(prompt(1, 20)), cache)
    assert cache.length == 20 and 20 in cache.snapshots and np.abs(cache.state[0]).sum() > 0


def test_same_tokens_streamed_under_a_small_budget_and_resident(hybrid, tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
    ids = prompt(2)
    resident = fresh(hybrid, ids, 24)
    c = Container(hybrid)  # room for the dense weights and about a quarter of the experts
    budget = (c.dense_bytes + c.expert_bytes // 4) / 2**30
    streamed = Engine.load(hybrid, prefill_chunk=CHUNK, ram_gb=budget, stream_experts=True)
    assert streamed.generate(ids, max_tokens=24, stop_at_eos=False).token_ids == resident
    assert streamed.expert_stats["misses"] > 0  # the budget really streamed


def test_drafts_change_no_token_and_leave_no_rejected_state(hybrid, engine):
    # Random weights do not copy text, but greedy runs from different starts fall into the same
    # long path: a prompt holding that path (what a run produced) gives prompt lookup its drafts.
    engine.reset()
    path = engine.generate(prompt(0, 8), max_tokens=60, stop_at_eos=False).token_ids
    ids = path + prompt(1, 8)
    plain = fresh(hybrid, ids, 40)
    engine.reset()
    got = engine.generate(ids, max_tokens=40, stop_at_eos=False, speculative="ngram", draft_tokens=4)
    assert got.token_ids == plain
    assert got.speculative["passes"] > 0 and got.speculative["accepted"] > 0
    # (a rejected draft rolled back exactly: harness.check_rows_match_solo_decode, in the family tests)
    kv = engine.slots[got.slot]
    assert kv.cache.length == len(kv.ids)
    held = len(kv.ids)
    follow = kv.ids + prompt(4, 5)  # the next turn continues from the state the drafts left
    again = engine.generate(follow, max_tokens=8, stop_at_eos=False, slot=got.slot)
    assert again.prompt_tokens_reused == held and again.token_ids == fresh(hybrid, follow, 8)


def test_batched_sequences_get_their_solo_tokens(hybrid):
    from test_batching import run_together

    jobs = [(prompt(5), {}), (prompt(6, 9), {"speculative": "ngram"}), (prompt(7, 17), {"temperature": 0.8, "seed": 3})]
    alone = [fresh(hybrid, p, 12, **kw) for p, kw in jobs]
    e = Engine.load(hybrid, prefill_chunk=CHUNK, kv_slots=3)
    e.start_batching()
    try:
        together = run_together(e, jobs, 12)
        stats = e.batch_stats
    finally:
        e.stop_batching()
    assert [g.token_ids for g in together] == alone
    assert stats["mean_rows"] > 1.2


def test_prefix_reuse_ends_at_a_kept_state(hybrid, engine):
    a = prompt(8)
    engine.reset()
    first = engine.generate(a, max_tokens=6, stop_at_eos=False)
    # The next turn continues the whole conversation: the live state is reused, nothing re-prefilled.
    turn2 = a + first.token_ids + prompt(9, 7)
    second = engine.generate(turn2, max_tokens=6, stop_at_eos=False, slot=first.slot)
    assert second.prompt_tokens_reused == len(a) + len(first.token_ids) - 1  # (the last one was never fed)
    assert second.token_ids == fresh(hybrid, turn2, 6)
    # A prompt that leaves the conversation at token 21 reuses the prefill chunk that ended at 16.
    engine.reset()
    engine.generate(a, max_tokens=1, stop_at_eos=False, slot=0)
    other = a[:21] + prompt(10, 9)
    third = engine.generate(other, max_tokens=6, stop_at_eos=False, slot=0)
    assert third.prompt_tokens_reused == 16
    assert third.token_ids == fresh(hybrid, other, 6)


def test_truncate_is_exact_or_refuses(engine):
    cache = engine.model.new_cache(64)
    engine.model.forward(np.asarray(prompt(11, 10)), cache)
    for t in prompt(12, 3):
        engine.model.forward(np.asarray([t]), cache)
    with pytest.raises(ColibriError, match="no state was kept"):
        cache.truncate(11)
    assert cache.rewind(12) == 10 and cache.length == 10  # back to the chunk's end
    cache.truncate(0)
    assert cache.length == 0 and not np.any(cache.state[0])


def test_saved_slot_restores_the_state(hybrid, engine, tmp_path):
    ids = prompt(13)
    engine.reset()
    g = engine.generate(ids, max_tokens=5, stop_at_eos=False, slot=1)
    held = len(engine.slots[1].ids)
    engine.save_slot(1, tmp_path / "slot.npz")
    more = ids + g.token_ids + prompt(14, 4)
    other = Engine.load(hybrid, prefill_chunk=CHUNK)
    assert other.load_slot(0, tmp_path / "slot.npz") == held
    got = other.generate(more, max_tokens=8, stop_at_eos=False, slot=0)
    assert got.prompt_tokens_reused == held  # the restored state, not a prefill
    assert got.token_ids == fresh(hybrid, more, 8)


def test_a_pass_that_fails_part_way_leaves_a_usable_state(hybrid, engine, monkeypatch):
    ids = prompt(15)
    engine.reset()
    engine.generate(ids[:16], max_tokens=1, stop_at_eos=False, slot=2)  # kept: 8, 16
    kv = engine.slots[2]
    moe = engine.model.layers[2].mlp
    calls = {"n": 0}
    real = type(moe).__call__

    def fail_once(self, x):
        calls["n"] += 1
        if calls["n"] == 1:
            raise EngineFault("a damaged expert (test)")
        return real(self, x)

    monkeypatch.setattr(type(moe), "__call__", fail_once)
    with pytest.raises(EngineFault):
        engine.generate(ids, max_tokens=4, stop_at_eos=False, slot=2)
    assert engine.slots[2] is kv and len(kv.ids) == kv.cache.length  # the slot names what its state holds
    monkeypatch.undo()
    got = engine.generate(ids, max_tokens=6, stop_at_eos=False, slot=2)
    assert got.token_ids == fresh(hybrid, ids, 6)
