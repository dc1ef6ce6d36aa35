"""Bad input: every malformed request gets a 4xx in its API's envelope (naming the field where
there is one), and the server keeps serving; then a hypothesis fuzz run finds no 5xx."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with
MSG = [{"role": "user", "content": "Hi"}]
CHAT = {"model": MODEL_ID, "messages": MSG, "max_tokens": 1, "temperature": 0}
COMPLETION = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
MESSAGES = {"model": MODEL_ID, "messages": MSG, "max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def srv(start_server):
    """Generation capped at 2 tokens, a 256-token context, 2 KV slots."""
    return start_server("--max-tokens", "2", "--max-context", "256", "--kv-slots", "2")


@pytest.fixture(scope="module")
def http(srv):
    with srv.client() as c:
        c.headers["content-type"] = "application/json"  # for the raw bodies sent as content=
        yield c


def _openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


RAW_BODIES = [b"", b"{not json", b"[1, 2]", b"42", b'"text"', b"null", b'{"model": "\xff\xfe"}',
              b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
              b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
              b"[" * 5000 + b"]" * 5000]


@pytest.mark.parametrize("body", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize"])
def test_bodies_that_are_not_a_json_object(http, path, body):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"


WRONG_TYPES = {
    "model": 1, "messages": "hi", "max_tokens": "5", "max_completion_tokens": 2.5, "temperature": "0.5",
    "top_p": True, "top_k": 1.5, "seed": "1", "stop": 5, "stream": "yes", "stream_options": True,
    "logprobs": "true", "top_logprobs": "3", "n": "1", "enable_thinking": "no", "reasoning_effort": 3,
    "cache_slot": "0", "user": 1, "metadata": [], "tools": "x", "response_format": "json",
    "frequency_penalty": "0", "presence_penalty": [], "logit_bias": 3, "store": "no", "seed ": 1,
}


@pytest.mark.parametrize("field,value", WRONG_TYPES.items(), ids=list(WRONG_TYPES))
def test_wrong_type_for_every_chat_field(http, field, value):
    _openai_error(http.post("/v1/chat/completions", json={**CHAT, field: value}), 400, param=field)


COMPLETION_WRONG = {"prompt": 5, "max_tokens": "2", "logprobs": True, "echo": "no", "suffix": 3, "best_of": "2",
                    "stop": [1], "seed": 1.5}


@pytest.mark.parametrize("field,value", COMPLETION_WRONG.items(), ids=list(COMPLETION_WRONG))
def test_wrong_type_for_completion_fields(http, field, value):
    _openai_error(http.post("/v1/completions", json={**COMPLETION, field: value}), 400, param=field)


ANTHROPIC_WRONG = {"max_tokens": "5", "messages": [{"role": "user", "content": 5}], "system": 5,
                   "stop_sequences": "x", "temperature": 1.5, "top_k": -1, "stream": 1, "thinking": "on",
                   "metadata": "x"}


@pytest.mark.parametrize("field,value", ANTHROPIC_WRONG.items(), ids=list(ANTHROPIC_WRONG))
def test_wrong_type_for_messages_fields(http, field, value):
    r = http.post("/v1/messages", json={**MESSAGES, field: value})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]


CHAT_BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bob", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
     "messages[0].content[0].type"),
    ({"temperature": -1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -5}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"cache_slot": 2}, "cache_slot"), ({"cache_slot": -1}, "cache_slot"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"x": 5}}, "logit_bias.x"), ({"logit_bias": {"1": 500}}, "logit_bias.1"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "x"}}, "audio"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"enable_thinking": True}, "enable_thinking"),
    ({"max_tokens": 3}, "max_tokens"), ({"max_completion_tokens": 10 ** 12}, "max_completion_tokens"),
    ({"max_tokens": 1, "max_completion_tokens": 3}, "max_completion_tokens"),
    ({"seed": 2 ** 70}, "seed"), ({"seed": 2 ** 64}, "seed"), ({"seed": -1}, "seed"),
]


@pytest.mark.parametrize("patch,param", CHAT_BAD, ids=[p for _, p in CHAT_BAD])
def test_out_of_range_and_unsupported_chat_fields(http, patch, param):
    _openai_error(http.post("/v1/chat/completions", json={**CHAT, **patch}), 400, param=param)


def test_unknown_model(http):
    err = _openai_error(http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}), 404, param="model")
    assert err["code"] == "model_not_found"
    r = http.post("/v1/messages", json={**MESSAGES, "model": "claude"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_prompt_longer_than_the_context(http):
    long = [{"role": "user", "content": "word " * 400}]
    err = _openai_error(http.post("/v1/chat/completions", json={**CHAT, "messages": long}), 400, param="messages")
    assert err["code"] == "context_length_exceeded"
    err = _openai_error(http.post("/v1/completions", json={**COMPLETION, "prompt": "word " * 400}), 400,
                        param="prompt")
    assert err["code"] == "context_length_exceeded"
    err = _openai_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [1] * 300}), 400, param="prompt")
    assert err["code"] == "context_length_exceeded"
    r = http.post("/v1/messages", json={**MESSAGES, "messages": long})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


def test_lone_surrogates(http):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}).encode()
    assert b"\\ud800" in body
    _openai_error(http.post("/v1/chat/completions", content=body), 400, param="messages[0].content")
    body = json.dumps({**MESSAGES, "system": "\udfff"}).encode()
    assert http.post("/v1/messages", content=body).status_code == 400


def test_oversize_body(http):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}).encode()
    _openai_error(http.post("/v1/chat/completions", content=big), 413)
    r = http.post("/v1/messages", content=big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


def test_max_tokens_above_the_servers_cap_is_a_400_naming_the_field(http):
    """Never clamped silently: OpenAI and Anthropic refuse more than a model's output limit too."""
    err = _openai_error(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10 ** 12}), 400,
                        param="max_tokens")
    assert err["code"] == "max_tokens_too_large" and "at most 2" in err["message"]
    _openai_error(http.post("/v1/completions", json={**COMPLETION, "max_tokens": 3}), 400, param="max_tokens")
    r = http.post("/v1/messages", json={**MESSAGES, "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "'max_tokens'" in r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})  # the cap itself is fine
    assert r.status_code == 200 and "x-colibri-adjusted" not in r.headers
    r = http.post("/v1/completions", json={k: v for k, v in COMPLETION.items() if k != "max_tokens"})
    assert r.status_code == 200  # OpenAI's default of 16 is a default: it yields to the cap of 2


def test_seeds_cover_64_bits_and_no_more(http):
    for seed in (0, 2 ** 63, 2 ** 64 - 1):
        r = http.post("/v1/completions", json={**COMPLETION, "seed": seed, "temperature": 1})
        assert r.status_code == 200, r.text
    _openai_error(http.post("/v1/completions", json={**COMPLETION, "seed": 2 ** 70}), 400, param="seed")
    r = http.post("/v1/messages", json={**MESSAGES, "seed": -5})
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]


def test_the_context_end_shortens_an_ask_visibly(http):
    """A 255-token prompt in a 256-token context has room for 1 token: an ask for 2 ends there
    with finish_reason "length", and the response header says what was done."""
    r = http.post("/v1/completions", json={**COMPLETION, "prompt": [1] * 255, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-colibri-adjusted"] == "max_tokens=1; reason=context_end"
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 255 and body["usage"]["completion_tokens"] <= 1
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    with http.stream("POST", "/v1/completions", json={**COMPLETION, "prompt": [1] * 255, "max_tokens": 2,
                                                        "stream": True}) as s:
        assert s.headers["x-colibri-adjusted"] == "max_tokens=1; reason=context_end"
        s.read()


def test_bad_token_ids(http):
    _openai_error(http.post("/v1/completions", json={**COMPLETION, "prompt": [1, 10 ** 9]}), 400)
    _openai_error(http.post("/v1/completions", json={**COMPLETION, "prompt": []}), 400, param="prompt")
    _openai_error(http.post("/v1/completions", json={**COMPLETION, "prompt": ["a", "b"]}), 400, param="prompt")


def _nested_object_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_nested_too_deep_is_a_400_and_the_connection_stays_up(srv, http):
    deep = _nested_object_schema(200)  # the checker's recursion used to end it: a 500, then a reset
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "strict": True, "schema": deep}}
    with httpx.Client(base_url=srv.url, timeout=60, limits=httpx.Limits(max_connections=1)) as one_connection:
        r = one_connection.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
        err = _openai_error(r, 400, param="response_format.json_schema.schema")
        assert "more than 64 levels" in err["message"]
        tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
        r = one_connection.post("/v1/chat/completions", json={**CHAT, "tools": [tool]})
        _openai_error(r, 400, param="tools[0].function.parameters")
        r = one_connection.post("/v1/chat/completions", json=CHAT)  # the same connection, still good
        assert r.status_code == 200
    fine = {**fmt, "json_schema": {"name": "ok", "strict": True, "schema": _nested_object_schema(8)}}
    assert http.post("/v1/chat/completions", json={**CHAT, "response_format": fine}).status_code == 200


def test_thousands_of_tools_are_a_clean_400_naming_the_limit(http):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}}
             for i in range(3000)]
    r = http.post("/v1/chat/completions", json={**CHAT, "tools": tools, "tool_choice": "required"})
    err = _openai_error(r, 400, param="tools")
    assert "3000 tools; at most 128" in err["message"] and "panic" not in err["message"]
    r = http.post("/v1/messages", json={**MESSAGES, "tools": [{"name": f"t{i}", "input_schema": {"type": "object"}}
                                                                for i in range(129)]})
    assert r.status_code == 400 and "at most 128" in r.json()["error"]["message"]


