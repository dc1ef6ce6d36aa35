"""Tool calls in each model family's syntax: the streaming parser (every case fed whole, split at
every point, and one character at a time, must give the same calls and text) and the llguidance
grammar that forces valid calls (walked byte by byte through a matcher over a byte tokenizer)."""
from __future__ import annotations

import json
import random
import re

import pytest

from colibri.default_model import CONTAINER_NAME, cache_root
from colibri.serve.tool_calls import (ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END, DS_CALL, DS_CALL_END,
                                      DS_CALLS, DS_CALLS_END, DS_SEP, FORMATS, KIMI_ARGS, KIMI_CALL, KIMI_CALL_END,
                                      KIMI_CALLS, KIMI_CALLS_END, MM_CALLS, MM_CALLS_END, MM_INVOKE, MM_INVOKE_END,
                                      MM_PARAM, MM_PARAM_END, TOOL_CALL, TOOL_CALL_END, ArgsDelta, CallEnd,
                                      CallStart, TextDelta, ToolCallParser, call_grammar, detect_format)
from colibri.serve.harmony import CALL, CALL_PREFIX, CHANNEL, CONSTRAIN, MESSAGE
from requirements import missing

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "object", "properties": {
                "text": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["text"]},
            "code": {"type": "string"}},
            "required": ["query"]}}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters at all
]

PARIS = {"city": "Paris"}
# nested objects, unicode, escaped quotes, brackets and every format's closing markers inside strings
NESTED = {"query": {"text": 'He said "hi" {not a brace} ]] ünïcødé 日本 🚀 \\ </tool_call> </arg_value> '
                            "<|tool_call_end|> <｜tool▁call▁end｜> ```", "tags": ["a", "b"]}}

# ---------------------------------------------------------------- recorded outputs, per format

