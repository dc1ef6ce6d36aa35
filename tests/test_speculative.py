"""Speculative decoding never changes the output: greedy and seeded sampling give the same
tokens with and without drafts, on the dense default model and on a streamed MoE; the slot keeps
exactly the tokens emitted (no rejected draft left in the cache); bad settings are refused."""
import numpy as np
import pytest
from tools import synthetic_moe

from colibri import ColibriError, Engine
from colibri.speculative import NgramDrafter

LIST = "\n".join(f"- item {i}: {w}" for i, w in enumerate("red green blue cyan magenta yellow black white".split()))
PROMPT = f"Copy this list exactly, one item per line:\n{LIST}"


def test_lookup_follows_the_latest_earlier_match():
    d = NgramDrafter([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2])
    assert d.propose(3) == [3, 9, 9]      # "1 2" last seen at 5 (the tail itself does not count)
    assert d.propose(1) == [3]
    d.extend([3])
    assert d.propose(8) == [9, 9, 1, 2, 3]  # "1 2 3" last seen at 5; the followers run to the end
    assert NgramDrafter([1, 2, 3]).propose(4) == []
    assert NgramDrafter([7]).propose(4) == []
    assert NgramDrafter([7, 7, 7]).propose(4) == [7]
    # One matching token is not enough to draft on, unless asked
    assert NgramDrafter([5, 7, 6, 7]).propose(4) == []
    assert NgramDrafter([5, 7, 6, 7], min_ngram=1).propose(4) == [6, 7]


@pytest.fixture(scope="module")
def engine(smollm2_container):
    return Engine.load(smollm2_container)


def generate(engine, mode, **kw):
    engine.reset()
    return engine.generate(PROMPT, speculative=mode, **kw)


@pytest.mark.parametrize("mode", ["ngram", "auto"])
def test_greedy_output_is_identical_and_drafts_are_used(engine, mode):
    ref = generate(engine, "off", max_tokens=48)
    got = generate(engine, mode, max_tokens=48, draft_tokens=5)
    assert got.token_ids == ref.token_ids and got.text == ref.text and got.finish_reason == ref.finish_reason
    assert ref.speculative is None
    if mode == "ngram":
        assert got.speculative["passes"] > 0 and got.speculative["accepted"] > 0
    kv = engine.slots[got.slot]
    assert engine.cache.length == len(kv.ids)  # no rejected draft left behind


def test_seeded_sampling_is_identical_with_logprobs(engine):
    kw = dict(max_tokens=40, temperature=0.8, top_p=0.95, top_k=40, seed=11, logprobs=3)
    ref = [(e.token_id, e.logprob, e.top_logprobs) for e in _events(engine, "off", **kw)]
    got = [(e.token_id, e.logprob, e.top_logprobs) for e in _events(engine, "ngram", **kw)]
    assert got == ref


def _events(engine, mode, **kw):
    engine.reset()
    return list(engine.stream(PROMPT, speculative=mode, **kw))


def test_stops_budgets_and_the_context_end_are_kept(engine, smollm2_container):
    ref = generate(engine, "off", max_tokens=40, stop=["item 3"])
    got = generate(engine, "ngram", max_tokens=40, stop=["item 3"])
    assert (got.text, got.finish_reason) == (ref.text, ref.finish_reason) == (ref.text, "stop")
    for n in (1, 2, 7):
        assert generate(engine, "ngram", max_tokens=n).token_ids == generate(engine, "off", max_tokens=n).token_ids
    # A context that ends a few tokens after the prompt: drafts never run past it.
    small = Engine.load(smollm2_container, max_context=len(engine.encode_prompt(PROMPT)) + 9)
    a = small.generate(PROMPT, max_tokens=50, speculative="ngram", draft_tokens=16)
    small.reset()
    b = small.generate(PROMPT, max_tokens=50, speculative="off")
    assert a.token_ids == b.token_ids and len(a.token_ids) == 9


def test_next_turn_after_drafting_matches(engine):
    """The slot after a drafted turn holds what a plain turn leaves: the next turn, reusing the
    prefix, gives the same tokens."""
    turns = []
    for mode in ("off", "ngram"):
        first = generate(engine, mode, max_tokens=30)
        follow = engine.encode_prompt(PROMPT) + first.token_ids + engine.tokenizer.encode(" and again:")
        nxt = engine.generate(follow, max_tokens=20, speculative=mode)
        assert nxt.prompt_tokens_reused > 0
        turns.append(nxt.token_ids)
    assert turns[0] == turns[1]


def test_streamed_moe_gives_the_same_tokens(tmp_path_factory, monkeypatch, tmp_path):
    monkeypatch.setenv("COLIBRI_HOME", str(tmp_path / "home"))
    model = synthetic_moe.write_container(tmp_path_factory.mktemp("syn") / "m", "tiny", progress=False)
    # Random weights do not copy text, but within 80 greedy tokens they repeat themselves.
    prompt = np.random.default_rng(1).integers(0, 49152, 8).tolist()
    out = {}
    for mode in ("off", "ngram"):
        e = Engine.load(model, ram_gb=0.02, stream_experts=True)
        out[mode] = e.generate(prompt, max_tokens=80, stop_at_eos=False, speculative=mode, draft_tokens=4)
    assert out["ngram"].token_ids == out["off"].token_ids
    assert out["ngram"].speculative["accepted"] > 0


def test_bad_settings_are_refused(engine, smollm2_container):
    with pytest.raises(ColibriError, match="speculative must be one of"):
        engine.generate("hi", max_tokens=2, speculative="fast")
    with pytest.raises(ColibriError, match="draft tokens must be between"):
        engine.generate("hi", max_tokens=2, speculative="ngram", draft_tokens=0)
    with pytest.raises(ColibriError, match="draft tokens must be between"):
        Engine.load(smollm2_container, speculative="ngram", draft_tokens=33)


def test_auto_drafts_from_its_first_steps_before_any_probe():
    """Before a drafted pass is timed, auto assumes an extra row costs ROW_COST_PRIOR of a step
    (the multi-row kernels' measured 0.3-0.45): with the prior acceptance of 1/2 a first draft
    pays, so text that repeats is drafted at once, not after PROBE_EVERY plain steps."""
    from colibri.speculative import Speculator

    class Cache:
        max_tokens = 1000

        def truncate(self, n):
            pass

    passes = []

    def drafted_rows(tok, cache, draft):
        drafts = draft()
        passes.append(1 + len(drafts))
        return drafts, np.zeros((1 + len(drafts), 8), np.float32), np.zeros((1 + len(drafts), 4), np.float32)

    s = Speculator(drafted_rows, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], "auto", 4)
    for i, tok in enumerate([3, 4, 1]):
        s.step(Cache(), 10 + i, tok, room=100)
    assert passes[:2] == [1, 1] and passes[2] > 1  # two plain steps to time one, then drafts
