"""`colibri chat`: the conversation logic on a fake backend, the real model in process, a pipe
(non-interactive: plain text), and a real terminal driven through tmux as a person would."""
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from colibri import ColibriError
from colibri.chat_backends import AttachBackend, EngineBackend, TurnStats
from colibri.tui import ChatSession, ChatUI, ReasoningSplitter, StreamPrinter, format_stats, has_markdown, read_message
from requirements import needs

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# ----------------------------------------------------------------------------- pieces

class FakeBackend:
    """Answers with fixed pieces; records what it was sent."""

    def __init__(self, pieces):
        self.pieces = pieces
        self.sent = []
        self.stats = None
        self.resets = 0

    def opens_in_reasoning(self, messages, system):
        return False

    def stream(self, messages, system, max_tokens):
        self.sent.append(([dict(m) for m in messages], system))
        n = 0
        try:
            for p in self.pieces:
                n += 1
                yield p
        finally:
            self.stats = TurnStats(n, "stop", 0.5, prompt_tokens=10 * len(messages), prompt_tokens_reused=5)

    def reset(self):
        self.resets += 1


def test_reasoning_is_split_from_the_answer_across_pieces():
    s = ReasoningSplitter()
    out = []
    for piece in ["<th", "ink>let me ", "see</thi", "nk>\n", "Paris", " <"]:
        out += s.feed(piece)
    out += s.flush()
    joined = {}
    for kind, text in out:
        joined[kind] = joined.get(kind, "") + text
    assert joined == {"reasoning": "let me see", "answer": "Paris <"}
    opened = ReasoningSplitter(in_reasoning=True)
    assert opened.feed("hmm</think>ok") == [("reasoning", "hmm"), ("answer", "ok")]


def test_stats_line_modes():
    s = TurnStats(12, "stop", 2.0, prompt_tokens=80, prompt_tokens_reused=68, ttft_s=0.25, decode_tok_s=6.5,
                  hit_rate=0.93, rss_bytes=400 * 2**20)
    full = format_stats(s, "full")
    assert "6.5 tok/s" in full and "TTFT 0.25 s" in full and "prefilled 12 new of 80 prompt tokens" in full
    assert "experts 93% hit" in full and "RSS 400 MiB" in full and "12 completion tokens" in full
    assert format_stats(s, "compact") == "6.5 tok/s · TTFT 0.25 s · 12 tokens"
    assert format_stats(s, "off") == ""
    stopped = format_stats(TurnStats(5, "interrupted", 1.0, ttft_s=0.2), "full")
    assert "stopped" in stopped and "hit" not in stopped
    on_gpu = format_stats(TurnStats(5, "stop", 1.0, hit_rate=1.0, vram_hit_rate=0.8), "full")  # --device cuda
    assert "experts 80% VRAM hit, 100% RAM hit" in on_gpu
    loading = TurnStats(5, "stop", 1.0, experts_loaded=0.416)  # resident experts still loading behind the answer
    assert format_stats(loading, "full").endswith("experts 42% loaded")
    assert "loaded" in format_stats(loading, "compact") and "loaded" not in full


def test_stream_printer_wraps_words_and_counts_rows():
    out = io.StringIO()
    p = StreamPrinter(out, width=21)  # writes at most 20 columns
    text = "The quick brown fox jumps over the lazy dog.\nSecond line with averyveryverylongwordthatbreaks here"
    for i in range(0, len(text), 3):  # words arrive split across pieces
        p.feed("answer", text[i:i + 3])
    p.finish()
    screen = _replay(out.getvalue())
    assert all(len(row) <= 20 for row in screen)
    assert len(screen) == p.rows
    assert screen[0] == "The quick brown fox"
    assert "".join(screen).replace(" ", "") == text.replace(" ", "").replace("\n", "")


def _replay(raw: str) -> list[str]:
    """A minimal terminal: the rows after text, newlines, cursor-left and erase-to-end-of-line."""
    rows, col = [""], 0
    for tok in re.findall(r"\x1b\[(\d*)([A-Za-z])|(\n)|(.)", raw, flags=re.S):
        n, code, nl, ch = tok
        if nl:
            rows.append("")
            col = 0
        elif ch:
            rows[-1] = rows[-1][:col] + ch + rows[-1][col + 1:]
            col += 1
        elif code == "D":
            col -= int(n or 1)
        elif code == "K":
            rows[-1] = rows[-1][:col]
    return rows


def test_markdown_detection():
    assert has_markdown("Here:\n\n- one\n- two")
    assert has_markdown("use `pip install`") and has_markdown("# Title\ntext") and has_markdown("**bold**")
    assert not has_markdown("The capital of France is Paris.")


