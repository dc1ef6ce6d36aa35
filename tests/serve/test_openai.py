"""The OpenAI-compatible routes driven by the official `openai` client against a real server:
chat and completions, streamed and not, usage, stop strings, seeds, logprobs, prefix reuse."""
from __future__ import annotations

import numpy as np

from colibri.engine import common_prefix as _common_prefix  # the engine's own rule for how much of a slot is reused
import pytest

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with

openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, messages=ASK, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **kw)


@pytest.fixture(scope="module")
def local_engine(smollm2_container):
    from colibri.engine import Engine

    return Engine.load(smollm2_container)


def test_models_are_listed_and_unknown_ones_are_404(openai_client):
    assert [m.id for m in openai_client.models.list().data] == [MODEL_ID]
    assert openai_client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="gpt-9", messages=ASK, max_tokens=1)


def test_chat_usage_equals_the_tokenizers_counts(openai_client, tokenizer):
    raw = openai_client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=ASK, max_tokens=5,
                                                                 temperature=0)
    r = raw.parse()
    assert raw.headers["x-request-id"]
    assert int(raw.headers["x-colibri-queue-wait-ms"]) >= 0
    assert r.object == "chat.completion" and r.model == MODEL_ID
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert r.usage.prompt_tokens == len(tokenizer.encode_chat(ASK))
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert len(tokenizer.encode(choice.message.content, add_special_tokens=False)) == 5


