"""Tools and structured output for the chat APIs (OpenAI chat, Anthropic messages, Responses).

Each API translates its own shapes onto these: tools as OpenAI function definitions, a
`ToolPlan` saying what this request does with them, and an `AnswerStream` that turns the
model's text into reasoning, content and tool calls as it streams.

Tools reach the model through its own chat template (the Hugging Face `tools=` convention)
when the template renders them; a template that ignores tools (SmolLM2's) gets the Hermes
convention instead: the tool list in the system prompt, calls as `<tool_call>` JSON, results
as `<tool_response>` turns, which small instruction-tuned models have mostly seen. The model's
calls are parsed out of its text per family (colibri.serve.tool_calls). Under
`tool_choice` required or a named function, a grammar in the model's own call syntax masks the
logits, so the output is a well-formed call whose arguments validate against the schema.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from colibri.grammar import Grammar, GrammarError
from colibri.serve.errors import bad_request
from colibri.serve.reasoning import ReasoningSplitter
from colibri.serve.tool_calls import (ArgsDelta, CallEnd, CallStart, TextDelta, ToolCall, ToolCallParser,
                                      call_grammar, detect_format)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_SENTINEL = "colibri_probe_tool_7f3a"
MAX_TOOLS = 128            # OpenAI's own limit; the grammar of thousands of calls overruns the grammar engine
MAX_SCHEMA_NESTING = 64    # JSON levels (an object property is two): the schema checker recurses per level
MAX_PATTERN_SIZE = 10_000  # characters a regex's counted repeats may spell out, e.g. (a{100}){100}


# ---------------------------------------------------------------------------------- definitions
def check_schema(schema, param: str) -> dict:
    """A JSON schema (draft picked from its $schema, 2020-12 by default) or a 400 naming `param`."""
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param)
    if _nesting(schema) > MAX_SCHEMA_NESTING:
        raise bad_request(f"'{param}' is nested more than {MAX_SCHEMA_NESTING} levels deep (JSON objects and "
                          "arrays, an object property counting two); flatten it or use $defs", param=param)
    for where, pattern in _patterns(schema, param):
        check_pattern(pattern, where)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise bad_request(f"'{param}' is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else ""),
                          param=param) from None
    return schema


def _nesting(value) -> int:
    """How deep JSON objects and arrays nest in `value`, without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, depth)
            todo.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def _patterns(schema, param: str):
    """(where, regex) for each `pattern` and `patternProperties` key in a schema."""
    todo = [(schema, param)]
    while todo:
        v, where = todo.pop()
        if isinstance(v, dict):
            if isinstance(v.get("pattern"), str):
                yield f"{where}.pattern", v["pattern"]
            if isinstance(v.get("patternProperties"), dict):
                yield from ((f"{where}.patternProperties", k) for k in v["patternProperties"])
            todo.extend((c, f"{where}.{k}") for k, c in v.items())
        elif isinstance(v, list):
            todo.extend((c, f"{where}[{i}]") for i, c in enumerate(v))


def check_pattern(pattern: str, param: str) -> None:
    """A regex the grammar engine can build, or a 400 naming `param`: counted repeats nested in
    each other (`(a{1000}){1000}`) spell out their product, which the engine would expand state
    by state during generation, seconds later, and then fail."""
    import re._parser as sre  # Python's own regex parser: the same syntax, nothing compiled

    try:
        size = _spelled_out(sre.parse(pattern))
    except (re.error, RecursionError, OverflowError):
        return  # syntax Python does not share (ECMA's, Rust's): the grammar engine judges it

    if size > MAX_PATTERN_SIZE:
        raise bad_request(f"'{param}': the regex's counted repeats spell out {size} characters, more than "
                          f"{MAX_PATTERN_SIZE}; use fewer or unbounded repeats (*, +)", param=param)


def _spelled_out(parsed) -> int:
    import re._constants as c

    total = 0
    for op, arg in parsed:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            lo, hi, sub = arg
            total += (lo if hi == c.MAXREPEAT else hi) * max(1, _spelled_out(sub))
        elif op in (c.SUBPATTERN, c.ATOMIC_GROUP):
            total += _spelled_out(arg[-1])
        elif op is c.BRANCH:
            total += max((_spelled_out(b) for b in arg[1]), default=0)
        elif op in (c.ASSERT, c.ASSERT_NOT):
            total += _spelled_out(arg[1])
        elif op is not c.AT:  # anchors match no character
            total += 1
    return total