# (format, model output, expected content text, expected calls as (name, arguments object[, id]))
CASES = [
    # hermes (Qwen2.5/Qwen3): vLLM's test_hermes_tool_parser and Qwen's template
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "Let me check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": PARIS})
     + "\n</tool_call>\nDone.", "Let me check.\n\nDone.", [("get_weather", PARIS)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Dallas", "unit": "fahrenheit"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Orlando"}}\n</tool_call>',
     "", [("get_weather", {"city": "Dallas", "unit": "fahrenheit"}), ("get_weather", {"city": "Orlando"})]),
    ("hermes", "<tool_call>" + json.dumps({"name": "search", "arguments": NESTED}, ensure_ascii=False)
     + "</tool_call>", "", [("search", NESTED)]),
    ("hermes", '<tool_call>{"name":"get_time"}</tool_call>', "", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_time", "parameters": "{}"}\n</tool_call>', "", [("get_time", {})]),
    ("hermes", 'Use <tool_call> tags <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
     'Use <tool_call> tags <tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call> and <tool_call>\n{"name": "get_time"}\n</tool_call>',
     '<tool_call>\n{"arguments": {}}\n</tool_call> and ', [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("hermes", "a < b <tool", "a < b <tool", []),

    # llama3_json (Llama 3.1-3.3): vLLM's test_llama3_json_tool_parser
    ("llama3_json", "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}', "",
     [("get_weather", PARIS)]),
    ("llama3_json", '\n {"name": "search", "parameters": ' + json.dumps(NESTED) + '}; {"name": "get_time", '
     '"parameters": {}} Would you like more?', " Would you like more?", [("search", NESTED), ("get_time", {})]),
    ("llama3_json", 'Here is the result: {"name": "get_time", "parameters": {}}',
     'Here is the result: {"name": "get_time", "parameters": {}}', []),  # a call only opens a message
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris",}}',
     '{"name": "get_weather", "parameters": {"city": "Paris",}}', []),
    ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Pa',
     '; {"name": "get_weather", "parameters": {"city": "Pa', [("get_time", {})]),
    ("llama3_json", "<|python_tag|>brave_search.call(query=\"x\")", "<|python_tag|>brave_search.call(query=\"x\")", []),
    ("llama3_json", "<|python", "<|python", []),

    # deepseek_v3: vLLM's deepseekv3 parser docstring (V3/R1) and deepseekv31 (V3.1)
    ("deepseek_v3", "Bonjour.", "Bonjour.", []),
    ("deepseek_v3", "Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
     '```json\n{"city": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
     'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>Sent.',
     "Checking both.Sent.", [("get_weather", {"city": "Beijing"}), ("get_weather", PARIS)]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n"
     + json.dumps(NESTED, ensure_ascii=False) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("search", NESTED)]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>"
     + json.dumps(NESTED, ensure_ascii=False) + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("search", NESTED), ("get_time", {})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": Paris}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": Paris}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", []),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
     "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa",
     "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Pa", [("get_time", {})]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>x", "<｜tool▁calls▁begin｜><｜tool▁calls▁end｜>x", []),

    # glm45 (GLM-4.5/4.6; GLM-4.7 drops the newlines): vLLM's glm4_moe parser, llama.cpp's tests
    ("glm45", "Sure, 2 + 2 = 4.", "Sure, 2 + 2 = 4.", []),
    ("glm45", "I will look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>get_weather<arg_key>city"
     "</arg_key><arg_value>123</arg_value><arg_key>note</arg_key><arg_value>5</arg_value></tool_call> ok",
     "I will look.\n ok", [("get_weather", {"city": "Paris", "days": 3}),
                             ("get_weather", {"city": "123", "note": 5})]),
    ("glm45", "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>" + json.dumps(NESTED["query"], ensure_ascii=False)
     + "</arg_value>\n<arg_key>code</arg_key>\n<arg_value>if (a) { print(\"</tool_call>\") }</arg_value>\n</tool_call>",
     "", [("search", {"query": NESTED["query"], "code": 'if (a) { print("</tool_call>") }'})]),
    ("glm45", "<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    ("glm45", "<tool_call>get weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
     "<tool_call>get weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>", []),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
     "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", []),

    # kimi_k2: vLLM's test_kimi_k2_tool_parser (blanks between the markers included)
    ("kimi_k2", "Hello there", "Hello there", []),
    ("kimi_k2", "I'll help you check the weather. <|tool_calls_section_begin|> <|tool_call_begin|> "
     "functions.get_weather:0 <|tool_call_argument_begin|> {\"city\": \"Beijing\"} <|tool_call_end|> "
     "<|tool_call_begin|> functions.get_weather:1 <|tool_call_argument_begin|> {\"city\": \"Shanghai\"} "
     "<|tool_call_end|> <|tool_calls_section_end|>", "I'll help you check the weather. ",
     [("get_weather", {"city": "Beijing"}, "functions.get_weather:0"),
      ("get_weather", {"city": "Shanghai"}, "functions.get_weather:1")]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.search:7<|tool_call_argument_begin|>"
     + json.dumps(NESTED, ensure_ascii=False) + "<|tool_call_end|><|tool_calls_section_end|>after",
     "after", [("search", NESTED, "functions.search:7")]),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_calls_section_end|>", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather"
     "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>", []),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     "{\"city\": \"Paris\"}", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
     "<|tool_call_argument_begin|>{\"city\": \"Paris\"}", []),

    # harmony (gpt-oss): calls as HarmonySplitter spells them, and as the model writes them
    ("harmony", "It is sunny.", "It is sunny.", []),
    ("harmony", "Checking." + CALL_PREFIX + "get_weather" + MESSAGE + json.dumps(PARIS) + CALL, "Checking.",
     [("get_weather", PARIS)]),
    ("harmony", CALL_PREFIX + "search <|constrain|>json" + MESSAGE + json.dumps(NESTED, ensure_ascii=False) + CALL
     + CALL_PREFIX + "get_time" + MESSAGE + "{}" + CALL, "", [("search", NESTED), ("get_time", {})]),
    ("harmony", CALL_PREFIX + "get_weather" + MESSAGE + '{"city": Paris}' + CALL,
     CALL_PREFIX + "get_weather" + MESSAGE + '{"city": Paris}' + CALL, []),
    ("harmony", CALL_PREFIX + "get_weather" + MESSAGE + '{"city": "Pa',
     CALL_PREFIX + "get_weather" + MESSAGE + '{"city": "Pa', []),
    # minimax_m2: MiniMax-M2's chat template and vLLM's minimax_m2 parser (strings raw, the rest JSON)
    ("minimax_m2", "The weather is fine.", "The weather is fine.", []),
    ("minimax_m2", "Let me check.\n<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">"
     "Paris</parameter>\n<parameter name=\"days\">3</parameter>\n</invoke>\n<invoke name=\"get_weather\">"
     "<parameter name=\"city\">123</parameter><parameter name=\"note\">5</parameter></invoke>\n"
     "</minimax:tool_call>\nDone.", "Let me check.\n\nDone.",
     [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "123", "note": 5})]),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name=\"search\">\n<parameter name=\"query\">"
     + json.dumps({**NESTED["query"], "text": NESTED["query"]["text"] + " </parameter> </invoke>"}, ensure_ascii=False)
     + "</parameter>\n<parameter name=\"code\">if (a < b) { print(\"</invoke>\") }</parameter>\n</invoke>\n"
     "</minimax:tool_call>", "",
     [("search", {"query": {**NESTED["query"], "text": NESTED["query"]["text"] + " </parameter> </invoke>"},
                  "code": 'if (a < b) { print("</invoke>") }'})]),
    ("minimax_m2", "<minimax:tool_call><invoke name=\"get_time\"></invoke></minimax:tool_call>", "",
     [("get_time", {})]),
    ("minimax_m2", "<minimax:tool_call><invoke name=get_time></invoke></minimax:tool_call>",
     "<minimax:tool_call><invoke name=get_time></invoke></minimax:tool_call>", []),
    ("minimax_m2", "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Par",
     "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Par", []),
]