def test_markdown_is_drawn_once_the_answer_is_complete():
    from rich.console import Console

    def ui_for(pieces):
        out = io.StringIO()
        console = Console(file=out, force_terminal=True, width=40, height=30, color_system=None)
        return ChatUI(ChatSession(FakeBackend(pieces)), "m", interactive=True, stats_mode="off",
                      console=console, err_console=console), out

    ui, out = ui_for(["# Tips\n\n", "- **one** thing\n", "- two"])
    ui.turn("tips?")
    raw = out.getvalue()
    streamed, _, redrawn = raw.partition("\r\x1b[3A\x1b[J")  # back over the 4 streamed rows, erased once
    assert "**one**" in streamed and redrawn and "**" not in redrawn
    assert "Tips" in redrawn and "• one thing" in redrawn
    ui, out = ui_for(["The capital of France ", "is Paris."])  # plain prose: streamed, never redrawn
    ui.turn("capital?")
    assert "\x1b[J" not in out.getvalue() and "The capital of France is Paris." in out.getvalue()


def test_multiline_input():
    lines = iter(["first \\", "second", '"""', "a", "b", '"""'])
    nxt = lambda prompt: next(lines)  # noqa: E731
    assert read_message(nxt) == "first \nsecond"
    assert read_message(nxt) == "a\nb"


def test_session_history_interrupt_reset_and_save(tmp_path):
    backend = FakeBackend(["Hello", " there", "!"])
    s = ChatSession(backend, system="Be brief.")
    assert "".join(t for _, t in s.ask("hi")) == "Hello there!"
    # an answer stopped early keeps what was said; the next turn sends the whole conversation
    pieces = s.ask("more")
    next(pieces)
    pieces.close()
    assert s.messages[-1] == {"role": "assistant", "content": "Hello"}
    list(s.ask("again"))
    sent, system = backend.sent[-1]
    assert [m["content"] for m in sent] == ["hi", "Hello there!", "more", "Hello", "again"] and system == "Be brief."
    # a turn stopped before any text leaves no trace
    before = list(s.messages)
    empty = ChatSession(FakeBackend([]))
    list(empty.ask("x"))
    assert empty.messages == []
    s.save(tmp_path / "c.json", "m")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["system"] == "Be brief." and saved["messages"] == before
    s.save(tmp_path / "c.md", "m")
    md = (tmp_path / "c.md").read_text()
    assert "## user\n\nhi" in md and "## assistant\n\nHello there!" in md
    s.reset()
    assert s.messages == [] and backend.resets == 1
    with pytest.raises(ColibriError, match="cannot write"):
        s.save(tmp_path / "c.json" / "x.json", "m")


def test_plain_ui_commands(tmp_path, capsys):
    from rich.console import Console

    backend = FakeBackend(["Paris", "."])
    ui = ChatUI(ChatSession(backend), "m", interactive=False, stats_mode="compact",
                err_console=Console(file=sys.stderr, width=200))
    lines = iter(["Capital of France?", "/system Be brief.", "/system", f"/save {tmp_path / 'c.json'}",
                  "/stats", "/stats off", "/bogus", "/reset", "again?", "/exit", "never read"])

    def nxt(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    ui.run(nxt)
    out, err = capsys.readouterr()
    assert out == "Paris.\nParis.\n"  # answers only, plain text
    assert "system: Be brief." in err and "saved 2 messages" in err and "unknown command /bogus" in err
    assert "conversation cleared" in err
    assert "2 tokens" in err.splitlines()[0]  # the compact stats line after the first answer
    assert len(json.loads((tmp_path / "c.json").read_text())["messages"]) == 2
    assert next(lines) == "never read"


# ----------------------------------------------------------------------------- attach

class _SSEHandler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "stub-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("Par", "is."):
            chunk = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 30, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 20}}}
        self.wfile.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())


def test_attach_talks_to_a_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    server.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = AttachBackend(f"http://127.0.0.1:{server.server_port}", {"temperature": 0.0, "top_k": 0})
        assert backend.describe()["model"] == "stub-model"
        s = ChatSession(backend, system="sys", max_tokens=7)
        assert "".join(t for _, t in s.ask("Capital of France?")) == "Paris."
        req = server.requests[-1]
        assert req["stream"] is True and req["max_tokens"] == 7 and "top_k" not in req
        assert req["messages"][0] == {"role": "system", "content": "sys"}
        st = s.last_stats
        assert (st.prompt_tokens, st.prompt_tokens_reused, st.completion_tokens, st.finish_reason) == (30, 20, 2, "stop")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ColibriError, match="cannot reach"):
        AttachBackend(f"http://127.0.0.1:{server.server_port}", {}).describe()


# ----------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def engine(smollm2_container):
    from colibri.engine import Engine

    return Engine.load(smollm2_container)


