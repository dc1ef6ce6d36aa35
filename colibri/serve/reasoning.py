"""The thinking switch: whether a chat template has one, and splitting a reasoning model's
`<think>...</think>` text from its answer as it streams (served as `reasoning_content`, as
vLLM and DeepSeek name it, and as Anthropic `thinking` blocks)."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def has_thinking_switch(chat_template: str | None) -> bool:
    """Templates with a switch read the `enable_thinking` variable (Qwen3, GLM, SmolLM3 spell it so)."""
    return bool(chat_template) and "enable_thinking" in chat_template


def always_thinks(chat_template: str | None, generation_prompt: str) -> bool:
    """A template without a switch whose generation prompt (`generation_prompt`, rendered for a
    one-line chat) opens a think block (MiniMax-M2, DeepSeek-R1): its answers are split all the
    same. One that lays out think blocks but opens none (DeepSeek-V3.1 by default) is not."""
    return (bool(chat_template) and CLOSE in chat_template and not has_thinking_switch(chat_template)
            and prompt_opens_thinking(generation_prompt))


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Some templates end the generation prompt inside the think block (the model then writes
    only the reasoning and `</think>`)."""
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningSplitter:
    """Feeds on answer text deltas and returns (reasoning, content) deltas. Text that could still
    become a tag is held back until the next delta decides it, so no tag leaks either way."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.strip_content = False  # the blank lines a model writes after </think> are not answer

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN):], "reasoning"
                    continue
                if OPEN.startswith(head):  # "", "<", "<th"...: not decided yet
                    return reasoning, content
                self.state = "content"
                continue
            if self.state == "reasoning":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state, self.strip_content = self.buf[i + len(CLOSE):], "content", True
                    continue
                keep = _partial_suffix(self.buf, CLOSE)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            if self.strip_content:
                self.buf = self.buf.lstrip()
                self.strip_content = not self.buf
            content += self.buf
            self.buf = ""
            return reasoning, content

    def flush(self) -> tuple[str, str]:
        """What is held back at the end of the answer."""
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest.lstrip() if self.strip_content else rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """The whole answer at once -> (reasoning, content)."""
    s = ReasoningSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.flush()
    return r1 + r2, c1 + c2