def run(fmt: str, pieces: list[str], tools=TOOLS):
    """Feed the pieces, check the event stream is coherent, return (text, calls)."""
    p = ToolCallParser(fmt, tools)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    text, started, args = "", {}, {}
    ended = []
    for e in events:
        if isinstance(e, TextDelta):
            assert e.text
            text += e.text
        elif isinstance(e, CallStart):
            assert e.index == len(started)
            started[e.index] = e
            args[e.index] = ""
        elif isinstance(e, ArgsDelta):
            assert e.index in started and e.index not in {c.index for c in ended}
            args[e.index] += e.fragment
        else:
            assert isinstance(e, CallEnd) and e.index in started
            assert e.call.arguments == args[e.index] and e.call.id == started[e.index].id
            assert e.call.name == started[e.index].name
            ended.append(e)
    assert len(ended) == len(started)
    assert text == p.text and [e.call for e in ended] == p.calls
    for c in p.calls:
        assert c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False)
        if fmt != "kimi_k2":
            assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
    return text, [(c.name, json.loads(c.arguments), c.id) for c in p.calls]


def _expected(calls):
    return [(c[0], c[1], c[2] if len(c) > 2 else None) for c in calls]


def _comparable(result):
    text, calls = result
    return text, [(n, a, i if not i.startswith("call_") else None) for n, a, i in calls]