def test_chat_stream_equals_non_stream_and_reports_usage(openai_client):
    full = chat(openai_client, max_tokens=8)
    chunks = list(chat(openai_client, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streamed_and_not(openai_client, tokenizer):
    prompt = "The three primary colors are"
    r = openai_client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    streamed = list(openai_client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=6, temperature=0,
                                                     stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # token ids are a prompt too
    r2 = openai_client.completions.create(model=MODEL_ID, prompt=tokenizer.encode(prompt), max_tokens=6, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_stop_string_across_chunk_boundaries_never_leaks(openai_client):
    full = chat(openai_client, max_tokens=16, logprobs=True)
    pieces = [t.token for t in full.choices[0].logprobs.content]
    text = full.choices[0].message.content
    assert "".join(pieces) == text
    # a stop string made of the end of one token and the start of the next, away from the start
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    expected = text[:text.index(stop)]
    chunks = list(chat(openai_client, max_tokens=16, stop=[stop, "zzzz-never"], stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == expected
    assert all(stop not in d for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = chat(openai_client, max_tokens=16, stop=stop)
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    # the start of a stop string at the very end is held back, then released when the answer ends
    never = pieces[-1][-2:] + "#never"
    r = chat(openai_client, max_tokens=16, stop=never, logprobs=True)
    assert r.choices[0].message.content == text and len(r.choices[0].logprobs.content) == len(pieces)
    chunks = list(chat(openai_client, max_tokens=16, stop=never, logprobs=True, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs) == len(pieces)
    c = openai_client.completions.create(model=MODEL_ID, prompt="One, two, three, four,", max_tokens=8,
                                         temperature=0, stop=[" five"])
    assert "five" not in c.choices[0].text


def test_same_seed_same_tokens(openai_client):
    kw = dict(messages=[{"role": "user", "content": "Write a word."}], max_tokens=8, temperature=1.0, seed=1234)
    a = chat(openai_client, **kw).choices[0].message.content
    b = chat(openai_client, **kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(openai_client, stream=True, **kw) if c.choices)
    assert a == b == streamed


def test_logprobs_sum_check_against_the_engines_distribution(openai_client, tokenizer, local_engine):
    r = chat(openai_client, max_tokens=4, logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 4
    prompt = tokenizer.encode_chat(ASK)
    gen = tokenizer.encode(r.choices[0].message.content, add_special_tokens=False)
    assert [tokenizer.decode([t]) for t in gen] == [e.token for e in entries]
    logits = local_engine.logits(prompt + gen)[len(prompt) - 1:len(prompt) - 1 + len(gen)]  # [L, V]
    for row, tok, e in zip(logits, gen, entries):
        lp = row.astype(np.float64) - row.max()
        lp -= np.log(np.exp(lp).sum())
        assert e.logprob == pytest.approx(lp[tok], abs=2e-3)
        assert len(e.top_logprobs) == 5
        assert e.top_logprobs[0].token == e.token  # greedy: the most likely token
        best = np.argsort(-lp)[:5]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(lp[best].tolist(), abs=2e-3)
        assert sum(np.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
    c = openai_client.completions.create(model=MODEL_ID, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_second_turn_prefills_only_new_tokens_and_matches_a_cold_run(openai_client, tokenizer, local_engine):
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    r1 = chat(openai_client, turn1, max_tokens=6, extra_body={"cache_slot": 1})
    answer = r1.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a vegetable?"}]
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL_ID, messages=turn2, max_tokens=6, temperature=0, extra_body={"cache_slot": 1})
    r2 = raw.parse()
    ids1 = tokenizer.encode_chat(turn1)
    ids2 = tokenizer.encode_chat(turn2)
    held = ids1 + tokenizer.encode(answer, add_special_tokens=False)[:-1]  # the last sampled token is never fed
    expected = min(_common_prefix(held, ids2), len(ids2) - 1)
    assert r2.usage.prompt_tokens == len(ids2)
    assert r2.usage.prompt_tokens_details.cached_tokens == expected >= len(ids1)
    assert raw.headers["x-colibri-prompt-tokens-reused"] == str(expected)
    assert raw.headers["x-colibri-kv-slot"] == "1"
    cold = local_engine.generate(ids2, max_tokens=6)  # a fresh engine: nothing cached
    assert cold.prompt_tokens_reused == 0
    assert r2.choices[0].message.content == cold.text


def test_without_cache_slot_the_conversation_finds_its_slot(openai_client):
    turn1 = [{"role": "user", "content": "Count to three."}]
    r1 = chat(openai_client, turn1, max_tokens=4, extra_body={"cache_slot": 2})
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Again."}]
    raw = openai_client.chat.completions.with_raw_response.create(model=MODEL_ID, messages=turn2, max_tokens=2,
                                                                 temperature=0)
    assert raw.headers["x-colibri-kv-slot"] == "2"
    assert raw.parse().usage.prompt_tokens_details.cached_tokens > len(turn1[0]["content"])


def test_thinking_switch_on_a_model_without_one(openai_client, server):
    # SmolLM2's template has no thinking switch: turning thinking off is a no-op, asking for it a 400.
    assert chat(openai_client, max_tokens=2, extra_body={"enable_thinking": False}).choices[0].message.content
    assert chat(openai_client, max_tokens=2, reasoning_effort="none").choices[0].message.content
    for kw in ({"extra_body": {"enable_thinking": True}}, {"reasoning_effort": "high"}):
        with pytest.raises(openai.BadRequestError) as e:
            chat(openai_client, max_tokens=2, **kw)
        assert e.value.body["param"] in ("enable_thinking", "reasoning_effort")
        assert "thinking switch" in e.value.body["message"]


def test_tokenize_and_detokenize(server, tokenizer):
    with server.client() as c:
        r = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
        assert c.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
        m = c.post("/tokenize", json={"messages": ASK}).json()
        assert m["tokens"] == tokenizer.encode_chat(ASK)
        assert c.post("/detokenize", json={"tokens": [10 ** 9]}).status_code == 400


def test_request_id_on_every_response(server):
    with server.client() as c:
        for r in (c.get("/v1/models"), c.get("/nope"), c.post("/v1/chat/completions", content=b"{")):
            assert r.headers["x-request-id"]
        assert c.get("/v1/models", headers={"x-request-id": "trace-42"}).headers["x-request-id"] == "trace-42"
        r = c.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["message"]


def test_metrics_are_prometheus_text(server):
    with server.client() as c:
        text = c.get("/metrics").text
    for name in ("colibri_generations_total", "colibri_rejected_requests_total", "colibri_completion_tokens_total",
                 "colibri_queue_depth", "colibri_time_to_first_token_seconds_bucket",
                 "colibri_decode_tokens_per_second_bucket", "colibri_expert_hit_ratio",
                 "colibri_http_responses_total"):
        assert name in text


def test_ignore_eos_generates_the_whole_budget(openai_client):
    """vLLM's and llama.cpp's `ignore_eos`: benchmarks ask for exactly max_tokens tokens."""
    ask = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, temperature=0)
    short = openai_client.chat.completions.create(**ask)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 40
    full = openai_client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 40 and full.choices[0].finish_reason == "length"
