"""Tool calls in a model's own syntax: parsing them out of the generated text as it streams, one
parser per model family, and the llguidance grammar that forces a model to write only valid
calls (for `tool_choice` "required" or a named function).

Formats (the ids vLLM's --tool-call-parser uses, where it has one):
- hermes (Qwen2.5/Qwen3/Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, a block a call;
- llama3_json (Llama 3.x): the message is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls joined by `;`;
- deepseek_v3 (DeepSeek-V3/R1, and V3.1's form without `function` and the ```json fence);
- glm45 (GLM-4.5 and later): `<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`;
- kimi_k2: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>` in a section;
- harmony (gpt-oss): `<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`, the spelling
  colibri.serve.harmony.HarmonySplitter gives every call the model writes.
- minimax_m2 (MiniMax-M2): `<invoke name="NAME"><parameter name="k">v</parameter></invoke>` in a
  `<minimax:tool_call>` section, values written as glm45 writes them (strings raw, the rest JSON).

A call is reported once it is complete and valid: its CallStart, ArgsDelta and CallEnd come
together. Streaming arguments as they arrive would announce calls to a client that might still
turn out malformed, and a malformed call stays text. `arguments` is always
json.dumps(obj, ensure_ascii=False) of the parsed object (the model's own spacing is not kept),
so every format gives the same text for the same call.

Each call is read left to right, as JSON where it is JSON: a marker quoted inside an argument
string does not end the call. Every step either succeeds, waits for more text, or fails for good,
so no way of cutting the text into pieces changes the outcome."""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass

from colibri.serve.harmony import CALL, CALL_PREFIX, CHANNEL, CONSTRAIN, MESSAGE

FORMATS = ("hermes", "llama3_json", "deepseek_v3", "glm45", "kimi_k2", "harmony", "minimax_m2")

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"  # hermes and glm45
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
PYTHON_TAG = "<|python_tag|>"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_END = "</think>"  # where a reasoning model's thinking ends (colibri.serve.reasoning.CLOSE)
MM_CALLS, MM_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
MM_INVOKE, MM_INVOKE_END, MM_PARAM, MM_PARAM_END = "<invoke name=", "</invoke>", "<parameter name=", "</parameter>"

# (section open, section close, call open, call close) of the formats whose calls sit in a section
_SECTIONS = {"deepseek_v3": (DS_CALLS, DS_CALLS_END, DS_CALL, DS_CALL_END),
             "kimi_k2": (KIMI_CALLS, KIMI_CALLS_END, KIMI_CALL, KIMI_CALL_END),
             "minimax_m2": (MM_CALLS, MM_CALLS_END, MM_INVOKE, MM_INVOKE_END)}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class TextDelta:
    text: str


@dataclass
class CallStart:
    index: int
    id: str
    name: str


@dataclass
class ArgsDelta:
    index: int
    fragment: str


@dataclass
class CallEnd:
    index: int
    call: ToolCall


Event = TextDelta | CallStart | ArgsDelta | CallEnd


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class _More(Exception):
    """The text ends before the call does."""


class _Bad(Exception):
    """The text is no call, whatever follows."""