@pytest.mark.parametrize("fmt,output,text,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_split_and_char_by_char(fmt, output, text, calls):
    whole = _comparable(run(fmt, [output]))
    assert whole == (text, _expected(calls))
    for s in range(len(output) + 1):
        assert _comparable(run(fmt, [output[:s], output[s:]])) == whole, f"split at {s}"
    assert _comparable(run(fmt, list(output))) == whole


# pieces of each format, shuffled into outputs no model writes: truncated markers, stray quotes,
# backslashes and brackets, calls cut anywhere
SHARDS = {
    "hermes": [TOOL_CALL, TOOL_CALL_END, "<tool", '{"name": "get_time", "arguments": {}}', '{"name": "f"', "{", "}",
               '"', "\\", "\n", " ", "a", "</", "<"],
    "llama3_json": ["<|python_tag|>", '{"name": "get_time", "parameters": {}}', ";", " ", "\n", "{", "}", '"', "\\",
                    "x", "<|py"],
    "deepseek_v3": [DS_CALLS, DS_CALLS_END, DS_CALL, DS_SEP, DS_CALL_END, "function", "get_time", "\n", "```json",
                    "```", "{}", '{"a": "', "}", '"', " ", "x", "<｜tool"],
    "glm45": [TOOL_CALL, TOOL_CALL_END, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END, "get_weather", "city", "days",
              "3", '{"a": "', '"}', "[", "]", "\n", " ", "x", "<arg"],
    "kimi_k2": [KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END, "functions.get_time:0", "{}",
                '{"a": "', "}", '"', " ", "x", "<|tool"],
    "harmony": [CALL_PREFIX, CHANNEL, MESSAGE, CONSTRAIN, CALL, "get_time", "json", "{}", '{"a": "', "}", '"', " ",
                "x", "<|"],
    "minimax_m2": [MM_CALLS, MM_CALLS_END, MM_INVOKE, MM_INVOKE_END, MM_PARAM, MM_PARAM_END, '"get_time">',
                   '"city">', '"', ">", "3", '{"a": "', "}", "\n", " ", "x", "<invoke", "</"],
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_outputs_never_raise_lose_text_or_depend_on_the_split(fmt):
    rng = random.Random(fmt)
    for _ in range(150):
        output = "".join(rng.choice(SHARDS[fmt]) for _ in range(rng.randint(1, 14)))
        whole = _comparable(run(fmt, [output]))
        if not whole[1]:
            assert whole[0] == output
        for s in range(len(output) + 1):
            assert _comparable(run(fmt, [output[:s], output[s:]])) == whole, (output, s)
        assert _comparable(run(fmt, list(output))) == whole


def test_every_format_has_cases():
    assert {c[0] for c in CASES} == set(FORMATS)


def test_holds_back_only_what_could_open_a_call():
    p = ToolCallParser("hermes")
    assert p.feed("Hello <tool") == [TextDelta("Hello ")]
    assert p.feed("s are nice") == [TextDelta("<tools are nice")]
    assert p.feed(" <tool_call>\n{\"name\": \"get_time\"") == [TextDelta(" ")]
    events = p.feed("}\n</tool_call>")
    assert [type(e) for e in events] == [CallStart, ArgsDelta, CallEnd] and events[1].fragment == "{}"
    assert p.finish() == []
    d = ToolCallParser("deepseek_v3")
    assert d.feed("x <｜tool") == [TextDelta("x ")]
    k = ToolCallParser("llama3_json")
    assert k.feed("Sure") == [TextDelta("Sure")]
    assert k.feed(" {\"name\"") == [TextDelta(" {\"name\"")]  # the message did not open with a call


def test_glm_values_follow_the_schema():
    out = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>null</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>x</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
           "</tool_call>")
    assert run("glm45", [out])[1][0][1] == {"city": "null", "days": 2, "x": [1, 2]}
    # without the tools, every value that reads as JSON is JSON
    assert run("glm45", [out], tools=None)[1][0][1] == {"city": None, "days": 2, "x": [1, 2]}


def test_unknown_format_is_refused():
    with pytest.raises(ValueError):
        ToolCallParser("mistral")
    with pytest.raises(ValueError):
        call_grammar("mistral", TOOLS)


# ---------------------------------------------------------------- format detection

QWEN = ("{%- if tools %}...<tools>{{ tool | tojson }}</tools>...<tool_call>\\n{\"name\": <function-name>, "
        "\"arguments\": <args-json-object>}\\n</tool_call>{%- endif %}")
GLM = "{% for tc in m.tool_calls %}<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>{% endfor %}"
DEEPSEEK = "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'}}"
KIMI = "{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>{%- for tc in message['tool_calls'] -%}"
MINIMAX = ("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}{{- '<invoke name=\"' + tool_call.name + '\">' }}"
           "{{- '<parameter name=\"' + k + '\">' }}")
LLAMA31 = "{%- if builtin_tools is defined or tools is not none %}Environment: ipython\n{%- endif %}<|python_tag|>"
LLAMA_OTHER = "{%- if tools is not none %}Given the following functions{%- endif %}"
HARMONY = ("{{- '<|start|>assistant<|channel|>commentary to=functions.' + tool_call.name + ' <|constrain|>json"
           "<|message|>' }}{{- '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>' }}")


@pytest.mark.parametrize("template,model_type,fmt", [
    (QWEN, "qwen3_moe", "hermes"), (GLM, "glm4_moe", "glm45"), (DEEPSEEK, "deepseek_v3", "deepseek_v3"),
    (KIMI, "kimi_k2", "kimi_k2"), (MINIMAX, "minimax_m2", "minimax_m2"), (LLAMA31, "llama", "llama3_json"), (LLAMA_OTHER, "llama", "llama3_json"),
    (LLAMA_OTHER, "mixtral", "hermes"), ("{{ messages }}", "llama", "hermes"), (None, None, "hermes"),
    (HARMONY, "gpt_oss", "harmony"),
])
def test_detect_format(template, model_type, fmt):
    assert detect_format(template, model_type) == fmt


# ---------------------------------------------------------------- grammar

try:
    import llguidance as llg
except ImportError:  # not (yet) a dependency of colibri: the parser tests above run without it
    llg = None
needs_llguidance = pytest.mark.skipif(llg is None, reason="llguidance is not installed")
EOS = 256


class ByteTokenizer:
    """One token per byte plus EOS, then the given special tokens: enough for llguidance to
    run a grammar with no model tokenizer at hand."""

    def __init__(self, specials=()):
        self.specials = list(specials)
        self.tokens = [bytes([b]) for b in range(256)] + [b"<eos>"] + [s.encode() for s in self.specials]
        self.eos_token_id, self.bos_token_id = EOS, None
        self.special_token_ids = list(range(EOS, len(self.tokens)))

    def __call__(self, text):
        return list(text if isinstance(text, bytes) else text.encode())

    def encode(self, text: str) -> list[int]:
        """Special tokens become their ids, all else bytes."""
        if not self.specials:
            return list(text.encode())
        ids = []
        for part in re.split("(" + "|".join(map(re.escape, self.specials)) + ")", text):
            ids += [EOS + 1 + self.specials.index(part)] if part in self.specials else list(part.encode())
        return ids


def matcher(grammar: str, tok: ByteTokenizer):
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(tok))
    compiled = llg.grammar_from("lark", grammar)
    assert llg.LLMatcher.validate_grammar(compiled, lltok) == ""
    m = llg.LLMatcher(lltok, compiled, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(grammar: str, output: str, specials=(), spelled=False) -> bool:
    """Walk the output token by token (`spelled`: the special tokens' text byte by byte); it must
    be taken whole and leave the grammar complete."""
    tok = ByteTokenizer(specials)
    m = matcher(grammar, tok)
    ids = list(output.encode()) if spelled else tok.encode(output)
    return all(m.consume_token(t) for t in ids) and m.is_accepting() and m.consume_token(EOS)


def weather(fmt: str, args: dict, idx: int = 0) -> str:
    """One call in `fmt` as the grammar lays it out (the model's own layout)."""
    a = json.dumps(args, ensure_ascii=False)
    name = "get_weather" if "city" in args or not args else "search"
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>'
    if fmt == "llama3_json":
        return f'{{"name": "{name}", "parameters": {a}}}'
    if fmt == "deepseek_v3":
        return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{a}\n```<｜tool▁call▁end｜>"
    if fmt == "kimi_k2":
        return f"<|tool_call_begin|>functions.{name}:{idx}<|tool_call_argument_begin|>{a}<|tool_call_end|>"
    if fmt == "harmony":
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{a}<|call|>"
    if fmt == "minimax_m2":
        pairs = "".join(f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}'
                        f"</parameter>\n" for k, v in args.items())
        return f'<invoke name="{name}">\n{pairs}</invoke>'
    pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                    f"</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{pairs}</tool_call>"


def message(fmt: str, *calls: str) -> str:
    sep = {"hermes": "\n", "llama3_json": "; ", "deepseek_v3": "\n", "kimi_k2": "", "glm45": "\n", "harmony": "",
           "minimax_m2": "\n"}[fmt]
    body = sep.join(calls)
    if fmt == "minimax_m2":
        return f"<minimax:tool_call>\n{body}\n</minimax:tool_call>"
    if fmt == "deepseek_v3":
        return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"
    if fmt == "kimi_k2":
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    return body


MARKERS = {"hermes": [TOOL_CALL, TOOL_CALL_END], "llama3_json": [],
           "deepseek_v3": [DS_CALLS, DS_CALLS_END, DS_CALL, DS_SEP, DS_CALL_END],
           "glm45": [TOOL_CALL, TOOL_CALL_END, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END],
           "kimi_k2": [KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END],
           "harmony": [CHANNEL, CONSTRAIN, MESSAGE, CALL],
           "minimax_m2": [MM_CALLS, MM_CALLS_END, MM_INVOKE_END, MM_PARAM_END]}


GOOD = {"city": "Par\"is {}", "unit": "celsius", "days": 3}
SEARCH = {"query": {"text": "ünï </arg_value-ish> {x}", "tags": ["a", "b"]}}


@needs_llguidance
@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_accepts_valid_calls_the_parser_reads_back(fmt):
    one = call_grammar(fmt, TOOLS, None, parallel=False)
    many = call_grammar(fmt, TOOLS, None, parallel=True)
    single = message(fmt, weather(fmt, GOOD))
    double = message(fmt, weather(fmt, GOOD), weather(fmt, SEARCH, 1))
    assert accepts(one, single) and accepts(many, single) and accepts(many, double)
    assert not accepts(one, double)  # parallel=False: exactly one call
    _, calls = run(fmt, [double])
    assert [(n, a) for n, a, _ in calls] == [("get_weather", GOOD), ("search", SEARCH)]


@needs_llguidance
@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_rejects_unknown_names_and_bad_arguments(fmt):
    g = call_grammar(fmt, TOOLS, None, parallel=True)
    assert not accepts(g, message(fmt, weather(fmt, GOOD).replace("get_weather", "get_wether")))
    assert not accepts(g, message(fmt, weather(fmt, {"unit": "celsius"})))  # city is required
    assert not accepts(g, message(fmt, weather(fmt, {"city": "Paris", "unit": "kelvin"})))  # not in the enum
    assert not accepts(g, message(fmt, weather(fmt, {"city": "Paris", "days": "three"})))
    assert not accepts(g, "Sure! " + message(fmt, weather(fmt, GOOD)))  # nothing but calls
    named = call_grammar(fmt, TOOLS, "search", parallel=False)
    assert accepts(named, message(fmt, weather(fmt, SEARCH)))
    assert not accepts(named, message(fmt, weather(fmt, GOOD)))


@needs_llguidance
def test_grammar_for_a_tool_without_parameters_and_unknown_choice():
    for fmt in FORMATS:
        g = call_grammar(fmt, TOOLS, "get_time", parallel=False)
        out = message(fmt, weather(fmt, {}).replace("get_weather", "get_time"))
        assert accepts(g, out), fmt
        assert [(n, a) for n, a, _ in run(fmt, [out])[1]] == [("get_time", {})]
    with pytest.raises(ValueError):
        call_grammar("hermes", TOOLS, "nope", parallel=False)
    with pytest.raises(ValueError):
        call_grammar("hermes", [], None, parallel=True)


@needs_llguidance
def test_grammar_with_a_real_bpe_tokenizer():
    """Tokens that span a marker and the JSON after it, as a real tokenizer makes them."""
    path = cache_root() / "models" / CONTAINER_NAME / "tokenizer.json"
    if not path.is_file():
        missing(f"no SmolLM2 tokenizer at {path} (colibri's default model was never run)")
    tok = llg.LLTokenizer(path.read_text())
    for fmt in FORMATS:
        m = llg.LLMatcher(tok, llg.grammar_from("lark", call_grammar(fmt, TOOLS, None, parallel=True)), log_level=0)
        out = message(fmt, weather(fmt, GOOD), weather(fmt, SEARCH, 1))
        ids = tok.tokenize_str(out)
        assert len(ids) < len(out.encode()) / 2  # real tokens, not bytes
        assert m.consume_tokens(ids) and m.is_accepting() and m.consume_token(tok.eos_token), (fmt, m.get_error())


@needs_llguidance
def test_grammar_allows_deepseek_v31_and_later_glm_layouts():
    v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + json.dumps(GOOD) \
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert accepts(call_grammar("deepseek_v3", TOOLS, None, parallel=False), v31)
    glm47 = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    assert accepts(call_grammar("glm45", TOOLS, None, parallel=False), glm47)


@needs_llguidance
@pytest.mark.parametrize("special", [False, True], ids=["text-marker", "special-token"])
def test_grammar_after_an_opened_think_block(special):
    """A prompt that ends inside `<think>` (MiniMax-M2's): the reasoning, up to `</think>`, comes
    before the calls; without its close no call is allowed, and nothing may follow the calls."""
    specials = ["</think>"] if special else []
    g = call_grammar("minimax_m2", TOOLS, None, parallel=False, special_tokens=specials, after_reasoning=True)
    call = message("minimax_m2", weather("minimax_m2", GOOD))
    assert accepts(g, "a < b, so </thin k> not yet</think>\n\n" + call, specials)
    assert accepts(g, "</think>" + call, specials)
    assert not accepts(g, call, specials)
    assert not accepts(g, "ok</think>" + call + " done", specials)


@needs_llguidance
def test_grammar_references_special_tokens():
    """Markers the tokenizer has as special tokens are those tokens in the grammar, not text."""
    g = call_grammar("kimi_k2", TOOLS, None, parallel=True, special_tokens=MARKERS["kimi_k2"])
    out = message("kimi_k2", weather("kimi_k2", GOOD), weather("kimi_k2", SEARCH, 1))
    assert accepts(g, out, MARKERS["kimi_k2"])
    assert not accepts(g, out, MARKERS["kimi_k2"], spelled=True)
    g = call_grammar("glm45", TOOLS, None, parallel=True, special_tokens=MARKERS["glm45"])
    assert accepts(g, message("glm45", weather("glm45", GOOD), weather("glm45", SEARCH)), MARKERS["glm45"])


@needs_llguidance
@pytest.mark.parametrize("special", [False, True], ids=["text-markers", "special-tokens"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_what_the_grammar_lets_a_model_write_parses(fmt, special):
    """Random walks through the grammar: whatever it lets a model write must parse into calls to
    the tools, with schema-shaped arguments and no text left over."""
    specials = MARKERS[fmt] if special else []
    g = call_grammar(fmt, TOOLS, None, parallel=True, special_tokens=specials)
    rng = random.Random(f"{fmt}{special}")
    tok = ByteTokenizer(specials)
    walked = 0
    for _ in range(8):
        m = matcher(g, tok)
        out = bytearray()
        while len(out) < 2000:
            mask = m.compute_bitmask()
            t = _pick(out, [t for t in range(len(tok.tokens)) if mask[t // 8] >> (t % 8) & 1], rng)
            if t == EOS:
                break
            assert m.consume_token(t)
            out += tok.tokens[t]
        else:
            continue  # too long a walk: nothing to check
        walked += 1
        text, calls = run(fmt, [out.decode()])
        assert text == "" and calls, out.decode()
        for name, args, _ in calls:
            assert name in {"get_weather", "search", "get_time"}
            if name == "get_weather":
                assert isinstance(args["city"], str) and isinstance(args.get("days", 1), int)
                assert args.get("unit", "celsius") in ("celsius", "fahrenheit")
            if name == "search":
                assert isinstance(args["query"]["text"], str)
    assert walked >= 6


def _pick(out: bytearray, allowed: list[int], rng: random.Random) -> int:
    """A random next token, steered so walks end: towards quotes, brackets, markers and EOS, and
    once a "</arg_value>" or "</parameter>" is begun, through to its end (glm45 and minimax_m2
    text values end with nothing else)."""
    for end in (b"</arg_value>", b"</parameter>"):
        for k in range(len(end) - 1, 0, -1):
            if out.endswith(end[:k]) and end[k] in allowed:
                return end[k]
    steer = [t for t in allowed if t >= EOS or t in b'"}]>\n<']
    return rng.choice(steer if steer and rng.random() < 0.3 else allowed)
