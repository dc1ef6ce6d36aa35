"""`colibri chat`: the terminal chat. Rich for the banner, Markdown and stats; the stdlib
`readline` for line editing and history (kept across sessions in the colibri cache directory).

How an answer is drawn (no flicker, also inside tmux or screen): tokens are written as they
arrive, word-wrapped by StreamPrinter itself one column short of the terminal width, so the
terminal never wraps a line and the printer knows exactly how many rows the answer took. When
the answer is complete and contains Markdown (headings, lists, code, emphasis, tables) and still
fits on the screen, those rows are erased once and the answer is printed again as rendered
Markdown: one redraw per answer, never one per token. Answers taller than the screen, and
interrupted ones, stay as streamed. Reasoning (`<think>...</think>`) is dimmed, kept apart from
the answer in the conversation (`reasoning_content`), and goes to stderr when not interactive.

When stdin or stdout is not a terminal, chat reads stdin line by line (a trailing backslash
continues a message; slash commands work) and prints plain answers to stdout, everything else
to stderr.

The conversation is passed whole on every turn; the engine keeps its KV cache between calls and
reuses the common token prefix, so a turn prefills only its new tokens (the stats line says so).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from colibri.chat_backends import THINK_CLOSE, THINK_OPEN, AttachBackend, EngineBackend, TurnStats
from colibri.errors import ColibriError

STATS_MODES = ("full", "compact", "off")
PROMPT = "\001\x1b[1;32m\002>>> \001\x1b[0m\002"   # \001 \002 tell readline the escapes take no room
CONTINUE = "\001\x1b[2m\002... \001\x1b[0m\002"
HISTORY_FILE = "chat_history"

HELP = """\
/help               this list
/reset              forget the conversation (and its KV cache)
/system [TEXT|-]    show, set, or (with -) clear the system message
/stats [MODE]       the last turn's figures; MODE full, compact or off sets the stats line
/save FILE          write the conversation (FILE.md or .txt: a transcript; else JSON)
/exit               leave (also /quit, Ctrl-D, or Ctrl-C twice)
A line ending in \\ continues on the next line; \"\"\" on its own line starts and ends a block.
Ctrl-C stops an answer and keeps the conversation."""


# ----------------------------------------------------------------------------- figures

def _mb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def format_stats(s: TurnStats, mode: str = "full") -> str:
    """One line of figures for a turn; '' when mode is off."""
    if mode == "off":
        return ""
    parts = [f"{s.tok_s:.1f} tok/s"]
    if s.ttft_s is not None:
        parts.append(f"TTFT {s.ttft_s:.2f} s")
    if mode == "compact":
        parts.append(f"{s.completion_tokens} tokens")
    else:
        if s.prompt_tokens is not None:
            new = s.prompt_tokens - (s.prompt_tokens_reused or 0)
            parts.append(f"prefilled {new} new of {s.prompt_tokens} prompt tokens")
        parts.append(f"{s.completion_tokens} completion tokens")
        if s.vram_hit_rate is not None:
            parts.append(f"experts {s.vram_hit_rate:.0%} VRAM hit, {s.hit_rate or 0:.0%} RAM hit")
        elif s.hit_rate is not None:
            parts.append(f"experts {s.hit_rate:.0%} hit")
        if s.rss_bytes:
            parts.append(f"RSS {_mb(s.rss_bytes)}")
    if s.experts_loaded is not None:
        parts.append(f"experts {s.experts_loaded:.0%} loaded")
    if s.finish_reason == "interrupted":
        parts.append("stopped")
    elif s.finish_reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)


# ----------------------------------------------------------------------------- reasoning

class ReasoningSplitter:
    """Splits streamed text into ("reasoning" | "answer", text) at <think> ... </think>,
    holding back a partial tag split across tokens."""

    def __init__(self, in_reasoning: bool = False):
        self.reasoning = in_reasoning
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out = []
        while True:
            tag = THINK_CLOSE if self.reasoning else THINK_OPEN
            i = self.buf.find(tag)
            if i >= 0:
                if i:
                    out.append(self._piece(self.buf[:i]))
                self.buf = self.buf[i + len(tag):]
                self.reasoning = not self.reasoning
                if not self.reasoning:
                    self.buf = self.buf.lstrip("\n")
                continue
            keep = _partial_suffix(self.buf, tag)
            if len(self.buf) > keep:
                out.append(self._piece(self.buf[: len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return out

    def flush(self) -> list[tuple[str, str]]:
        out = [self._piece(self.buf)] if self.buf else []
        self.buf = ""
        return out

    def _piece(self, text: str) -> tuple[str, str]:
        return ("reasoning" if self.reasoning else "answer", text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ----------------------------------------------------------------------------- the conversation

class ChatSession:
    """The conversation and its commands, apart from any terminal."""

    def __init__(self, backend, system: str | None = None, max_tokens: int = 1024):
        self.backend = backend
        self.system = system
        self.max_tokens = max_tokens
        self.messages: list[dict] = []
        self.last_stats: TurnStats | None = None
        self.turns = 0
        self.tokens = 0

    def ask(self, text: str) -> Iterator[tuple[str, str]]:
        """("reasoning" | "answer", text) pieces. The turn enters the conversation also when it
        is stopped early (what was said so far); a turn stopped before any text is dropped."""
        self.messages.append({"role": "user", "content": text})
        splitter = ReasoningSplitter(self.backend.opens_in_reasoning(self.messages, self.system))
        answer: list[str] = []
        reasoning: list[str] = []
        stream = self.backend.stream(self.messages, self.system, self.max_tokens)
        try:
            for piece in stream:
                for kind, t in splitter.feed(piece):
                    (reasoning if kind == "reasoning" else answer).append(t)
                    yield kind, t
            for kind, t in splitter.flush():
                (reasoning if kind == "reasoning" else answer).append(t)
                yield kind, t
        finally:
            stream.close()
            self.last_stats = self.backend.stats
            if answer or reasoning:
                self.turns += 1
                self.tokens += self.last_stats.completion_tokens if self.last_stats else 0
                reply = {"role": "assistant", "content": "".join(answer)}
                if reasoning:
                    reply["reasoning_content"] = "".join(reasoning)
                self.messages.append(reply)
            else:
                self.messages.pop()

    def reset(self) -> None:
        self.messages = []
        self.backend.reset()

    def save(self, path: str | os.PathLike, model: str) -> Path:
        path = Path(path).expanduser()
        if path.suffix.lower() in (".md", ".txt", ".markdown"):
            lines = [f"# colibri chat with {model}", ""]
            if self.system:
                lines += ["## system", "", self.system, ""]
            for m in self.messages:
                lines += [f"## {m['role']}", ""]
                if m.get("reasoning_content"):
                    lines += ["> " + line for line in m["reasoning_content"].strip().splitlines()] + [""]
                lines += [m["content"], ""]
            text = "\n".join(lines)
        else:
            text = json.dumps({"model": model, "system": self.system, "messages": self.messages,
                               "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2, ensure_ascii=False) + "\n"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise ColibriError(f"cannot write {path} ({e.strerror or e})") from None
        return path


def read_message(next_line: Callable[[str], str]) -> str:
    """One user message: a line, continued while it ends in a backslash, or a \"\"\" block.
    `next_line(prompt)` raises EOFError at the end of input."""
    line = next_line(PROMPT)
    if line.strip() == '"""':
        block = []
        while (more := next_line(CONTINUE)).strip() != '"""':
            block.append(more)
        return "\n".join(block)
    while line.endswith("\\"):
        line = line[:-1] + "\n" + next_line(CONTINUE)
    return line