class ToolCallParser:
    """feed() the generated text piece by piece, then finish(); each returns the events it
    decided. Text that might still become a call (a trailing "<tool", an open call) is held back
    until the next piece or finish() decides it; nothing else is."""

    def __init__(self, fmt: str, tools: list[dict] | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool call format {fmt!r}; known: {', '.join(FORMATS)}")
        self.fmt = fmt
        self.calls: list[ToolCall] = []
        self.text = ""
        self._buf = ""  # received, not yet decided; a call being read starts it
        self._state = "llama" if fmt == "llama3_json" else "text"
        self._scans: dict[int, _JsonScanner] = {}  # by start in _buf, so each feed reads on
        self._in_section = False  # a section's opener was consumed by a call already parsed
        self._after_call = False  # blanks that follow a call are held: layout unless text follows
        # glm45 and minimax_m2 write string values raw: only the schema tells "5" the string from 5 the number
        self._string_params = {
            f.get("name"): {k for k, v in _properties(f.get("parameters")).items()
                            if isinstance(v, dict) and v.get("type") == "string"}
            for f in _functions(tools or [])}

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        return self._drain(final=True)

    # ---------------------------------------------------------------- driving

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        step = {"text": self._text, "plain": self._plain, "call": self._call, "section": self._section,
                "llama": self._llama}
        while step[self._state](events, final):  # each step says whether to go on
            pass
        return events

    def _wait(self, events: list[Event], final: bool) -> bool:
        if not final:
            return False
        if self.fmt == "llama3_json" and self.calls and not self._buf.strip():
            self._buf = ""  # blanks after the last call are layout
            return False
        return self._malformed(events)  # a call the generation ended in is no call

    def _malformed(self, events: list[Event]) -> bool:
        """The call that starts the buffer is none: its opener becomes text and the rest is read
        again as text (it may hold a valid call). Inside a section whose opener a good call
        already consumed, all that is left is read again as text."""
        self._scans.clear()
        if self.fmt == "llama3_json":
            self._state = "plain"  # llama calls only open the message
            return True
        if not self._in_section:
            self._emit_text(events, self._opener)
            self._buf = self._buf[len(self._opener):]
        self._in_section, self._after_call, self._state = False, False, "text"
        return True

    def _emit_text(self, events: list[Event], text: str) -> None:
        if not text:
            return
        self.text += text
        if events and isinstance(events[-1], TextDelta):
            events[-1].text += text
        else:
            events.append(TextDelta(text))

    def _emit_call(self, events: list[Event], parsed: tuple[str, str, str | None, int]) -> None:
        name, arguments, call_id, end = parsed
        call = ToolCall(call_id or new_call_id(), name, arguments)
        index = len(self.calls)
        self.calls.append(call)
        events += [CallStart(index, call.id, name), ArgsDelta(index, arguments), CallEnd(index, call)]
        self._buf, self._after_call = self._buf[end:], True
        self._scans.clear()

    # ---------------------------------------------------------------- states

    @property
    def _opener(self) -> str:
        if self.fmt == "harmony":
            return CALL_PREFIX
        return _SECTIONS[self.fmt][0] if self.fmt in _SECTIONS else TOOL_CALL

    def _text(self, events: list[Event], final: bool) -> bool:
        opener = self._opener
        if self._after_call:
            # blanks between two calls, or after the last, lay the calls out: they are no content
            rest = self._buf.lstrip()
            if rest.startswith(opener) or (final and not rest):
                self._buf = rest
            elif opener.startswith(rest) and not final:
                return False
            self._after_call = False
        i = self._buf.find(opener)
        if i < 0:
            keep = 0 if final else _partial_suffix(self._buf, opener)
            self._emit_text(events, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._emit_text(events, self._buf[:i])
        self._buf = self._buf[i:]
        self._state = "section" if self.fmt in _SECTIONS else "call"
        return True

    def _plain(self, events: list[Event], final: bool) -> bool:
        self._emit_text(events, self._buf)
        self._buf = ""
        return False

    def _call(self, events: list[Event], final: bool) -> bool:
        """hermes and glm45: one `<tool_call>` block; harmony: one call message."""
        try:
            if self.fmt == "harmony":
                parsed = self._harmony_call()
            else:
                parsed = self._hermes_call() if self.fmt == "hermes" else self._glm_call(final)
        except _More:
            return self._wait(events, final)
        except _Bad:
            return self._malformed(events)
        self._emit_call(events, parsed)
        self._state = "text"
        return True

    def _section(self, events: list[Event], final: bool) -> bool:
        """deepseek_v3, kimi_k2 and minimax_m2: calls follow one another in a section, each reported as soon
        as it is read; the buffer starts with the section opener until one was."""
        sec_open, sec_close, call_open, _ = _SECTIONS[self.fmt]
        buf = self._buf
        i = _skip_ws(buf, 0 if self._in_section else len(sec_open))
        try:
            if self._in_section and buf.startswith(sec_close, i):
                self._buf, self._state, self._in_section = buf[i + len(sec_close):], "text", False
                return True
            if self._in_section and _partial(buf, i, sec_close):
                raise _More
            i = _expect(buf, i, call_open)
            read = {"deepseek_v3": self._deepseek_call, "kimi_k2": self._kimi_call,
                    "minimax_m2": lambda i: self._minimax_call(i, final)}[self.fmt]
            parsed = read(i)
        except _More:
            return self._wait(events, final)
        except _Bad:
            return self._malformed(events)
        self._emit_call(events, parsed)
        self._in_section = True
        return True

    def _llama(self, events: list[Event], final: bool) -> bool:
        """`<|python_tag|>` and blanks before the first call, `;` between two; anything else ends
        the calls, and the rest of the message is text."""
        buf = self._buf
        try:
            i = _skip_ws(buf, 0)
            if not self.calls:
                if buf.startswith(PYTHON_TAG, i):
                    i = _skip_ws(buf, i + len(PYTHON_TAG))
                elif _partial(buf, i, PYTHON_TAG):
                    raise _More
            else:
                i = _skip_ws(buf, _expect(buf, i, ";"))
            start, end = self._json(i, "{")
            self._emit_call(events, (*_json_call(buf[start:end]), None, end))
        except _More:
            return self._wait(events, final)
        except _Bad:
            return self._malformed(events)
        return True

    # ---------------------------------------------------------------- one call, per format
    # Each reads the call at the buffer's start, or at i, and returns (name, arguments, id, end);
    # it raises _More or _Bad.

    def _json(self, i: int, openers: str) -> tuple[int, int]:
        """Start and end of the JSON value (object, array or string) after blanks at i."""
        i = _skip_ws(self._buf, i)
        if i == len(self._buf):
            raise _More
        if self._buf[i] not in openers:
            raise _Bad
        end = self._scans.setdefault(i, _JsonScanner()).end(self._buf, i)
        if end is None:
            raise _More
        return i, end

    def _hermes_call(self) -> tuple[str, str, None, int]:
        start, end = self._json(len(TOOL_CALL), "{")
        stop = _expect(self._buf, _skip_ws(self._buf, end), TOOL_CALL_END)
        return *_json_call(self._buf[start:end]), None, stop

    def _harmony_call(self) -> tuple[str, str, None, int]:
        # "NAME<|message|>" as HarmonySplitter spells it, or the model's own "NAME <|constrain|>json<|message|>"
        buf = self._buf
        m = _HARMONY_NAME.match(buf, len(CALL_PREFIX))
        name, i = m[1], _skip_ws(buf, m.end())
        if i == len(buf) or _partial(buf, i, CONSTRAIN):
            raise _More
        if not name:
            raise _Bad
        if buf.startswith(CONSTRAIN, i):
            i = _skip_ws(buf, i + len(CONSTRAIN))
            if _partial(buf, i, "json"):
                raise _More
            i = _skip_ws(buf, i + 4) if buf.startswith("json", i) else i
        start, end = self._json(_expect(buf, i, MESSAGE), "{")
        return name, _arguments(buf[start:end]), None, _expect(buf, _skip_ws(buf, end), CALL)

    def _glm_call(self, final: bool) -> tuple[str, str, None, int]:
        buf = self._buf
        m = _GLM_NAME.match(buf, len(TOOL_CALL))
        name, i = m[1], m.end()
        if i == len(buf):
            raise _More
        if not name:
            raise _Bad
        strings, args = self._string_params.get(name, set()), {}
        while True:
            i = _skip_ws(buf, i)
            if buf.startswith(TOOL_CALL_END, i):
                return name, json.dumps(args, ensure_ascii=False), None, i + len(TOOL_CALL_END)
            if _partial(buf, i, ARG_KEY) or _partial(buf, i, TOOL_CALL_END):
                raise _More
            i = _expect(buf, i, ARG_KEY)
            k = buf.find(ARG_KEY_END, i)
            if k < 0:
                raise _More
            key = buf[i:k].strip()
            i = _expect(buf, _skip_ws(buf, k + len(ARG_KEY_END)), ARG_VALUE)
            args[key], i = self._glm_value(i, key not in strings, final)

    def _glm_value(self, i: int, as_json: bool, final: bool, close: str = ARG_VALUE_END) -> tuple[object, int]:
        """A value not declared a string is JSON when it reads as JSON, else text; JSON is read as
        JSON (it may quote the `close` tag, "</arg_value>"). Text runs to the first `close`, blanks
        around it dropped as vLLM does (they are the template's layout)."""
        buf = self._buf
        if as_json:
            try:
                start, end = self._json(i, '{["')
                stop = _expect(buf, _skip_ws(buf, end), close)
                return json.loads(buf[start:end]), stop
            except _More:
                if not final:
                    raise
            except (_Bad, ValueError):
                pass
        end = buf.find(close, i)
        if end < 0:
            raise _More
        value: object = buf[i:end].strip()
        if as_json:
            try:
                value = json.loads(value)
            except ValueError:
                pass
        return value, end + len(close)

    def _minimax_call(self, i: int, final: bool) -> tuple[str, str, None, int]:
        # `<invoke name=` is behind i: `"NAME">`, then `<parameter name="k">v</parameter>` pairs
        buf = self._buf
        name, i = self._quoted_name(i, MM_INVOKE_END)
        strings, args = self._string_params.get(name, set()), {}
        while True:
            i = _skip_ws(buf, i)
            if buf.startswith(MM_INVOKE_END, i):
                return name, json.dumps(args, ensure_ascii=False), None, i + len(MM_INVOKE_END)
            if _partial(buf, i, MM_PARAM) or _partial(buf, i, MM_INVOKE_END):
                raise _More
            key, i = self._quoted_name(_expect(buf, i, MM_PARAM), MM_PARAM_END)
            args[key], i = self._glm_value(i, key not in strings, final, MM_PARAM_END)

    def _quoted_name(self, i: int, close: str) -> tuple[str, int]:
        """`"NAME">` at i, before the `close` tag: (NAME, the index after `>`)."""
        gt = _find_before(self._buf, ">", i, close)
        m = _QUOTED_NAME.fullmatch(self._buf, i, gt)
        if m is None:
            raise _Bad
        return m[1], gt + 1

    def _deepseek_call(self, i: int) -> tuple[str, str, None, int]:
        # V3/R1: "function<｜tool▁sep｜>NAME\n```json\n{...}\n```"; V3.1: "NAME<｜tool▁sep｜>{...}"
        # (so a tool named "function" is only read in the V3 form)
        buf = self._buf
        sep = _find_before(buf, DS_SEP, i, DS_CALL_END)
        name, i = buf[i:sep].strip(), sep + len(DS_SEP)
        if name == "function":
            line = _find_before(buf, "\n", i, DS_CALL_END)
            name, i = buf[i:line].strip(), _expect(buf, line + 1, "```")
            if buf.startswith("json", i):
                i += len("json")
            elif _partial(buf, i, "json"):
                raise _More
            start, end = self._json(i, "{")
            i = _expect(buf, _skip_ws(buf, end), "```")
        else:
            start, end = self._json(i, "{")
            i = end
        if not name:
            raise _Bad
        return name, _arguments(buf[start:end]), None, _expect(buf, _skip_ws(buf, i), DS_CALL_END)

    def _kimi_call(self, i: int) -> tuple[str, str, str, int]:
        # the id the model wrote ("functions.NAME:IDX") is the call id it expects to see again
        buf = self._buf
        a = _find_before(buf, KIMI_ARGS, i, KIMI_CALL_END)
        m = _KIMI_ID.fullmatch(buf, i, a)
        if m is None:
            raise _Bad
        start, end = self._json(a + len(KIMI_ARGS), "{")
        stop = _expect(buf, _skip_ws(buf, end), KIMI_CALL_END)
        return m[2], _arguments(buf[start:end]), m[1], stop


class _JsonScanner:
    """Where the JSON object, array or string starting at s[start] ends, or None while it is
    open. It only follows brackets and strings (json.loads judges the rest), and remembers how
    far it read, so a long argument streamed token by token is read once."""

    _SPECIAL = re.compile(r'["\\{}\[\]]')

    def __init__(self):
        self.pos, self.depth, self.in_string, self.stop = -1, 0, False, None

    def end(self, s: str, start: int) -> int | None:
        i = max(self.pos, start)
        while self.stop is None and (m := self._SPECIAL.search(s, i)) is not None:
            c, i = m[0], m.end()
            if c == "\\" and self.in_string:
                if i == len(s):  # the escaped character is still to come
                    i -= 1
                    break
                i += 1
            elif c == '"':
                self.in_string = not self.in_string
                if not self.in_string and self.depth == 0:
                    self.stop = i
            elif not self.in_string and c != "\\":
                self.depth += 1 if c in "{[" else -1
                if self.depth == 0:
                    self.stop = i
        else:
            i = len(s)
        self.pos = i
        return self.stop


_GLM_NAME = re.compile(r"\s*([^\s<]*)")
_HARMONY_NAME = re.compile(r"([^\s<]*)")
_KIMI_ID = re.compile(r"\s*((?:functions\.)?(\S+?):\d+)\s*")
_QUOTED_NAME = re.compile(r'\s*"([^"<>]+)"\s*')


def _json_call(text: str) -> tuple[str, str]:
    """hermes and llama3_json: {"name": ..., "arguments" (or "parameters"): {...}}."""
    try:
        obj = json.loads(text)
    except ValueError:
        raise _Bad from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise _Bad
    return obj["name"], _arguments(obj["arguments"] if "arguments" in obj else obj.get("parameters", {}))


def _arguments(value: object) -> str:
    """Normalised arguments text, when they are a JSON object or JSON text of one (some models
    encode the arguments object a second time, as a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _Bad from None
    if not isinstance(value, dict):
        raise _Bad
    return json.dumps(value, ensure_ascii=False)


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _partial(s: str, i: int, lit: str) -> bool:
    """s ends at i or after a proper beginning of lit there."""
    return len(s) - i < len(lit) and lit.startswith(s[i:])


def _expect(s: str, i: int, lit: str) -> int:
    if s.startswith(lit, i):
        return i + len(lit)
    raise _More if _partial(s, i, lit) else _Bad


def _find_before(s: str, lit: str, i: int, end: str) -> int:
    """Where lit is next from i, in the call that `end` ends."""
    j, e = s.find(lit, i), s.find(end, i)
    if e >= 0 and not 0 <= j < e:
        raise _Bad
    if j < 0:
        raise _More
    return j


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _functions(tools: list[dict]) -> list[dict]:
    return [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]


def _properties(schema: object) -> dict:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


# ---------------------------------------------------------------- format detection

def detect_format(chat_template: str | None, model_type: str | None) -> str:
    """The format a model writes tool calls in, from the markers its chat template renders them
    with. hermes is also colibri's choice for templates that cannot render tools themselves."""
    t = chat_template or ""
    if CHANNEL in t and MESSAGE in t:  # harmony (gpt-oss), whose template also says "functions."
        return "harmony"
    if "tool▁calls▁begin" in t:
        return "deepseek_v3"
    if "tool_calls_section_begin" in t:
        return "kimi_k2"
    if MM_CALLS in t:
        return "minimax_m2"
    if "<arg_key>" in t:  # before hermes: GLM templates also write <tool_call>
        return "glm45"
    if "<tool_call>" in t:
        return "hermes"
    if PYTHON_TAG in t or "Environment: ipython" in t or (model_type == "llama" and "tools" in t):
        return "llama3_json"
    return "hermes"


# ---------------------------------------------------------------- grammar

# The arguments as HF templates' tojson (Python's json.dumps) writes them in the prompts the model
# saw; no free whitespace, so a constrained model cannot loop on blanks. `lenient` skips schema
# keywords llguidance does not implement rather than refusing the tool.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}


def call_grammar(fmt: str, tools: list[dict], choice: str | None = None, parallel: bool = False,
                 *, special_tokens: Collection[str] = (), after_reasoning: bool = False) -> str:
    """llguidance lark grammar for nothing but tool calls in format `fmt`: one call, or one or
    more when `parallel`, to one of `tools` (only `choice` when given), its arguments held to the
    tool's JSON schema. special_tokens: the tokenizer's special tokens; a marker among them is
    referenced as that token (a quoted marker would only match text, never the special token the
    model was trained to emit). after_reasoning: the prompt left the model inside a think block
    (MiniMax-M2's always does): its reasoning, up to `</think>`, comes first, then the calls."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; known: {', '.join(FORMATS)}")
    fns = [f for f in _functions(tools) if choice is None or f.get("name") == choice]
    if not fns:
        raise ValueError(f"no tool named {choice!r}" if choice is not None else "no tools to call")

    def mark(marker: str) -> str:
        return marker if marker in special_tokens else _lit(marker)  # <name> references a token

    rules: list[str] = []
    for i, f in enumerate(fns):
        name, schema, args = f["name"], _object_schema(f.get("parameters")), f"args_{i}"
        quoted = json.dumps(name, ensure_ascii=False)
        if fmt == "hermes":
            body = [mark(TOOL_CALL), _lit('\n{"name": ' + quoted + ', "arguments": '), args, _lit("}\n"),
                    mark(TOOL_CALL_END)]
        elif fmt == "llama3_json":
            body = [_lit('{"name": ' + quoted + ', "parameters": '), args, _lit("}")]
        elif fmt == "deepseek_v3":  # the V3/R1 form or the V3.1 one: whichever the model was taught
            body = [mark(DS_CALL), "(", _lit("function"), mark(DS_SEP), _lit(name + "\n```json\n"), args,
                    _lit("\n```"), "|", _lit(name), mark(DS_SEP), args, ")", mark(DS_CALL_END)]
        elif fmt == "kimi_k2":
            body = [mark(KIMI_CALL), _lit(f"functions.{name}:"), "/[0-9]+/", mark(KIMI_ARGS), args,
                    mark(KIMI_CALL_END)]
        elif fmt == "harmony":  # as gpt-oss writes a call after its generation prompt
            body = [mark(CHANNEL), _lit(f"commentary to=functions.{name} "), mark(CONSTRAIN), _lit("json"),
                    mark(MESSAGE), args, mark(CALL)]
        elif fmt == "minimax_m2":
            body = _minimax_call_rule(i, name, schema, mark, rules)
        else:
            body = _glm_call_rule(i, name, schema, mark, rules)
        rules.append(f"call_{i}: " + " ".join(body))
        if fmt not in ("glm45", "minimax_m2"):
            rules.append(f"{args}: %json {_json_schema(schema)}")
    if fmt == "glm45":
        # String values are raw text, which the first "</arg_value>" ends. Ended by that text they
        # are lazy (they stop at its first occurrence); ended by the special token, their text
        # may not hold it spelled out.
        rules += ([r"GLM_TEXT: /(?s:.*)/ & ~/(?s:.*)<\/arg_value>(?s:.*)/"] if ARG_VALUE_END in special_tokens
                  else ["glm_text[lazy]: GLM_TEXT_END", r"GLM_TEXT_END: /(?s:.*)<\/arg_value>/"])
    if fmt == "minimax_m2":  # the same, ended by "</parameter>"
        rules += ([r"MM_TEXT: /(?s:.*)/ & ~/(?s:.*)<\/parameter>(?s:.*)/"] if MM_PARAM_END in special_tokens
                  else ["mm_text[lazy]: MM_TEXT_END", r"MM_TEXT_END: /(?s:.*)<\/parameter>/"])

    sep = {"hermes": _lit("\n"), "llama3_json": _lit("; "), "deepseek_v3": _lit("\n") + "?",
           "kimi_k2": "", "glm45": _lit("\n"), "harmony": "", "minimax_m2": _lit("\n") + "?"}[fmt]
    # (harmony: <|call|> is an end-of-generation token, so a model stops after one call; several
    # are written back to back)
    calls = f"call ({sep} call)*" if parallel else "call"
    if fmt in _SECTIONS:
        sec_open, sec_close = _SECTIONS[fmt][:2]
        pad = f" {_lit(chr(10))}? " if fmt == "minimax_m2" else " "  # MiniMax's template: a newline inside each end
        calls = f"{mark(sec_open)}{pad}{calls}{pad}{mark(sec_close)}"
    names = " | ".join(f"call_{i}" for i in range(len(fns)))
    if after_reasoning:
        calls = f"reasoning {calls}"
        close = THINK_END
        rules += ([f"reasoning: REASONING {mark(close)} BLANKS",
                   r"REASONING: /(?s:.*)/ & ~/(?s:.*)<\/think>(?s:.*)/"] if close in special_tokens
                  else ["reasoning: reasoning_text BLANKS", "reasoning_text[lazy]: REASONING_END",
                        r"REASONING_END: /(?s:.*)<\/think>/"])
        rules.append(r"BLANKS: /[ \n]*/")
    return "\n".join([f"start: {calls}", f"call: {names}", *rules]) + "\n"


def _glm_call_rule(i: int, name: str, schema: dict, mark: Callable[[str], str], rules: list[str]) -> list[str]:
    """`<tool_call>NAME` then one <arg_key>/<arg_value> pair per property, in the schema's order,
    the optional ones optional. GLM-4.5 puts a newline after the name and each tag pair, later
    GLMs none: either is allowed. A schema without properties allows any pairs of text."""
    nl = _lit("\n") + "?"
    close = mark(ARG_VALUE_END)
    text_value = "glm_text" if close.startswith('"') else f"GLM_TEXT {close}"
    props = _properties(schema)
    required = set(schema.get("required") or ())
    pairs = []
    for j, (key, prop) in enumerate(props.items()):
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("type") == "string" and prop.get("enum"):
            value = f"({' | '.join(_lit(str(v)) for v in prop['enum'])}) {close}"
        elif prop.get("type") == "string":
            value = text_value
        else:  # the parser reads such a value as JSON
            defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # for its $refs
            rules.append(f"value_{i}_{j}: %json {_json_schema(prop | defs)}")
            value = f"value_{i}_{j} {close}"
        pair = f"{mark(ARG_KEY)} {_lit(key)} {mark(ARG_KEY_END)} {nl} {mark(ARG_VALUE)} {value} {nl}"
        pairs.append(f"({pair})" + ("" if key in required else "?"))
    if not props:
        pairs.append(f"({mark(ARG_KEY)} /[^<\\n]+/ {mark(ARG_KEY_END)} {nl} {mark(ARG_VALUE)} {text_value} {nl})*")
    return [mark(TOOL_CALL), _lit(name), nl, *pairs, mark(TOOL_CALL_END)]


def _minimax_call_rule(i: int, name: str, schema: dict, mark: Callable[[str], str], rules: list[str]) -> list[str]:
    """`<invoke name="NAME">` then one `<parameter name="KEY">value</parameter>` per property, in
    the schema's order, the optional ones optional, newlines between the tags optional; values
    as glm45's (a string raw, anything else JSON). Without properties: any pairs of text."""
    nl = _lit("\n") + "?"
    close = mark(MM_PARAM_END)
    text_value = "mm_text" if close.startswith('"') else f"MM_TEXT {close}"
    props = _properties(schema)
    required = set(schema.get("required") or ())
    pairs = []
    for j, (key, prop) in enumerate(props.items()):
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("type") == "string" and prop.get("enum"):
            value = f"({' | '.join(_lit(str(v)) for v in prop['enum'])}) {close}"
        elif prop.get("type") == "string":
            value = text_value
        else:
            defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
            rules.append(f"value_{i}_{j}: %json {_json_schema(prop | defs)}")
            value = f"value_{i}_{j} {close}"
        pair = f"{_lit(MM_PARAM + json.dumps(key, ensure_ascii=False) + '>')} {value} {nl}"
        pairs.append(f"({pair})" + ("" if key in required else "?"))
    if not props:
        pairs.append(f"({_lit(MM_PARAM)} /\"[^\"<>]+\">/ {text_value} {nl})*")
    return [_lit(MM_INVOKE + json.dumps(name, ensure_ascii=False) + ">"), nl, *pairs, mark(MM_INVOKE_END)]


def _json_schema(schema: dict) -> str:
    return json.dumps(dict(schema, **{"x-guidance": _JSON_OPTIONS}), ensure_ascii=False)


def _object_schema(parameters: object) -> dict:
    """A tool's parameters schema; no parameters at all means an empty object."""
    schema = dict(parameters) if isinstance(parameters, dict) else {}
    schema.setdefault("type", "object")
    return schema


def _lit(text: str) -> str:
    # a lark string literal (llguidance reads JSON string escapes)
    return json.dumps(text, ensure_ascii=False)
