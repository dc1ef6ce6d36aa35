"""OpenAI's harmony response format (gpt-oss): the answer is a run of messages, each
`<|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY` ended by
`<|end|>` (more follows), `<|return|>` (the answer is done) or `<|call|>` (a tool call; the
template's generation prompt already wrote the first `<|start|>assistant`). Channel `analysis`
is the reasoning, `final` the answer, `commentary` a preamble to the user or, addressed
`to=functions.NAME`, a tool call whose body is its JSON arguments. Either the header's
`to=` or one before `<|channel|>` addresses it (the model writes both forms).

HarmonySplitter has ReasoningSplitter's interface (colibri/serve/reasoning.py): fed the text as
it streams, it returns (reasoning, content) deltas; a tool call goes to the content in one
spelling, `<|channel|>commentary to=functions.NAME<|message|>ARGS<|call|>`, for the tool-call
parser's `harmony` format (colibri/serve/tool_calls.py) to read. Text that could still be a
marker is held back until the next delta decides it.
"""
from __future__ import annotations

import re

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)
CALL_PREFIX = CHANNEL + "commentary to=functions."  # the tool-call parser's opener

_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template renders harmony (gpt-oss's template writes channels)."""
    return bool(chat_template) and CHANNEL in chat_template and MESSAGE in chat_template


class HarmonySplitter:
    """(reasoning, content) deltas out of harmony text: see the module docstring."""

    def __init__(self):
        self.buf = ""
        self.kind: str | None = None  # the open message's: "reasoning", "content" or "call"; None: in a header

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.kind is None:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    return "".join(reasoning), "".join(content)
                self.kind, opening = _header(self.buf[:i])
                content.append(opening)
                self.buf = self.buf[i + len(MESSAGE):]
                continue
            # a call's body is JSON, which may quote a marker: only <|call|> ends it
            markers = (CALL,) if self.kind == "call" else ENDS
            ends = [(j, m) for m in markers if (j := self.buf.find(m)) >= 0]
            if ends:
                j, marker = min(ends)
                self._body(self.buf[:j], reasoning, content)
                if self.kind == "call":
                    content.append(CALL)
                self.buf, self.kind = self.buf[j + len(marker):], None
                continue
            keep = max(_partial_suffix(self.buf, m) for m in markers)
            self._body(self.buf[:len(self.buf) - keep], reasoning, content)
            self.buf = self.buf[len(self.buf) - keep:]
            return "".join(reasoning), "".join(content)

    def _body(self, text: str, reasoning: list, content: list) -> None:
        (reasoning if self.kind == "reasoning" else content).append(text)

    def flush(self) -> tuple[str, str]:
        """The end of the answer: the generation stopped on `<|return|>` or `<|call|>`, which
        the text does not hold, so an open call is closed; an unfinished header is dropped."""
        rest, self.buf = self.buf, ""
        if self.kind == "reasoning":
            return rest, ""
        if self.kind == "call":
            rest += CALL
        elif self.kind is None:
            rest = ""
        self.kind = None
        return "", rest


def _header(header: str) -> tuple[str, str]:
    """A message header (the text before `<|message|>`) -> (the body's kind, the text that
    opens it in the content)."""
    recipient = _RECIPIENT.search(header)
    if recipient:
        return "call", f"{CALL_PREFIX}{recipient[1]}{MESSAGE}"
    channel = _CHANNEL_NAME.search(header)
    return ("reasoning" if channel and channel[1] == "analysis" else "content"), ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
