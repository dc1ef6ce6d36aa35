"""gpt-oss's harmony format: analysis / final channels to reasoning / content, and tool calls
through the splitter and the `harmony` tool-call parser (colibri/serve/tools.AnswerStream, as
the server runs them), whole, split at every point and one character at a time."""
from __future__ import annotations

import json

import pytest

from colibri.serve.harmony import HarmonySplitter, is_harmony
from colibri.serve.tool_calls import ToolCallParser, detect_format
from colibri.serve.tools import AnswerStream, Reasoning, TextDelta

# What gpt-oss writes after its generation prompt `<|start|>assistant`; the stop tokens
# <|return|> and <|call|> end a generation, so the text may hold them or not.
PLAIN = ("<|channel|>analysis<|message|>User asks for 2+2. Easy.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "note": "<|end|> is text here"}<|call|>')
# the recipient before the channel, a preamble to the user first, and no stop token in the text
CALL_ALT = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking now.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}")
CASES = [
    (PLAIN, "User asks for 2+2. Easy.", "2 + 2 = 4.", []),
    (PLAIN + "<|return|>", "User asks for 2+2. Easy.", "2 + 2 = 4.", []),
    (CALL, "Need the weather tool.", "", [("get_weather", {"city": "Paris", "note": "<|end|> is text here"})]),
    (CALL_ALT, "think", "Checking now.", [("get_time", {})]),
    ("<|channel|>analysis<|message|>cut off mid thou", "cut off mid thou", "", []),
]


def answer(pieces: list[str]) -> tuple[str, str, list]:
    stream = AnswerStream(HarmonySplitter(), ToolCallParser("harmony"))
    events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert (reasoning, content) == (stream.reasoning, stream.content)
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in stream.calls]


@pytest.mark.parametrize("output,reasoning,content,calls", CASES)
def test_channels_and_calls_whole_split_and_char_by_char(output, reasoning, content, calls):
    assert answer([output]) == (reasoning, content, calls)
    for s in range(len(output) + 1):
        assert answer([output[:s], output[s:]]) == (reasoning, content, calls), f"split at {s}"
    assert answer(list(output)) == (reasoning, content, calls)


def test_no_marker_leaks_while_streaming():
    s = HarmonySplitter()
    assert s.feed("<|channel|>analysis<|mess") == ("", "")
    assert s.feed("age|>abc<|e") == ("abc", "")
    assert s.feed("nd|><|start|>assistant<|channel|>final<|message|>hi") == ("", "hi")
    assert s.flush() == ("", "")


def test_gpt_oss_template_is_detected():
    template = ("{{- '<|start|>assistant<|channel|>final<|message|>' }}{{- '<|start|>assistant to=functions.'"
                " + name + '<|channel|>commentary json<|message|>' }}")
    assert is_harmony(template) and detect_format(template, "gpt_oss") == "harmony"
    assert not is_harmony("<|im_start|>assistant\n<think>")
