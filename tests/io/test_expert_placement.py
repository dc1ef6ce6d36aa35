"""Expert placement levers where the disk is the limit: guesses of the next layers' experts
(scored, and never evicting an expert likelier to be used than the guess), the hot set
re-pinned as the heat moves (bounded reads per turn, kept across starts), topic-dependent
synthetic routing. No lever changes a token."""
import json
import shutil

import numpy as np
import pytest
from tools import synthetic_moe

from colibri import Engine
from colibri.io.container import Container
from colibri.io.expert_store import ExpertStore, StoreConfig, load_heat

GiB = 1 << 30

pytestmark = pytest.mark.usefixtures("private_cache")  # tests/io/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic_moe.write_container(tmp_path_factory.mktemp("syn") / "m", "tiny", progress=False)


@pytest.fixture(scope="module")
def topical(tmp_path_factory):
    """The 'small' preset (16 experts, top-4, 4 MoE layers) with 4 topics."""
    return synthetic_moe.write_container(tmp_path_factory.mktemp("topics") / "m", "small", progress=False, topics=4)


def slot_bytes(model) -> int:
    return max(l.blob_bytes for l in Container(model).expert_layouts.values())


def budget_gb(model, experts_per_layer: float) -> float:
    c = Container(model)
    return (c.dense_bytes + experts_per_layer * sum(l.blob_bytes for l in c.expert_layouts.values())) / GiB


def store(model, experts_per_layer: int, **options) -> ExpertStore:
    c = Container(model)
    cfg = StoreConfig(ram_bytes=experts_per_layer * sum(l.blob_bytes for l in c.expert_layouts.values()), **options)
    return ExpertStore(c, cfg)


def use(s: ExpertStore, prefix: str, ids: list[int]) -> None:
    """A layer's pass over experts `ids`, as a model's MoE block asks for them."""
    for _ in s.iter_experts(prefix, ids, blobs=True):
        pass


SEQ = np.random.default_rng(5).integers(0, 49152, size=32).tolist()


@pytest.mark.parametrize("options", [
    {"prefetch": True, "prefetch_depth": 0, "repin": False},
    {"prefetch": True, "prefetch_depth": 2, "repin": True},
    {"prefetch": False, "repin": True, "hot_set": True},
    {"prefetch": True, "repin": True, "hot_set": False},
    {"prefetch": True, "repin": True, "mirrors": "copy", "expert_io": "direct"},  # every lever at once
])
def test_no_lever_changes_a_token(tiny, options, tmp_path):
    if options.get("mirrors") == "copy":  # a second drive: a copy of the model's files
        options = dict(options, mirrors=[str(shutil.copytree(tiny, tmp_path / "mirror"))])
    ref = Engine.load(tiny, stream_experts=False)
    want = [ref.generate(SEQ[:6], max_tokens=10, stop_at_eos=False).token_ids for _ in range(2)]
    want_logits = ref.logits(SEQ)
    e = Engine.load(tiny, ram_gb=budget_gb(tiny, 3.5), stream_experts=True, **options)
    for turn in range(2):  # the second turn runs after a re-pin
        e.reset()
        assert e.generate(SEQ[:6], max_tokens=10, stop_at_eos=False).token_ids == want[turn]
    assert np.array_equal(e.logits(SEQ), want_logits)
    stats = e.expert_stats
    if options["prefetch"]:
        assert 0 < stats["predicted_used"] <= min(stats["predicted"], stats["needed"])
    else:
        assert stats["predicted"] == 0
    if "mirrors" in options:  # both drives were read
        assert all(d["bytes_read"] > 0 for d in e.experts.drive_stats().values())


def test_guesses_are_scored_per_layer(topical):
    """The synthetic's routing is predictable from the layer before (its residual writes are
    small): most guesses are right, and the per-layer scores add up to the totals."""
    e = Engine.load(topical, ram_gb=budget_gb(topical, 6), stream_experts=True, prefetch=True)
    cfg = json.loads((topical / "config.json").read_text())
    e.feed(synthetic_moe.topic_tokens(cfg, 0, 24))
    by_layer = e.experts.prediction_by_layer()
    stats = e.expert_stats
    assert sum(s["predicted"] for s in by_layer.values()) == stats["predicted"]
    assert sum(s["used"] for s in by_layer.values()) == stats["predicted_used"]
    for s in by_layer.values():
        assert s["needed"] == 24 * cfg["num_experts_per_tok"]  # one pass per token, top-4 each
        assert s["used"] / s["predicted"] > 0.5 and s["used"] / s["needed"] > 0.5
    assert stats["guess_reads_used"] <= stats["guess_reads"]


def test_a_guess_never_evicts_an_expert_likelier_to_be_used(tiny):
    s = store(tiny, 2, hot_fraction=0.0, repin=False)  # 6 slots over 3 layers, no hot set
    a, b, c = s.layers
    try:
        for _ in range(20):  # a and b: experts 0-2 used at every pass (use rate 1.0)
            use(s, a, [0, 1, 2])
            use(s, b, [0, 1, 2])
        assert len(s.slots.lru) == 6 and not s.slots.free
        s.prefetch(c, [5])  # the guess's precision (its prior, 0.5) is below every cached expert's rate
        assert s.stats.guess_skipped == 1 and s.stats.guess_reads == 0
        assert set(s.slots.lru) == {(p, e) for p in (a, b) for e in (0, 1, 2)}
        use(s, c, [4])  # the guess was scored: 0 of 1 right, layer c needed 1
        assert s.prediction_by_layer()[c] == {"predicted": 1, "used": 0, "needed": 1}
    finally:
        s.close()


