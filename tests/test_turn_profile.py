"""Each turn's profile (colibri/engine/turn_profile.py): the differences of counter readings
checked against hand-computed figures, then real turns of a tiny synthetic MoE whose experts
stream from disk (phases timed), stay resident (phases off by default) or run batched."""
import math
import threading

import numpy as np
import pytest
from tools import synthetic_moe

from colibri import Engine
from colibri.engine import turn_profile as tp
from colibri.io.container import Container
from colibri.profile import PHASES

LAYER = "model.layers.{}.mlp".format


# ------------------------------------------------------------------------------ the maths
def test_entropy_of_hand_counted_selections():
    assert tp.entropy_bits([1, 1, 1, 1]) == pytest.approx(2.0)   # four experts, equal shares
    assert tp.entropy_bits([7, 0, 0, 0]) == 0.0                  # one expert took every selection
    assert tp.entropy_bits([2, 1, 1]) == pytest.approx(1.5)      # -(.5 log2 .5 + 2 x .25 log2 .25)
    assert tp.entropy_bits([3, 1]) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    assert tp.entropy_bits([0, 0, 0]) is None and tp.entropy_bits([]) is None


def test_routing_entropy_is_over_the_turns_own_selections_in_layer_order():
    before = {LAYER(10): [1, 2, 3, 4], LAYER(2): [5, 0]}
    after = {LAYER(10): [3, 4, 5, 6], LAYER(2): [9, 0], LAYER(3): [0, 0]}  # layer 3: new, not routed
    r = tp.routing_entropy(before, after)
    assert r == {"layers": [2, 3, 10], "entropy_bits": [0.0, None, 2.0], "max_bits": 2.0}
    assert tp.count_diff(before, after)[LAYER(10)] == [2, 2, 2, 2]
    assert tp.routing_entropy(None, None) is None


def test_cache_tiers_drives_and_prediction_are_the_turns_differences():
    s0 = {"hits": 10, "misses": 5, "prefetch_hits": 1, "bytes_read": 1000, "reads": 5, "wait_s": 0.5,
          "predicted": 10, "predicted_used": 5, "needed": 8, "repins": 2,
          "vram_hits": 0, "vram_misses": 4, "vram_bytes_uploaded": 40, "vram_upload_s": 0.0}
    s1 = {**s0, "hits": 16, "misses": 7, "prefetch_hits": 3, "bytes_read": 3000, "reads": 7, "wait_s": 0.75,
          "predicted": 20, "predicted_used": 13, "needed": 18, "repins": 5,
          "vram_hits": 3, "vram_misses": 5, "vram_bytes_uploaded": 50}
    c = tp.cache_tiers(s0, s1)
    assert c["ram"] == {"hits": 6, "misses": 2, "prefetch_hits": 2, "hit_rate": 0.75}
    assert c["vram"] == {"hits": 3, "misses": 1, "hit_rate": 0.75, "bytes_uploaded": 10}
    assert (c["bytes_read"], c["reads"]) == (2000, 2)
    assert tp.cache_tiers(None, s1) is None

    d0 = {"/a": {"bytes_read": 100, "reads": 1, "read_s": 0.5, "errors": 0, "weight": 1.0}}
    d1 = {"/a": {"bytes_read": 300, "reads": 3, "read_s": 0.75, "errors": 1, "weight": 1.0},
          "/b": {"bytes_read": 50, "reads": 1, "read_s": 0.25, "errors": 0, "weight": 2.0}}
    assert tp.drive_use(d0, d1) == {"/a": {"bytes_read": 200, "reads": 2, "read_s": 0.25, "errors": 1},
                                    "/b": {"bytes_read": 50, "reads": 1, "read_s": 0.25, "errors": 0}}

    l0 = {LAYER(1): {"predicted": 4, "used": 2, "needed": 4}, LAYER(0): {"predicted": 0, "used": 0, "needed": 0}}
    l1 = {LAYER(1): {"predicted": 8, "used": 5, "needed": 10}, LAYER(0): {"predicted": 4, "used": 1, "needed": 2}}
    p = tp.prediction(s0, s1, l0, l1)
    assert (p["predicted"], p["used"], p["needed"]) == (10, 8, 10)
    assert p["precision"] == 0.8 and p["recall"] == 0.8
    assert p["per_layer"] == {"layers": [0, 1], "precision": [0.25, 0.75], "recall": [0.5, 0.5]}
    assert tp.prediction({"hits": 0}, {"hits": 1}, None, None) is None  # a source that predicts nothing

    profile = tp.profile_between(tp.Reading(store=s0), tp.Reading(store=s1), turn=1, prompt_tokens=5,
                                 reused_tokens=1, completion_tokens=3, prefill_s=0.5, decode_s=1.0)
    assert profile.disk_wait_s == 0.25 and profile.repins == 3 and profile.phases is None
    assert profile.decode_tok_s == 2.0 and profile.prefill_tok_s == 8.0


