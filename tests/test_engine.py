"""Engine behaviour on the real SmolLM2 model: stop strings, logprobs, KV slots and their
persistence, early close of a stream, penalties, logit bias, min-p and prompt scoring."""
import numpy as np
import pytest

from colibri import ColibriError, Engine
from colibri.generate import Penalties, SamplingParams, StopMatcher, sample


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


def test_the_cache_is_sized_once_for_the_whole_generation(engine):
    """The slot's cache takes room for prompt + max_tokens before prefill, so neither the prompt
    nor the answer stops to double it (and copy what it holds); growing on demand gave 1024
    rows here, two copies."""
    engine.reset()
    prompt = list(range(100, 400))  # 300 tokens
    g = engine.generate(prompt, max_tokens=300, stop_at_eos=False, slot=1)
    assert g.prompt_tokens == 300 and len(g.token_ids) == 300
    assert engine.slots[1].cache.capacity == 600


# ---------------------------------------------------------------- sampling controls, scoring
def test_prompt_logprobs_score_every_prompt_token(engine):
    """Teacher-forced scores equal the log-softmax of the model's logits at each position, also
    across prefill chunks and with the prompt already cached in the slot."""
    ids = engine.encode_prompt("The quick brown fox jumps over the lazy dog.", raw=True)
    ref = engine.logits(ids).astype(np.float64)
    ref = ref - ref.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    engine.generate(ids, max_tokens=2, slot=2)                  # the slot now holds the prompt
    engine.config.prefill_chunk, chunk = 5, engine.config.prefill_chunk
    try:
        g = engine.generate(ids, max_tokens=0, prompt_logprobs=3, slot=2)
    finally:
        engine.config.prefill_chunk = chunk
    assert g.completion_tokens == 0 and g.finish_reason == "length" and g.prompt_tokens_reused == 0
    assert len(g.prompt_logprobs) == len(ids) - 1
    for i, (lp, top) in enumerate(g.prompt_logprobs):
        assert lp == pytest.approx(ref[i, ids[i + 1]], abs=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-ref[i], kind="stable")[:3])
    assert engine.generate(ids, max_tokens=3, prompt_logprobs=0, slot=2).completion_tokens == 3


def test_logit_bias_forces_and_bans_tokens(engine):
    ids = engine.encode_prompt("Say yes.")
    free = engine.generate(ids, max_tokens=4)
    banned = free.token_ids[0]
    g = engine.generate(ids, max_tokens=4, penalties=Penalties(logit_bias={banned: -100.0}))
    assert g.token_ids[0] != banned
    forced = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    g = engine.generate(ids, max_tokens=3, penalties=Penalties(logit_bias={forced: 100.0}))
    assert g.token_ids == [forced] * 3
    with pytest.raises(ColibriError, match="outside the vocabulary"):
        engine.generate(ids, max_tokens=1, penalties=Penalties(logit_bias={10 ** 9: 1.0}))


def test_penalties_follow_their_definitions():
    rng = np.random.default_rng(0)
    z = rng.standard_normal(50).astype(np.float32)
    prompt, out = [1, 2, 3], [3, 4, 4, 4]
    got = Penalties(repetition=1.3, frequency=0.5, presence=0.25, logit_bias={7: 2.0}).apply(z, prompt, out)
    want = z.copy()
    want[7] += 2.0
    for t in {1, 2, 3, 4}:
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    want[3] -= 0.5 * 1 + 0.25
    want[4] -= 0.5 * 3 + 0.25
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not Penalties().active and Penalties(presence=0.1).active
    np.testing.assert_array_equal(z, z.copy())  # the raw logits are left alone


def test_frequency_penalty_breaks_a_repetition(engine):
    ids = engine.encode_prompt("List the numbers one, one, one, one, one.")  # 'one,' x 11 unshifted
    plain = engine.generate(ids, max_tokens=24)
    shifted = engine.generate(ids, max_tokens=24, penalties=Penalties(frequency=2.0))
    most = max(plain.token_ids.count(t) for t in set(plain.token_ids))
    assert max(shifted.token_ids.count(t) for t in set(shifted.token_ids)) < most


def test_min_p_keeps_only_likely_tokens():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    picks = {sample(z, SamplingParams(temperature=1.0, min_p=0.5), rng) for _ in range(200)}
    assert picks == {0, 1}   # 0.15 and 0.05 are under half of 0.5


# ---------------------------------------------------------------- grammar constraint
def test_a_grammar_that_allows_the_answer_leaves_the_tokens_unchanged(engine):
    from colibri.grammar import Grammar

    ids = engine.encode_prompt("What is the capital of France?")
    free = engine.generate(ids, max_tokens=12)
    grammar = Grammar.compile(engine.tokenizer, {"regex": r"[\s\S]*"}, engine.vocab_size)
    held = engine.generate(ids, max_tokens=12, constraint=grammar.matcher())
    assert held.token_ids == free.token_ids and held.grammar_s > 0


def test_a_schema_grammar_ends_the_generation_when_complete(engine):
    import json

    from colibri.grammar import Grammar

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    grammar = Grammar.compile(engine.tokenizer, {"json_schema": schema, "strict": True}, engine.vocab_size)
    g = engine.generate("Where is the Eiffel tower? Answer in JSON.", max_tokens=40, constraint=grammar.matcher())
    assert g.finish_reason == "stop"
    assert set(json.loads(g.text)) == {"city"}