def test_a_wrong_guess_goes_to_the_cold_end(tiny):
    s = store(tiny, 2, hot_fraction=0.0, repin=False)
    a, b, c = s.layers
    try:
        use(s, a, [0, 1])
        s.prefetch(b, [3, 4])  # into free slots
        assert s.stats.guess_reads == 2
        use(s, a, [0, 1])  # layer a's misses may not take the guessed slots before b runs
        assert {(b, 3), (b, 4)} <= set(s.slots.lru)
        use(s, b, [3, 6])  # 3 was right, 4 wrong
        assert s.stats.guess_reads_used == 1
        assert next(iter(s.slots.lru)) == (b, 4)  # the wrong guess is the next to go
        assert s.prediction_by_layer()[b] == {"predicted": 2, "used": 1, "needed": 2}
    finally:
        s.close()


def test_the_hot_set_follows_the_heat_with_bounded_reads(tiny, tmp_path):
    """Pinned from a history that favours experts 0-1 of every layer; the workload then uses
    5-6. Each turn end re-pins at most `repin_reads` experts that need a read (none for one
    already cached); the hot set converges on 5-6, and the heat it followed is saved and pins
    the next start's hot set."""
    c = Container(tiny)
    prefixes = list(c.expert_layouts)
    history = {p: [50, 50, 0, 0, 0, 0, 0, 0] for p in prefixes}
    path = tmp_path / "history.json"
    s = store(tiny, 4, hot_fraction=0.5, repin=True, repin_reads=1, history=history, history_file=path)
    try:
        assert {p: sorted(l.pinned) for p, l in s.layers.items()} == {p: [0, 1] for p in prefixes}
        rounds = []
        for turn in range(8):
            for _ in range(6):
                for p in prefixes:
                    use(s, p, [5, 6])
            before = s.stats.reads
            s.save_history()  # a turn end: the re-pin runs at the next call
            for p in prefixes:
                use(s, p, [5, 6])
            rounds.append(s.stats.reads - before)
            if all(sorted(l.pinned) == [5, 6] for l in s.layers.values()):
                break
        assert all(sorted(l.pinned) == [5, 6] for l in s.layers.values()), s.tiers()
        assert max(rounds) <= 1  # 5 and 6 were cached: swapped in without reads
        assert s.stats.repins >= 2 * len(prefixes)
        saved = load_heat(path)
        assert set(saved) == set(prefixes)
        for p in prefixes:
            passes, heat = saved[p]
            assert passes > 0 and np.argsort(heat)[-2:].tolist() in ([5, 6], [6, 5])
    finally:
        s.close()
    again = store(tiny, 4, hot_fraction=0.5, history=history, heat=load_heat(path))
    try:  # the heat, not the older counts, chose the hot set
        assert all(sorted(l.pinned) == [5, 6] for l in again.layers.values())
    finally:
        again.close()


def test_pin_once_keeps_its_hot_set(tiny):
    history = {p: [50, 50, 0, 0, 0, 0, 0, 0] for p in Container(tiny).expert_layouts}
    s = store(tiny, 4, hot_fraction=0.5, repin=False, history=history)
    try:
        for _ in range(5):
            for p in s.layers:
                use(s, p, [5, 6])
            s.save_history()
        for p in s.layers:
            use(s, p, [5, 6])
        assert all(sorted(l.pinned) == [0, 1] for l in s.layers.values()) and s.stats.repins == 0
    finally:
        s.close()


def test_topics_heat_different_experts(topical):
    """Prompts of one topic route mostly to that topic's experts: the experts two topics use
    most differ, and one topic's hottest experts take a larger share of its own routing than of
    another topic's."""
    cfg = json.loads((topical / "config.json").read_text())
    assert synthetic_moe.topics_of(cfg) == (4, synthetic_moe.DEFAULT_TOPIC_AFFINITY)
    e = Engine.load(topical, stream_experts=False)
    heat = []
    for topic in (0, 1):
        before = {p: c.copy() for p, c in e.experts._counts.items()}
        e.reset()
        e.feed(synthetic_moe.topic_tokens(cfg, topic, 48))
        heat.append({p: e.experts._counts[p] - before[p] for p in before})
    gaps = []
    for p in heat[0]:
        top0 = np.argsort(-heat[0][p])[:4]
        share_own = heat[0][p][top0].sum() / heat[0][p].sum()
        share_other = heat[1][p][top0].sum() / heat[1][p].sum()
        gaps.append(share_own - share_other)
    assert min(gaps) > 0.05 and np.mean(gaps) > 0.1, gaps
    tokens = synthetic_moe.topic_tokens(cfg, 3, 100)
    assert all(t % 4 == 3 and 0 <= t < 49152 for t in tokens)