def test_second_turn_prefills_only_new_tokens(engine):
    engine.reset()
    s = ChatSession(EngineBackend(engine, {"temperature": 0.0}), max_tokens=16)
    first = "".join(t for _, t in s.ask("What is the capital of France?"))
    assert "Paris" in first
    a = s.last_stats
    assert a.prompt_tokens_reused == 0
    second = "".join(t for _, t in s.ask("And of Italy?"))
    assert "Rome" in second
    b = s.last_stats
    assert b.prompt_tokens > a.prompt_tokens + a.completion_tokens
    assert b.prompt_tokens_reused >= a.prompt_tokens  # the whole first turn came from the KV cache
    assert b.prompt_tokens - b.prompt_tokens_reused < 20
    # stopping an answer keeps the cache consistent: the next turn still reuses it
    pieces = s.ask("Tell me a long story about Rome.")
    for _ in range(3):
        next(pieces)
    pieces.close()
    assert s.last_stats.finish_reason == "interrupted"
    list(s.ask("Thanks."))
    c = s.last_stats
    assert c.prompt_tokens_reused >= b.prompt_tokens and c.prompt_tokens - c.prompt_tokens_reused < 20


def colibri_cmd(*args):
    return [sys.executable, "-m", "colibri.cli", *map(str, args)]