def check_tool_count(tools: list | None, param: str = "tools") -> None:
    if tools is not None and len(tools) > MAX_TOOLS:
        raise bad_request(f"'{param}' lists {len(tools)} tools; at most {MAX_TOOLS} are served", param=param)


def function_tool(name, description, parameters, param: str, strict=None, schema_field: str = "parameters") -> dict:
    """One tool in the shape templates and parsers take (OpenAI's), checked; `param` and
    `schema_field` spell where the request put it (`tools[0].function` + `parameters`,
    Anthropic's `tools[0]` + `input_schema`)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"'{param}.name' must be 1-64 letters, digits, '_' or '-', not {name!r}", param=f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"'{param}.description' must be a string", param=f"{param}.description")
    params = {"type": "object", "properties": {}} if parameters is None else parameters
    fn = {"name": name, "description": description or "",
          "parameters": check_schema(params, f"{param}.{schema_field}")}
    if strict is not None:
        fn["strict"] = bool(strict)
    return {"type": "function", "function": fn}


def openai_tools(tools: list | None) -> list[dict]:
    """OpenAI chat `tools` (function tools only) -> checked definitions."""
    check_tool_count(tools)
    out = []
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f"'{param}' must be {{'type': 'function', 'function': {{...}}}}; only function tools "
                              "are served", param=param)
        f = t["function"]
        unknown = set(f) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad_request(f"'{param}.function.{sorted(unknown)[0]}' is not a function tool field",
                              param=f"{param}.function.{sorted(unknown)[0]}")
        out.append(function_tool(f.get("name"), f.get("description"), f.get("parameters"), f"{param}.function",
                                 f.get("strict")))
    _unique(out, "tools")
    return out


def _unique(tools: list[dict], param: str) -> None:
    seen = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in seen:
            raise bad_request(f"'{param}[{i}]': two tools are named {name!r}", param=f"{param}[{i}]")
        seen.add(name)


# ---------------------------------------------------------------------------------- the plan
@dataclass
class ToolPlan:
    """What one request does with its tools. mode: none (tools not shown, nothing parsed), auto
    (the model may call), required (it must call one or more), named (it must call `name`)."""

    tools: list[dict]
    mode: str
    fmt: str
    native: bool                  # the chat template renders tools itself
    name: str | None = None
    parallel: bool = True
    special_tokens: frozenset[str] = frozenset()  # markers the tokenizer holds as single special tokens

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.mode in ("required", "named")

    def template_kwargs(self) -> dict:
        return {"tools": self.tools} if self.active and self.native else {}

    def grammar_spec(self, after_reasoning: bool = False) -> dict | None:
        """The grammar forcing the calls; `after_reasoning`: the prompt opened a think block, which
        the model closes before it calls."""
        if not self.forced:
            return None
        return {"lark": call_grammar(self.fmt, self.tools, self.name, self.parallel,
                                     special_tokens=self.special_tokens, after_reasoning=after_reasoning)}

    def parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.fmt, self.tools) if self.active else None


def plan(state, tools: list[dict], mode: str, name: str | None, parallel: bool, choice_param: str) -> ToolPlan:
    """`mode`/`name` from the API's tool_choice (already mapped to none/auto/required/named)."""
    names = {t["function"]["name"] for t in tools}
    if mode in ("required", "named") and not tools:
        raise bad_request(f"'{choice_param}' asks for a tool call, but the request has no tools", param=choice_param)
    if mode == "named" and name not in names:
        raise bad_request(f"'{choice_param}' names the function {name!r}, which is not among the tools "
                          f"({', '.join(sorted(names))})", param=choice_param)
    native, fmt = state.tool_support()
    return ToolPlan(tools, mode, fmt, native, name, parallel, state.special_tokens)


def compile_grammar(state, spec: dict | None, param: str) -> Grammar | None:
    """A grammar for the engine, or a 400 naming `param` when it cannot be built."""
    if spec is None:
        return None
    try:
        return Grammar.compile(state.tokenizer, spec, state.engine.vocab_size)
    except GrammarError as e:
        raise bad_request(f"'{param}': {e}", param=param) from None


