"""/v1/messages driven by the official `anthropic` client: answers, the streaming event order,
stop sequences, token counting, prefill, and errors in Anthropic's envelope."""
from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


def create(client, messages=ASK, **kw):
    kw.setdefault("max_tokens", 6)
    return client.messages.create(model=MODEL_ID, messages=messages, extra_body={**GREEDY, **kw.pop("extra", {})}, **kw)


def test_message_answer_and_usage(anthropic_client, tokenizer, openai_client):
    m = create(anthropic_client, system="Answer briefly.")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_ID
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    prompt = tokenizer.encode_chat([{"role": "system", "content": "Answer briefly."}, *ASK])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)
    # the same request through the OpenAI route gives the same tokens
    o = openai_client.chat.completions.create(model=MODEL_ID, max_tokens=6, temperature=0,
                                              messages=[{"role": "system", "content": "Answer briefly."}, *ASK])
    assert o.choices[0].message.content == m.content[0].text


def test_streaming_event_order(anthropic_client, server):
    with server.client() as c, c.stream("POST", "/v1/messages", json={
            "model": MODEL_ID, "max_tokens": 5, "messages": ASK, "stream": True, **GREEDY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events, data = [], []
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            elif line.startswith("data: "):
                data.append(json.loads(line[6:]))
    assert [d["type"] for d in data] == events
    deltas = events.count("content_block_delta")
    assert events == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                      "content_block_stop", "message_delta", "message_stop"]
    assert data[-2]["delta"]["stop_reason"] == "max_tokens" and data[-2]["usage"]["output_tokens"] == 5
    streamed = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    with anthropic_client.messages.stream(model=MODEL_ID, max_tokens=5, messages=ASK, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == streamed == final.content[0].text
    assert final.stop_reason == "max_tokens"


def test_stop_sequence_is_reported_and_not_leaked(anthropic_client):
    full = create(anthropic_client, max_tokens=12).content[0].text
    word = full.split()[2]
    m = create(anthropic_client, max_tokens=12, stop_sequences=[word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text and full.startswith(m.content[0].text)
    with anthropic_client.messages.stream(model=MODEL_ID, max_tokens=12, messages=ASK, stop_sequences=[word],
                                          extra_body=GREEDY) as s:
        assert "".join(s.text_stream) == m.content[0].text
        assert s.get_final_message().stop_sequence == word


def test_count_tokens_and_prefill(anthropic_client, tokenizer):
    n = anthropic_client.messages.count_tokens(model=MODEL_ID, messages=ASK)
    assert n.input_tokens == len(tokenizer.encode_chat(ASK))
    # a trailing assistant message is the start of the answer: the model continues it
    m = create(anthropic_client, [*ASK, {"role": "assistant", "content": "The capital of France is"}], max_tokens=3)
    assert "Paris" in m.content[0].text


def test_errors_use_anthropics_envelope(anthropic_client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        create(anthropic_client, tools=[{"name": "x", "input_schema": {"type": "object", "required": "a"}}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "tools[0].input_schema" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(anthropic_client, [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        create(anthropic_client, thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model="claude-x", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    with server.client() as c:
        r = c.post("/v1/messages", json={"model": MODEL_ID, "messages": ASK})
        assert r.status_code == 400 and r.json()["error"]["message"] == "'max_tokens' is required"
