"""MiniMax-M2's chat conventions end to end, through the official openai client against a real
server: SmolLM2 given a chat template written in MiniMax-M2's style (its `]~b]` turns, tools
listed in `<tools>`, calls as `<minimax:tool_call><invoke name=...><parameter name=...>`, a think
block opened in every generation prompt and past reasoning kept after the last user turn). The
model is tiny and says nothing sensible; what is checked is how its text is taken apart."""
from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with

# After MiniMax-M2's chat_template.jinja (not downloaded: no hub access in tests).
MINIMAX_TEMPLATE = """\
{%- set toolcall_begin_token = '<minimax:tool_call>' -%}
{%- set toolcall_end_token = '</minimax:tool_call>' -%}
{%- set ns = namespace(last_user_index=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user_index = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- ']~!b[]~b]system\\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- else -%}You are a helpful assistant.{%- endif -%}
{%- if tools -%}
{{- '\\n\\n# Tools\\nYou may call one or more tools to assist with the user query.\\n'
    'Here are the tools available in JSONSchema format:\\n\\n<tools>\\n' -}}
{%- for tool in tools -%}{{- '<tool>' ~ (tool.function | tojson) ~ '</tool>\\n' -}}{%- endfor -%}
{{- '</tools>\\n\\nWhen making tool calls, use XML format to invoke tools and pass parameters:\\n\\n'
    ~ toolcall_begin_token ~ '\\n<invoke name="tool-name-1">\\n<parameter name="param-key-1">param-value-1</parameter>\\n'
    '</invoke>\\n' ~ toolcall_end_token -}}
{%- endif -%}
{{- '[e~[\\n' -}}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{{- ']~b]user\\n' ~ m.content ~ '[e~[\\n' -}}
{%- elif m.role == 'assistant' -%}
{{- ']~b]ai\\n' -}}
{%- set content = m.content or '' -%}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if not reasoning and '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
{%- set content = content.split('</think>')[-1].strip('\\n') -%}
{%- endif -%}
{%- if reasoning and loop.index0 > ns.last_user_index -%}{{- '<think>\\n' ~ reasoning ~ '\\n</think>\\n\\n' -}}{%- endif -%}
{{- content -}}
{%- if m.tool_calls -%}
{{- '\\n' ~ toolcall_begin_token ~ '\\n' -}}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function else tc -%}
{{- '<invoke name="' ~ f.name ~ '">\\n' -}}
{%- for k, v in f.arguments.items() -%}
{{- '<parameter name="' ~ k ~ '">' ~ (v if v is string else (v | tojson)) ~ '</parameter>\\n' -}}
{%- endfor -%}
{{- '</invoke>\\n' -}}
{%- endfor -%}
{{- toolcall_end_token -}}
{%- endif -%}
{{- '[e~[\\n' -}}
{%- elif m.role == 'tool' -%}
{{- ']~b]tool\\n<response>' ~ m.content ~ '</response>[e~[\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai\\n<think>\\n' -}}{%- endif -%}
"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer"}},
           "required": ["city", "unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Values the grammar closes by itself (an enum, an integer): raw-text values end only where the
# model writes </parameter>, which a tiny model may never do.
COUNT_TOOLS = [*TOOLS, {"type": "function", "function": {
    "name": "count", "parameters": {"type": "object", "properties": {
        "unit": {"type": "string", "enum": ["days", "weeks"]}, "n": {"type": "integer"}},
        "required": ["unit", "n"]}}}]
COUNT = {"type": "function", "function": {"name": "count"}}


def serve_with_template(start_server, smollm2_container, tmp_path_factory, template: str, name: str):
    """SmolLM2's container files linked, `template` as its chat template."""
    d = tmp_path_factory.mktemp(name) / "model"
    d.mkdir()
    for f in smollm2_container.iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(template)
    return start_server("--max-tokens", "160", model_dir=d)


@pytest.fixture(scope="module")
def minimax_srv(start_server, smollm2_container, tmp_path_factory):
    return serve_with_template(start_server, smollm2_container, tmp_path_factory, MINIMAX_TEMPLATE, "minimax")


@pytest.fixture(scope="module")
def client(minimax_srv):
    return openai.OpenAI(base_url=minimax_srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages=ASK, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL_ID, messages=messages, **kw)


def test_the_opened_think_block_is_reasoning_streamed_or_not(client):
    """The generation prompt ends inside `<think>`: what the model writes is reasoning until it
    writes `</think>` (the tiny model does not, in 8 tokens), and no tag reaches the content."""
    whole = chat(client).choices[0].message
    assert whole.reasoning_content and not whole.content
    deltas = [c.choices[0].delta for c in chat(client, stream=True)]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert not "".join(d.content or "" for d in deltas)


def test_a_forced_call_is_parsed_after_the_reasoning(client, minimax_srv):
    """tool_choice names the tool: the grammar lets the model finish its reasoning, then write
    only the call in MiniMax's syntax, whose parameters the parser reads back as typed JSON.
    The tiny model would think for ever: a logit bias on the pieces of `</think>` makes it stop
    at once (and end each JSON value at its first digit, where `</parameter>` may follow)."""
    with httpx.Client(base_url=minimax_srv.url, timeout=60) as c:
        close = c.post("/tokenize", json={"model": MODEL_ID, "prompt": "</think>",
                                          "add_special_tokens": False}).json()["tokens"]
    kw = dict(tools=COUNT_TOOLS, tool_choice=COUNT, parallel_tool_calls=False, max_tokens=120,
              logit_bias={str(t): 100 for t in close})
    choice = chat(client, **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.function.name == "count" and set(args) == {"unit", "n"}
    assert args["unit"] in ("days", "weeks") and isinstance(args["n"], int)
    streamed = {"name": None, "arguments": ""}
    for chunk in chat(client, **kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            streamed["name"] = tc.function.name or streamed["name"]
            streamed["arguments"] += tc.function.arguments or ""
    assert streamed == {"name": "count", "arguments": call.function.arguments}


def test_past_reasoning_and_calls_are_rendered_in_minimax_syntax(minimax_srv):
    """Interleaved thinking: an assistant turn after the last user message keeps its reasoning
    in the prompt, and its call and the tool's answer are written the way the model writes them."""
    turn = {"role": "assistant", "content": "", "reasoning_content": "Paris is in France; ask the tool.",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather",
                                         "arguments": json.dumps({"city": "Paris", "days": 2})}}]}
    messages = [*ASK, turn, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"}]
    with httpx.Client(base_url=minimax_srv.url, timeout=60) as c:
        ids = c.post("/tokenize", json={"model": MODEL_ID, "messages": messages}).json()["tokens"]
        text = c.post("/detokenize", json={"model": MODEL_ID, "tokens": ids}).json()["prompt"]
    assert "<think>\nParis is in France; ask the tool.\n</think>" in text
    assert ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>') in text
    assert text.endswith("<response>Sunny, 21 degrees</response>[e~[\n]~b]ai\n<think>\n")