# ----------------------------------------------------------------------------- drawing

_MARKDOWN = re.compile(r"(^|\n)\s*(#{1,6}\s|[-*+]\s|\d+[.)]\s|>\s|```|\|.*\|)|\*\*[^*\n]+\*\*|`[^`\n]+`|"
                       r"\[[^\]\n]+\]\([^)\n]+\)")
_TOKENS = re.compile(r"\n|[ \t]+|[^\s]+")
DIM, UNDIM = "\x1b[2m", "\x1b[22m"


def has_markdown(text: str) -> bool:
    return bool(_MARKDOWN.search(text))


class StreamPrinter:
    """Writes streamed text word-wrapped to `width - 1` columns (so the terminal itself never
    wraps) and counts the rows it used. A word that grows past the edge is moved to the next
    row (a cursor move back over that word only)."""

    def __init__(self, out, width: int):
        from rich.cells import cell_len

        self.out = out
        self.width = max(width - 1, 8)
        self.cell_len = cell_len
        self.col = 0
        self.rows = 1
        self.word = ""          # the word being written (already on screen)
        self.space = ""         # whitespace seen, not yet written
        self.dim = False

    def feed(self, kind: str, text: str) -> None:
        dim = kind == "reasoning"
        if dim != self.dim:
            self.out.write(DIM if dim else UNDIM)
            self.dim = dim
        for tok in _TOKENS.findall(text):
            if tok == "\n":
                self._newline()
            elif tok[0] in " \t":
                self.word = ""
                self.space += tok.replace("\t", "    ")
            else:
                self._word(tok)
        self.out.flush()

    def _newline(self) -> None:
        self.out.write("\n")
        self.col, self.word, self.space = 0, "", ""
        self.rows += 1

    def _write(self, text: str, cells: int) -> None:
        self.out.write(text)
        self.col += cells

    def _word(self, piece: str) -> None:
        w = self.cell_len(piece)
        if self.space:  # a new word begins
            sw = self.cell_len(self.space)
            if self.col + sw + w <= self.width:
                self._write(self.space, sw)
            elif self.col > 0:
                self._newline()
            self.space = self.word = ""
        elif self.col + w > self.width and self.word and self.cell_len(self.word) + w <= self.width:
            # the word grows past the edge: move what is written of it to the next row
            word, back = self.word, self.cell_len(self.word)
            self.out.write(f"\x1b[{back}D\x1b[K")
            self._newline()
            self._write(word, back)
            self.word = word
        if self.col + w <= self.width:
            self._write(piece, w)
            self.word += piece
            return
        for ch in piece:  # longer than a row: break it anywhere
            cw = self.cell_len(ch)
            if self.col + cw > self.width:
                self._newline()
            self._write(ch, cw)
            self.word += ch

    def finish(self) -> None:
        if self.dim:
            self.out.write(UNDIM)
            self.dim = False
        self.out.flush()