def test_a_regex_that_spells_out_a_million_characters_is_refused_up_front(http):
    pattern = "^(a{1000}){1000}$"
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": schema}}
    t = time.monotonic()
    r = http.post("/v1/chat/completions", json={**CHAT, "response_format": fmt})
    err = _openai_error(r, 400, param="response_format.json_schema.schema.properties.code.pattern")
    assert "1000000 characters" in err["message"] and time.monotonic() - t < 1.0
    err = _openai_error(http.post("/v1/completions", json={**COMPLETION, "guided_regex": pattern}), 400,
                        param="guided_regex")
    # patterns of ordinary size still constrain
    r = http.post("/v1/completions", json={**COMPLETION, "guided_regex": "[a-z]{1,5}( [a-z]{1,5}){0,3}"})
    assert r.status_code == 200, r.text


def test_a_stop_string_is_bounded(http):
    err = _openai_error(http.post("/v1/chat/completions", json={**CHAT, "stop": "x" * 1_000_000}), 400, param="stop")
    assert "1000000 characters long; a stop string has at most 1024" in err["message"]
    _openai_error(http.post("/v1/completions", json={**COMPLETION, "stop": ["\n", "y" * 2000]}), 400, param="stop[1]")
    r = http.post("/v1/messages", json={**MESSAGES, "stop_sequences": ["z" * 1025]})
    assert r.status_code == 400 and "stop_sequences[0]" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json={**CHAT, "stop": ["x" * 1024]}).status_code == 200


