"""Engine behaviour on the real SmolLM2 model: stop strings, logprobs, KV slots and their
persistence, early close of a stream."""
import numpy as np
import pytest

from colibri import ColibriError, Engine
from colibri.generate import StopMatcher


@pytest.fixture(scope="module")
def engine(smollm2_container) -> Engine:
    return Engine.load(smollm2_container, kv_slots=3)


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["</end>", "STOP"])
    emitted = []
    for piece in ["Hello </", "en", "d> tail"]:
        text, hit = m.feed(piece)
        emitted.append(text)
        if hit:
            break
    assert "".join(emitted) == "Hello "
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ART") == ("START", False)


def test_stop_string_is_not_leaked(engine):
    full = engine.generate("What is the capital of France?", max_tokens=24).text
    word = full.split()[2]  # cut inside the answer
    g = engine.generate("What is the capital of France?", max_tokens=24, stop=[word])
    assert g.finish_reason == "stop"
    assert word not in g.text and full.startswith(g.text)


def test_text_held_for_an_unfinished_stop_string_is_delivered(engine):
    full = engine.generate("What is the capital of France?", max_tokens=24)
    tail = full.text[-3:]
    # A stop string starting with the answer's last characters but never completed.
    events = list(engine.stream("What is the capital of France?", max_tokens=24, stop=[tail + "@@never"]))
    assert "".join(ev.text for ev in events) == full.text == engine.last.text
    assert events[-1].token_id is None and events[-1].text.endswith(tail)


def test_logprobs_are_a_distribution(engine):
    events = list(engine.stream("Say yes.", max_tokens=4, logprobs=5))
    for ev in events:
        assert len(ev.top_logprobs) == 5
        assert ev.top_logprobs[0][0] == ev.token_id  # greedy picks the most likely token
        assert ev.logprob == pytest.approx(ev.top_logprobs[0][1])
        assert sum(np.exp(lp) for _, lp in ev.top_logprobs) <= 1.0 + 1e-6


def test_slots_keep_separate_conversations(engine):
    engine.reset()
    a = engine.generate("Tell me about cats.", max_tokens=6, slot=0)
    b = engine.generate("Tell me about the moon.", max_tokens=6, slot=1)
    assert (a.slot, b.slot) == (0, 1)
    # Without an explicit slot, a continuation goes to the slot holding its prefix.
    held = list(engine.slots[0].ids)
    follow_up = held + engine.tokenizer.encode(" Why?", add_special_tokens=False)
    g = engine.generate(follow_up, max_tokens=2)
    assert g.slot == 0 and g.prompt_tokens_reused == len(held)
    assert engine.pick_slot(engine.slots[1].ids + [1, 2]) == 1


def test_saved_slot_restores_without_prefill(engine, tmp_path):
    engine.reset()
    engine.generate("Name three rivers.", max_tokens=8, slot=2)
    engine.save_slot(2, tmp_path / "slot.npz")
    held = list(engine.slots[2].ids)
    fresh = Engine.load(engine.container.dir, kv_slots=3)
    assert fresh.load_slot(2, tmp_path / "slot.npz") == len(held)
    follow = held + fresh.tokenizer.encode(" And two lakes?", add_special_tokens=False)
    g1 = engine.generate(follow, max_tokens=8, slot=2)
    g2 = fresh.generate(follow, max_tokens=8, slot=2)
    assert g2.prompt_tokens_reused == len(held)  # only the new tokens were prefilled
    assert g1.token_ids == g2.token_ids


def test_damaged_slot_file_is_a_clear_error(engine, tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ColibriError, match="unreadable"):
        engine.load_slot(0, bad)
    assert engine.slots[0].ids == []


def test_closing_a_stream_early_keeps_the_cache_consistent(engine):
    engine.reset()
    it = engine.stream("Write a long story about a dragon.", max_tokens=50, slot=0)
    for _ in range(3):
        next(it)
    it.close()
    kv = engine.slots[0]
    assert kv.cache.length == len(kv.ids)
    g = engine.generate("Write a long story about a dragon.", max_tokens=5, slot=0)
    assert g.prompt_tokens_reused == g.prompt_tokens - 1