def test_phase_split_in_seconds_by_hand():
    seconds = {("attention", 0): 0.2, ("attention", 1): 0.1, ("ffn", 0): 0.1, ("ffn", 1): 0.6,
               ("router", 1): 0.05, ("routed_experts", 1): 0.3, ("shared_experts", 1): 0.02,
               ("head", -1): 0.1, ("embed", -1): 0.01}
    split = tp.phase_split(seconds, 1.5, 0.1, ["dense", "moe"])
    # dense MLP: layer 0's feed-forward and the shared experts; routed experts less the disk wait;
    # head with the embedding; other: what no phase timed (layer 1's "ffn" is the MoE block's sum)
    assert split == pytest.approx({"attention": 0.3, "dense_mlp": 0.12, "routing": 0.05, "routed_experts": 0.2,
                                   "disk_wait": 0.1, "head": 0.11, "other": 0.62})
    assert list(split) == list(tp.PHASE_KEYS)
    assert tp.phase_diff({("head", -1): 1.0}, {("head", -1): 1.5, ("attention", 0): 0.25}) == \
        {("head", -1): 0.5, ("attention", 0): 0.25}


# ------------------------------------------------------------------------------ real turns
@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return synthetic_moe.write_container(tmp_path_factory.mktemp("profile") / "m", "tiny", progress=False)


@pytest.fixture()
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))  # routing history kept apart


def _one_layer_budget(model) -> float:
    """Dense weights and room for one layer's experts: most expert lookups read the disk."""
    c = Container(model)
    return (c.dense_bytes + sum(layout.blob_bytes for layout in c.expert_layouts.values())) / (1 << 30)


def _check_sane(p: dict, completion: int, experts: int) -> None:
    assert p["tokens"]["completion"] == completion
    s = p["seconds"]
    assert s["prefill"] > 0 and s["decode"] > 0 and s["total"] == pytest.approx(s["prefill"] + s["decode"], abs=1e-5)
    assert p["tok_s"]["decode"] > 0
    r = p["routing"]
    assert r["max_bits"] == pytest.approx(math.log2(experts))
    assert all(h is not None and 0.0 <= h <= r["max_bits"] + 1e-9 for h in r["entropy_bits"])