TOOL_TURNS = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def test_tokenize_counts_a_conversation_with_tool_calls_as_the_chat_route_does(http):
    for extra in ({}, {"tools": WEATHER}):
        r = http.post("/v1/chat/completions", json={**CHAT, "messages": TOOL_TURNS, **extra})
        assert r.status_code == 200, r.text
        counted = http.post("/tokenize", json={"model": MODEL_ID, "messages": TOOL_TURNS, **extra}).json()["count"]
        assert counted == r.json()["usage"]["prompt_tokens"], extra


def test_still_serving_after_all_that(http, srv):
    assert srv.health()["status"] == "ok"
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


# ------------------------------------------------------------------ fuzz
leaf = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12) | st.sampled_from(["\ud800", "user", "assistant", "system", "text", MODEL_ID]))
json_value = st.recursive(
    leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3), max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | json_value},
                                optional={"content": st.text(max_size=20) | json_value,
                                          "name": json_value})
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "n", "cache_slot", "system",
          "stop_sequences", "thinking", "tokens", "tools", "enable_thinking", "response_format", "echo"]
request_body = st.fixed_dictionaries(
    {"model": st.just(MODEL_ID) | json_value},
    optional={**{f: json_value for f in FIELDS if f != "model"},
              "messages": st.lists(message, max_size=3) | json_value,
              "max_tokens": st.integers(-2, 3) | json_value, "stream": st.booleans()})
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
         "/detokenize", "/v1/responses"]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), body=request_body)
def test_fuzz_finds_no_server_error(http, path, body):
    raw = json.dumps(body, ensure_ascii=True).encode()
    try:
        r = http.post(path, content=raw)
    except httpx.HTTPError as e:  # pragma: no cover - a dropped connection is a failure too
        raise AssertionError(f"{path} {raw[:300]!r}: {e}")
    assert r.status_code < 500, f"{path} {raw[:300]!r} -> {r.status_code} {r.text[:300]}"
    assert "x-request-id" in r.headers