def response_format_spec(fmt: dict | None, param: str = "response_format") -> dict | None:
    """OpenAI's response_format (text, json_object, json_schema) -> a grammar spec, or None."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request(f"'{param}.json_schema' is required for type json_schema", param=f"{param}.json_schema")
        schema = js.get("schema", {"type": "object"})
        return {"json_schema": check_schema(schema, f"{param}.json_schema.schema"), "strict": bool(js.get("strict"))}
    raise bad_request(f"'{param}.type' must be text, json_object or json_schema, not {kind!r}", param=f"{param}.type")


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_spec(req) -> tuple[dict | None, str | None]:
    """vLLM's guided decoding extensions -> (a grammar spec, the field it came from). They come
    for free with the grammar engine; at most one per request."""
    given = [name for name in GUIDED if getattr(req, name, None) is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"send one of {', '.join(GUIDED)}, not {' and '.join(given)}", param=given[1])
    name = given[0]
    value = getattr(req, name)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request("'guided_json' is not valid JSON", param=name) from None
        return {"json_schema": check_schema(value, name)}, name
    if name == "guided_choice":
        return {"regex": "|".join(re.escape(c) for c in value)}, name
    if name == "guided_regex" and isinstance(value, str):
        check_pattern(value, name)
    return ({"regex": value} if name == "guided_regex" else {"lark": value}), name


def probe_tool_support(tokenizer, model_type: str | None) -> tuple[bool, str]:
    """(whether the chat template renders a `tools=` list, the call format to parse). A template
    that ignores tools gets the Hermes convention (see the module docstring)."""
    template = tokenizer.chat_template if tokenizer is not None else None
    if not template:
        return False, "hermes"
    probe = [{"type": "function", "function": {"name": _SENTINEL, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tools=probe)
    except Exception:
        return False, "hermes"
    if _SENTINEL not in text:
        return False, "hermes"
    return True, detect_format(template, model_type)


# ---------------------------------------------------------------------------------- messages
HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions. Here are the available tools:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def render_messages(messages: list[dict], tool_plan: ToolPlan | None) -> list[dict]:
    """Messages in the Hugging Face convention (assistant `tool_calls` with dict arguments, `tool`
    results) -> what this model's template is given: unchanged where it renders tools itself,
    else the Hermes convention in plain text turns."""
    if tool_plan is None or tool_plan.native:
        return messages
    out: list[dict] = []
    if tool_plan.active:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_plan.tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": c["function"]["arguments"]},
                                                          ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def parse_arguments(arguments, param: str) -> dict:
    """A call's arguments as sent back by a client (JSON text, or an object) -> a dict for the template."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        raise bad_request(f"'{param}' must be a JSON object encoded as a string", param=param)
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise bad_request(f"'{param}' is not valid JSON", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must encode a JSON object", param=param)
    return value


# ---------------------------------------------------------------------------------- the answer
@dataclass
class Reasoning:
    text: str


class AnswerStream:
    """One choice's text -> Reasoning, TextDelta, CallStart, ArgsDelta and CallEnd events, in
    order: reasoning split off first, then tool calls parsed out of the rest."""

    def __init__(self, splitter: ReasoningSplitter | None, parser: ToolCallParser | None):
        self.splitter, self.parser = splitter, parser
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list:
        if self.splitter is None:
            return self._content(text)
        return self._split(*self.splitter.feed(text))

    def finish(self) -> list:
        events = self._split(*self.splitter.flush()) if self.splitter is not None else []
        if self.parser is not None:
            events += self._record(self.parser.finish())
        return events

    def _split(self, reasoning: str, content: str) -> list:
        events = []
        if reasoning:
            self.reasoning += reasoning
            events.append(Reasoning(reasoning))
        return events + self._content(content)

    def _content(self, text: str) -> list:
        if not text:
            return []
        if self.parser is None:
            self.content += text
            return [TextDelta(text)]
        return self._record(self.parser.feed(text))

    def _record(self, events: list) -> list:
        for ev in events:
            if isinstance(ev, TextDelta):
                self.content += ev.text
            elif isinstance(ev, CallEnd):
                self.calls.append(ev.call)
        return [ev for ev in events if not (isinstance(ev, TextDelta) and not ev.text)]


__all__ = ["AnswerStream", "ArgsDelta", "CallEnd", "CallStart", "Reasoning", "TextDelta", "ToolCall", "ToolPlan",
           "check_schema", "compile_grammar", "function_tool", "openai_tools", "parse_arguments", "plan",
           "probe_tool_support", "render_messages", "response_format_spec"]