def test_piped_chat_prints_plain_text(smollm2_container, tmp_path):
    script = "What is the capital of France?\n/save {0}\nAnd of Italy?\n/reset\n/stats\n".format(tmp_path / "c.json")
    p = subprocess.run(colibri_cmd("chat", "--model", smollm2_container, "-n", "16", "--stats", "full"),
                       input=script, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLIBRI_HOME": str(tmp_path / "home")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[:2] == ["The capital of France is Paris.", "The capital of Italy is Rome."]
    assert not ANSI.search(p.stdout) and not ANSI.search(p.stderr)
    prefills = [tuple(map(int, m)) for m in re.findall(r"prefilled (\d+) new of (\d+) prompt tokens", p.stderr)]
    assert len(prefills) == 3  # two turns, then /stats repeats the last
    assert prefills[0][0] == prefills[0][1] and prefills[1][0] < prefills[1][1] - prefills[0][1]
    assert "saved 2 messages" in p.stderr and "conversation cleared" in p.stderr
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    assert "Paris" in saved["messages"][1]["content"]


@pytest.mark.parametrize("args, needle", [
    (["--model", "{tmp}"], "not a colibri model directory"),
    (["--stats", "loud"], "--stats must be one of"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--kv-cache", "f8"], "--kv-cache must be one of f32, f16, not 'f8'"),
    (["--model", "{tmp}/weights.bin"], "-m takes a model directory (from `colibri convert`) or a .gguf file"),
])
def test_chat_bad_input(tmp_path, args, needle):
    args = [a.format(tmp=tmp_path) for a in args]
    p = subprocess.run(colibri_cmd("chat", *args), input="hi\n", capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLIBRI_HOME": str(tmp_path / "home")})
    assert p.returncode == 1 and "Traceback" not in p.stderr
    msg = " ".join(p.stderr.split())
    assert msg.startswith("error:") and needle in msg


def test_chat_passes_threads_to_the_engine(smollm2_container, monkeypatch):
    """--threads reaches Engine.load (as on run, bench and serve); without it, the engine's default."""
    from typer.testing import CliRunner

    import colibri.tui
    from colibri.cli import app

    seen = []
    monkeypatch.setattr(colibri.tui, "chat", lambda model, **kw: seen.append(kw["engine_options"]))
    for args in (["--threads", "1"], []):
        r = CliRunner().invoke(app, ["chat", "--model", str(smollm2_container), *args])
        assert r.exit_code == 0, r.output
    assert seen[0].get("threads") == 1 and "threads" not in seen[1]


def test_context_overflow_keeps_the_chat_going(smollm2_container, tmp_path):
    script = "word " * 40 + "\n/reset\nWhat is the capital of France?\n"
    p = subprocess.run(colibri_cmd("chat", "--model", smollm2_container, "--max-context", "48", "-n", "8"),
                       input=script, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "context holds 48" in " ".join(p.stderr.split()) and "/reset starts a new conversation" in p.stderr
    assert "Paris" in p.stdout


@pytest.fixture(scope="module")
def upcycled(smollm2_container, tmp_path_factory):
    """SmolLM2 with each FFN turned into 4 identical experts (top-2): a real MoE that speaks."""
    from tools import upcycle

    return upcycle.upcycle(smollm2_container, tmp_path_factory.mktemp("up") / "moe", experts=4, top_k=2)


def test_streamed_experts_show_their_hit_rate(upcycled, tmp_path):
    from colibri.plan import analyze_model

    facts = analyze_model(upcycled)
    one_slot = (facts.dense_bytes + facts.one_expert_per_layer_bytes) / 2**30 + 0.001  # 1 of 4 experts per layer
    p = subprocess.run(colibri_cmd("chat", "--model", upcycled, "--ram-gb", f"{one_slot:.4f}", "-n", "12",
                                   "--stats", "full"),
                       input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True,
                       timeout=300, env={**os.environ, "COLIBRI_HOME": str(tmp_path / "home")})
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "Rome" in p.stdout
    rates = [int(r) for r in re.findall(r"experts (\d+)% hit", p.stderr)]
    assert len(rates) == 2 and all(0 <= r < 100 for r in rates)
    # --auto-tier applies the plan's RAM budget (everything fits here, so nothing streams)
    p = subprocess.run(colibri_cmd("chat", "--model", upcycled, "--auto-tier", "-n", "8", "--stats", "full"),
                       input="What is the capital of France?\n", capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLIBRI_HOME": str(tmp_path / "home")})
    assert p.returncode == 0, p.stderr
    assert "auto-tier: --ram-gb" in p.stderr and "Paris" in p.stdout and "% hit" not in p.stderr


# ----------------------------------------------------------------------------- a real terminal

class Tmux:
    """One pane of a private tmux server (its own socket, no user config)."""

    def __init__(self, name, command, width=100, height=40):
        self.base = ["tmux", "-L", name, "-f", os.devnull]
        subprocess.run([*self.base, "new-session", "-d", "-s", "chat", "-x", str(width), "-y", str(height),
                        f"{command}; echo '[exited]' $?; sleep 60"], check=True)

    def screen(self) -> str:
        return subprocess.run([*self.base, "capture-pane", "-p", "-t", "chat"], capture_output=True,
                              text=True).stdout

    def send(self, *keys):
        subprocess.run([*self.base, "send-keys", "-t", "chat", *keys], check=True)

    def wait_for(self, predicate, timeout=120, what=""):
        end = time.time() + timeout
        while time.time() < end:
            s = self.screen()
            if predicate(s):
                return s
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")

    def close(self):
        subprocess.run([*self.base, "kill-server"], capture_output=True)


@needs(shutil.which("tmux") is not None, "tmux is not installed (apt-get install tmux)")
def test_chat_in_a_real_terminal(smollm2_container, tmp_path):
    """Two turns, a Ctrl-C mid-answer, /save, /reset and Ctrl-D, typed into a tmux pane."""
    home = tmp_path / "home"
    cmd = " ".join([f"COLIBRI_HOME={home}", *colibri_cmd("chat", "--model", smollm2_container, "-n", "300")])
    t = Tmux(f"colibri-test-{os.getpid()}", cmd)
    stats = re.compile(r"tok/s · TTFT [\d.]+ s · prefilled (\d+) new of (\d+) prompt tokens")
    try:
        t.wait_for(lambda s: s.rstrip().endswith(">>>"), what="the prompt")
        assert "colibri chat · model" in t.screen() and "llama" in t.screen() and "loaded in" in t.screen()
        t.send("What is the capital of France?", "Enter")
        t.wait_for(lambda s: len(stats.findall(s)) == 1 and s.rstrip().endswith(">>>"), what="the first answer")
        t.send("And of Italy?", "Enter")
        s = t.wait_for(lambda s: len(stats.findall(s)) == 2 and s.rstrip().endswith(">>>"), what="the second answer")
        assert "The capital of France is Paris." in s and "The capital of Italy is Rome." in s
        (new1, total1), (new2, total2) = [tuple(map(int, m)) for m in stats.findall(s)]
        assert new1 == total1 and new2 < total2 - total1  # the second turn prefilled only its new tokens
        t.send("Write a long story about a dragon who learns to fly.", "Enter")
        t.wait_for(lambda s: "learns to fly." in s and len(s.split("learns to fly.", 1)[1].split()) > 8,
                   what="the story to stream")
        t.send("C-c")
        s = t.wait_for(lambda s: "(stopped" in s and s.rstrip().endswith(">>>"), what="the stop")
        assert "· stopped" in s
        t.send(f"/save {tmp_path / 'chat.md'}", "Enter")
        t.wait_for(lambda s: "saved 6 messages" in s, what="/save")
        t.send("/reset", "Enter")
        t.wait_for(lambda s: "conversation cleared" in s, what="/reset")
        t.send("C-d")
        t.wait_for(lambda s: "[exited] 0" in s, what="the exit")
    finally:
        t.close()
    md = (tmp_path / "chat.md").read_text()
    assert md.count("## user") == 3 and "Paris" in md and "Rome" in md and "dragon" in md
    history = (home / "chat_history").read_text()
    assert "What is the capital of France?" in history and "/reset" in history