# ----------------------------------------------------------------------------- the loops

class ChatUI:
    """The chat loop over a ChatSession: `interactive` draws with Rich and readline, else
    plain text (answers on stdout, the rest on stderr)."""

    def __init__(self, session: ChatSession, model_label: str, interactive: bool, stats_mode: str,
                 console=None, err_console=None):
        from rich.console import Console

        if stats_mode not in STATS_MODES:
            raise ColibriError(f"--stats must be one of {', '.join(STATS_MODES)}, not {stats_mode!r}")
        self.session = session
        self.model_label = model_label
        self.interactive = interactive
        self.stats_mode = stats_mode
        self.console = console or Console(highlight=False)
        self.err = err_console or Console(stderr=True, highlight=False)
        self.armed = False   # a Ctrl-C was just pressed: the next one at the prompt leaves

    # -- output helpers
    def note(self, text: str) -> None:
        from rich.markup import escape

        if self.interactive:
            self.console.print(f"[dim]{escape(text)}[/dim]", highlight=False)
        else:
            self.err.print(text, markup=False, highlight=False, soft_wrap=True)

    def error(self, text: str) -> None:
        from rich.markup import escape

        self.err.print(f"[bold red]error:[/bold red] {escape(text)}", highlight=False, soft_wrap=not self.interactive)

    def banner(self, facts: dict) -> None:
        from rich.markup import escape

        parts = [f"[bold]{escape(facts['model'])}[/bold]", escape(facts["family"])]
        if facts.get("quant"):
            parts.append(facts["quant"])
        if facts.get("weights_bytes") is not None:
            parts.append(f"weights {_mb(facts['weights_bytes'])}")
        if facts.get("streaming"):
            parts.append("experts streamed from disk")
        if facts.get("rss_bytes"):
            parts.append(f"resident {_mb(facts['rss_bytes'])}")
        if facts.get("load_s") is not None:
            parts.append(f"loaded in {facts['load_s']:.1f} s")
        self.console.print("colibri chat · " + " · ".join(parts), highlight=False)
        self.console.print("[dim]/help for commands · Ctrl-C stops an answer · Ctrl-D leaves[/dim]")

    # -- the loop
    def run(self, next_line: Callable[[str], str]) -> None:
        while True:
            try:
                text = read_message(next_line)
            except EOFError:
                if self.interactive:
                    self.console.print()
                return
            except KeyboardInterrupt:
                if not self.interactive or self.armed:
                    if self.interactive:
                        self.console.print()
                    return
                self.armed = True
                self.console.print("\n[dim](Ctrl-C again or Ctrl-D to leave)[/dim]")
                continue
            self.armed = False
            text = text.strip()
            if not text:
                continue
            if text.startswith("/"):
                if not self.command(text):
                    return
                continue
            self.turn(text)

    def turn(self, text: str) -> None:
        printer = StreamPrinter(self.console.file, self.console.width) if self.interactive else None
        answer, reasoning = [], []
        pieces = self.session.ask(text)
        stopped = False
        try:
            for kind, piece in pieces:
                (reasoning if kind == "reasoning" else answer).append(piece)
                if printer:
                    printer.feed(kind, piece)
                elif kind == "reasoning":
                    sys.stderr.write(piece)
                    sys.stderr.flush()
                else:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            stopped = True
            self.armed = True
        except ColibriError as e:
            if printer:
                printer.finish()
                self.console.file.write("\n")
            self.error(f"{e}; /reset starts a new conversation" if "context" in str(e) else str(e))
            return
        finally:
            pieces.close()
        if printer:
            printer.finish()
            self._finish_answer(printer, "".join(answer), "".join(reasoning), stopped)
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            if reasoning:
                sys.stderr.write("\n")
        stats = self.session.last_stats
        line = format_stats(stats, self.stats_mode) if stats else ""
        if self.interactive:
            if stopped:
                self.console.print("[dim](stopped; Ctrl-C again or Ctrl-D to leave)[/dim]")
            if line:
                self.console.print(f"[dim]{line}[/dim]", highlight=False)
        elif line:
            self.err.print(line, highlight=False, markup=False, soft_wrap=True)

    def _finish_answer(self, printer: StreamPrinter, answer: str, reasoning: str, stopped: bool) -> None:
        from rich.markdown import Markdown
        from rich.text import Text

        out = self.console.file
        if not stopped and has_markdown(answer) and printer.rows < self.console.height - 2:
            out.write(f"\r\x1b[{printer.rows - 1}A\x1b[J" if printer.rows > 1 else "\r\x1b[J")
            out.flush()
            if reasoning.strip():
                self.console.print(Text(reasoning.strip(), style="dim"))
            self.console.print(Markdown(answer))
        else:
            out.write("\n")
            out.flush()

    def command(self, line: str) -> bool:
        """Run a slash command; False means leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        s = self.session
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name in ("/help", "/?"):
            if self.interactive:
                self.console.print(HELP, markup=False, highlight=False)
            else:
                self.note(HELP)
        elif name == "/reset":
            s.reset()
            self.note("conversation cleared")
        elif name == "/system":
            if not arg:
                self.note(f"system: {s.system}" if s.system else "no system message")
            else:
                s.system = None if arg == "-" else arg
                self.note("system message cleared" if s.system is None else "system message set")
        elif name == "/stats":
            if arg:
                if arg not in STATS_MODES:
                    self.error(f"/stats takes one of {', '.join(STATS_MODES)}, not {arg!r}")
                else:
                    self.stats_mode = arg
                    self.note(f"stats line: {arg}")
            else:
                last = format_stats(s.last_stats, "full") if s.last_stats else "no turn yet"
                self.note(f"{last}\nsession: {s.turns} turns, {s.tokens} tokens generated, "
                          f"{len(s.messages)} messages held")
        elif name == "/save":
            if not arg:
                self.error("/save needs a file name, e.g. /save chat.md or /save chat.json")
            else:
                try:
                    path = s.save(arg, self.model_label)
                    self.note(f"saved {len(s.messages)} messages to {path}")
                except ColibriError as e:
                    self.error(str(e))
        else:
            self.error(f"unknown command {name}; /help lists them")
        return True


def _readline_input(history: Path) -> Callable[[str], str]:
    """input() with line editing and a history file shared across sessions."""
    try:
        import readline
    except ImportError:  # not every platform ships it
        return input
    import atexit

    readline.set_history_length(2000)
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except OSError:
        return input

    def save() -> None:
        try:
            readline.write_history_file(history)
        except OSError:
            pass

    atexit.register(save)
    return input


def _stdin_lines(prompt: str) -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def chat(model=None, attach: str | None = None, system: str | None = None, max_tokens: int = 1024,
         stats: str | None = None, sampling: dict | None = None, engine_options: dict | None = None,
         interactive: bool | None = None) -> None:
    """`colibri chat`: load the model (or attach to a server) and talk until the user leaves."""
    from colibri.default_model import cache_root

    if max_tokens < 1:
        raise ColibriError(f"--max-tokens must be at least 1, not {max_tokens}")
    if interactive is None:
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
    stats_mode = stats or ("full" if interactive else "off")
    if stats_mode not in STATS_MODES:
        raise ColibriError(f"--stats must be one of {', '.join(STATS_MODES)}, not {stats_mode!r}")
    sampling = dict(sampling or {})
    if attach:
        backend = AttachBackend(attach, sampling)
    else:
        from colibri.engine import Engine

        if interactive:  # the global console, so progress bars inside load nest under the spinner
            from rich import get_console

            with get_console().status("loading the model...", spinner="dots"):
                engine = Engine.load(model, progress=True, **(engine_options or {}))
        else:
            engine = Engine.load(model, progress=False, **(engine_options or {}))
        backend = EngineBackend(engine, sampling)
    facts = backend.describe()
    session = ChatSession(backend, system=system, max_tokens=max_tokens)
    ui = ChatUI(session, facts["model"], interactive, stats_mode)
    if interactive:
        ui.banner(facts)
        next_line = _readline_input(cache_root() / HISTORY_FILE)
    else:
        next_line = _stdin_lines
    try:
        ui.run(next_line)
    finally:
        if not attach:
            engine.close()
