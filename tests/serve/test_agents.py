"""What agents and applications need, through the official clients against a real server: tool
calls (OpenAI and Anthropic shapes, streamed and not, full round trips), structured output under
a grammar, the Responses API, n > 1, logit_bias, prompt scoring with echo, model aliases.

SmolLM2-135M rarely chooses to call a tool by itself, so calls are forced with tool_choice
required / a named function: the grammar then makes the call well-formed in the model's own
syntax, and its arguments valid against the tool's schema, whatever the model would have said.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

MODEL_ID = "smollm2"

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object",
                                                          "properties": {"a": {"type": "integer"},
                                                                         "b": {"type": "integer"}},
                                                          "required": ["a", "b"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def chat(client, messages=ASK, **kw):
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **kw)


# ---------------------------------------------------------------------------------- OpenAI tools
def test_a_named_tool_call_is_well_formed_and_valid(openai_client):
    r = chat(openai_client, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert r.usage.completion_tokens > 0


def test_required_picks_one_of_the_tools_and_a_round_trip_completes(openai_client):
    r = chat(openai_client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "add")
    schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # the result goes back as a tool message; the model answers in text
    messages = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"}]
    r2 = chat(openai_client, messages, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content
    assert r2.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_add_up_to_the_same_call(openai_client):
    kw = dict(tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False)
    whole = chat(openai_client, **kw).choices[0].message.tool_calls[0]
    chunks = list(chat(openai_client, **kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict] = {}
    finish = None
    for c in chunks:
        ch = c.choices[0]
        finish = ch.finish_reason or finish
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == whole.function.arguments


def test_tool_call_problems_are_400s_naming_the_field(openai_client):
    def bad(param, **kw):
        with pytest.raises(openai.BadRequestError) as e:
            chat(openai_client, **kw)
        assert e.value.body["param"] == param, e.value.body
    bad("tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    bad("tools[0].function.parameters",
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}])
    bad("messages[1].tool_call_id", messages=[*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "?"}])
    bad("tool_choice", tool_choice="required")


# ---------------------------------------------------------------------------------- structured output
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                                      "where": {"type": "object", "properties": {"city": {"type": "string",
                                                                                         "maxLength": 10}},
                                                "required": ["city"], "additionalProperties": False}},
     "required": ["answer", "where"], "additionalProperties": False},
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "enum-array", "anyof-nested"])
def test_json_schema_output_always_validates(openai_client, schema, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
    r = chat(openai_client, [{"role": "user", "content": "Describe Paris as JSON."}], response_format=fmt,
             temperature=temperature, seed=7, max_tokens=64)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_output_parses(openai_client):
    r = chat(openai_client, [{"role": "user", "content": "Give me a JSON object about cats."}],
             response_format={"type": "json_object"}, max_tokens=64)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the model may ramble inside a string until the budget ends: still a JSON prefix
        assert r.choices[0].message.content.lstrip().startswith("{")


# ---------------------------------------------------------------------------------- Anthropic tools
A_TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]


def test_anthropic_tool_use_round_trip(anthropic_client):
    m = anthropic_client.messages.create(model=MODEL_ID, max_tokens=48, messages=ASK, tools=A_TOOLS,
                                         extra_body={"temperature": 0},
                                         tool_choice={"type": "tool", "name": "get_weather",
                                                      "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    use = next(b for b in m.content if b.type == "tool_use")
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER)
    follow = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny",
                                            "is_error": False}]}]
    m2 = anthropic_client.messages.create(model=MODEL_ID, max_tokens=8, messages=follow, tools=A_TOOLS)
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL_ID, max_tokens=8, tools=A_TOOLS, messages=[
            *ASK, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}])
    assert "tool_use_id" in e.value.body["error"]["message"]


def test_anthropic_streamed_tool_use_matches(anthropic_client):
    kw = dict(model=MODEL_ID, max_tokens=48, messages=ASK, tools=A_TOOLS, extra_body={"temperature": 0},
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    whole = anthropic_client.messages.create(**kw)
    with anthropic_client.messages.stream(**kw) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert "content_block_start" in kinds and "input_json" in kinds
    assert final.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]


# ---------------------------------------------------------------------------------- Responses API
def test_responses_text_and_a_stored_follow_up(openai_client):
    r = openai_client.responses.create(model=MODEL_ID, input="What is the capital of France?",
                                       max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message"
    again = openai_client.responses.retrieve(r.id)
    assert again.output_text == r.output_text
    r2 = openai_client.responses.create(model=MODEL_ID, input="And of Italy?", previous_response_id=r.id,
                                        max_output_tokens=4, temperature=0)
    assert r2.previous_response_id == r.id and r2.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model=MODEL_ID, input="x", previous_response_id="resp_missing")


def test_responses_function_call_round_trip_streamed(openai_client):
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER}]
    kw = dict(model=MODEL_ID, input="Weather in Paris?", tools=tools, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=48, temperature=0)
    r = openai_client.responses.create(**kw)
    call = next(o for o in r.output if o.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with openai_client.responses.stream(**kw) as stream:
        kinds = {ev.type for ev in stream}
        final = stream.get_final_response()
    assert {"response.created", "response.function_call_arguments.delta", "response.completed"} <= kinds
    streamed = next(o for o in final.output if o.type == "function_call")
    assert streamed.arguments == call.arguments and streamed.name == "get_weather"
    r2 = openai_client.responses.create(model=MODEL_ID, previous_response_id=r.id, max_output_tokens=6,
                                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                                "output": "Sunny"}], tools=tools, temperature=0)
    assert r2.output_text


def test_responses_json_schema_format(openai_client):
    schema = SCHEMAS[0]
    r = openai_client.responses.create(model=MODEL_ID, input="A person as JSON.", max_output_tokens=64,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                        "strict": True}}, temperature=0)
    jsonschema.validate(json.loads(r.output_text), schema)


# ---------------------------------------------------------------------------------- sampling surface
def test_n_choices_share_the_prompt_and_differ_by_seed(openai_client):
    r = chat(openai_client, n=3, temperature=1.0, seed=11, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1
    first = chat(openai_client, temperature=1.0, seed=11, max_tokens=8)
    assert first.choices[0].message.content == r.choices[0].message.content
    stream = chat(openai_client, n=2, temperature=1.0, seed=11, max_tokens=8, stream=True)
    texts = {0: "", 1: ""}
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert [texts[0], texts[1]] == [r.choices[0].message.content, r.choices[1].message.content]


def test_logit_bias_forces_a_token(openai_client, tokenizer):
    tok = tokenizer.encode(" banana", add_special_tokens=False)[0]
    r = chat(openai_client, logit_bias={str(tok): 100}, max_tokens=3)
    assert r.choices[0].message.content == tokenizer.decode([tok] * 3)


def test_echo_scores_the_prompt(openai_client, smollm2_container, tokenizer):
    from colibri.engine import Engine

    prompt = "The capital of France is Paris."
    r = openai_client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert r.choices[0].text == prompt and lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(ids) and lp.text_offset[0] == 0
    logits = Engine.load(smollm2_container).logits(ids).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(lp.token_logprobs[1:], [ref[i, ids[i + 1]] for i in range(len(ids) - 1)], atol=1e-3)
    gen = openai_client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                           temperature=0)
    assert gen.choices[0].text.startswith(prompt) and len(gen.choices[0].logprobs.tokens) == len(ids) + 3


def test_a_served_model_alias_is_accepted(start_server):
    srv = start_server("--served-model-name", "gpt-4o-mini", "--max-tokens", "4")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=2)
    assert r.model == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=ASK, max_tokens=2)
    srv.stop()


def test_vllm_guided_extensions(openai_client):
    r = chat(openai_client, extra_body={"guided_choice": ["yes", "no", "maybe"]}, max_tokens=4)
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = openai_client.completions.create(model=MODEL_ID, prompt="The year is", max_tokens=8, temperature=0,
                                         extra_body={"guided_regex": r" [0-9]{4}\."})
    assert r.choices[0].text[1:5].isdigit() and r.choices[0].text.endswith(".")
    r = chat(openai_client, extra_body={"guided_json": SCHEMAS[0]}, max_tokens=64)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0])
    with pytest.raises(openai.BadRequestError) as e:
        chat(openai_client, extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert e.value.body["param"] == "guided_choice"