def test_a_streamed_turn_times_its_phases_and_reads(tiny_moe, home):
    engine = Engine.load(tiny_moe, ram_gb=_one_layer_budget(tiny_moe), stream_experts=True)
    assert engine.profile_phases  # default: on where experts stream
    g = engine.generate("Tell me about hummingbirds.", max_tokens=6, stop_at_eos=False)
    p = g.profile
    _check_sane(p, 6, experts=8)
    assert set(p["phases"]) == set(tp.PHASE_KEYS)
    assert p["phases"]["attention"] > 0 and p["phases"]["routed_experts"] >= 0 and p["phases"]["head"] > 0
    assert p["seconds"]["disk_wait"] >= 0 and p["phases"]["disk_wait"] == p["seconds"]["disk_wait"]
    assert sum(p["phases"].values()) == pytest.approx(p["seconds"]["total"], rel=1e-3)
    ram = p["cache"]["ram"]
    assert ram["misses"] > 0 and 0.0 <= ram["hit_rate"] <= 1.0 and p["cache"]["bytes_read"] > 0
    assert p["routing"]["layers"] == [0, 1, 2] and p["overlapping_turns"] == 0
    assert g.experts["hits"] == ram["hits"] and g.experts["bytes_read"] == p["cache"]["bytes_read"]
    if p["drives"] is not None:  # the store counts its reads per drive
        assert sum(d["bytes_read"] for d in p["drives"].values()) == p["cache"]["bytes_read"]
    assert not PHASES.on  # the clock runs only while a profiled turn does

    # the next turn reuses the prompt's KV and is profiled as its own; the last ones are kept in order
    g2 = engine.generate("Tell me about hummingbirds.", max_tokens=3, stop_at_eos=False)
    assert g2.profile["tokens"]["reused"] > 0 and g2.profile["turn"] == p["turn"] + 1
    assert [x["turn"] for x in engine.profiles()] == [p["turn"], p["turn"] + 1]


def test_a_turn_left_early_lets_the_clock_go_and_the_last_turns_are_bounded(tiny_moe, home):
    engine = Engine.load(tiny_moe, ram_gb=_one_layer_budget(tiny_moe), stream_experts=True)
    stream = engine.stream("Count to ten.", max_tokens=20, stop_at_eos=False)
    next(stream)
    assert PHASES.on
    stream.close()  # a client went away: no profile, and the clock is off again
    assert not PHASES.on and engine.profiles() == []
    for _ in range(tp.PROFILES_KEPT + 3):
        engine.generate([5, 6, 7], max_tokens=0)  # (nothing to generate: the cheapest turn there is)
    turns = [x["turn"] for x in engine.profiles()]
    assert len(turns) == tp.PROFILES_KEPT and turns == list(range(4, tp.PROFILES_KEPT + 4))


def test_resident_experts_have_routing_but_no_phase_clock_by_default(tiny_moe, home):
    engine = Engine.load(tiny_moe, stream_experts=False)
    assert not engine.profile_phases
    p = engine.generate("Hi", max_tokens=4, stop_at_eos=False).profile
    _check_sane(p, 4, experts=8)
    assert p["phases"] is None and p["cache"] is None
    forced = Engine.load(tiny_moe, stream_experts=False, profile_phases=True)
    assert forced.generate("Hi", max_tokens=4, stop_at_eos=False).profile["phases"]["attention"] > 0
    assert not PHASES.on


def test_batched_turns_split_their_prefill_and_say_they_overlapped(tiny_moe, home):
    engine = Engine.load(tiny_moe, kv_slots=2, ram_gb=_one_layer_budget(tiny_moe), stream_experts=True)
    engine.start_batching()
    out = [None, None]
    go = threading.Barrier(2)

    def work(i):
        go.wait()
        out[i] = engine.generate(f"Prompt number {i} about birds.", max_tokens=12, slot=i, stop_at_eos=False)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        engine.stop_batching()
    for g in out:
        p = g.profile
        _check_sane(p, 12, experts=8)
        # decode steps ran batched through forward_rows, timed as forward is; the clock is the
        # process's, so a turn's split holds the other turn's work too where they overlapped
        assert p["phases"]["attention"] > 0 and p["phases"]["head"] > 0
        assert sum(p["phases"].values()) >= p["seconds"]["total"] * (1 - 1e-3)
    assert max(g.profile["overlapping_turns"] for g in out) == 1
    assert not PHASES.on
    assert np.isfinite([g.profile["seconds"]["total"] for g in out]).all()
