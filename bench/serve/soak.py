"""Soak: `colibri serve --max-batch 8` on a streamed MoE (its --ram-gb below the experts' size)
under mixed traffic for --minutes, beside a second `colibri serve --max-batch 8 --cluster local`
whose expert worker is SIGKILLed half-way. Benchmark only: it prints and reports, and its exit
status says whether the soak held (the probe's tokens unchanged, no unexpected error, both
servers alive to the end).

Traffic, from client threads each on an address of its own (127.0.0.x: the per-address cap is 8):
chat and streamed chat (openai), messages and streamed messages (anthropic), forced tool calls
(both APIs, some streamed), response_format json_schema, n = 3, clients that leave mid-stream,
and malformed requests (bad JSON, wrong types, a 5 MiB body, a foreign Origin, both framings,
...), each of which must get its 4xx; at a quarter of the run a slowloris wave (header drippers
from 8 more addresses, each under the per-address cap, reopened as soon as closed). A fixed
greedy probe (32 tokens with logprobs) at start, every --probe-every seconds, right after the
kill and at the end, on both servers: its tokens must be the first probe's. Every --sample-s the
servers' RSS, open files and threads (/proc/PID).

    python -m bench.serve.soak                                      # 30 minutes, the tiny synthetic MoE
    flock /tmp/bench.lock python -m bench.serve.soak --json /tmp/soak.json
    python -m bench.serve.soak --minutes 0.3 --sample-s 1 --json -  # a smoke run (tests/serve/test_soak_smoke.py)
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import httpx

from bench.common import REPO, add_json_arg, child_env, machine_line, write_json

GiB = 1 << 30
MODEL_ID = "m"
TIMEOUT_S = 300.0
MAX_TOKENS = 256        # the servers' --max-tokens
PROBE = {"model": MODEL_ID, "prompt": "The history of the printing press", "max_tokens": 32, "temperature": 0,
         "ignore_eos": True, "logprobs": 1}
TOPICS = ["the history of the printing press", "how a steam engine works", "the life cycle of a star",
          "why the sky is blue", "how bees make honey", "the rules of chess", "how vaccines work",
          "the water cycle", "the causes of the tides", "how a bicycle stays upright"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                  "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string", "enum": CITIES}},
                                                      "required": ["city"], "additionalProperties": False}}}]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]
REPORT_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": CITIES},
    "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50},
    "sky": {"type": "string", "enum": ["clear", "cloudy", "rain", "snow"]}},
    "required": ["city", "temperature_c", "sky"], "additionalProperties": False}
# How often each kind comes up in a client's deck (every kind at least once per deck).
KINDS = {"chat": 3, "chat_stream": 3, "messages": 2, "messages_stream": 2, "tools": 3, "json_schema": 2,
         "n3": 1, "leave": 2, "malformed": 3}


# -- processes -------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def can_bind(addr: str) -> bool:
    """Linux routes all of 127.0.0.0/8 to loopback: other addresses there stand for other clients."""
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


class Server:
    """A `colibri serve` child process, its log in a file."""

    def __init__(self, name: str, cmd: list[str], env: dict, log: Path):
        self.name, self.cmd, self.log_path = name, cmd, log
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        self.exit_code: int | None = None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} server did not answer /health in {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 3000) -> str:
        return self.log_text()[-n:]

    def stop(self) -> int | None:
        """SIGTERM (the server drains), then SIGKILL after 3 minutes. The exit status, or None
        where the server had died before (its status is kept in `died`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.exit_code = self.proc.wait(180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.exit_code = self.proc.wait(30)
        self._log.close()
        return self.exit_code


def proc_figures(pid: int) -> dict | None:
    """RSS (MB), open file descriptors and threads of a live process, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "fds": fds, "threads": int(fields["Threads"])}


def descendants(pid: int) -> list[int]:
    children = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children[todo.pop()]:
            out.append(c)
            todo.append(c)
    return out


def expert_workers(pid: int) -> list[int]:
    """The Ray expert workers under a `--cluster local` server (Ray titles them ray::ExpertWorker)."""
    found = []
    for p in descendants(pid):
        try:
            if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"ray::ExpertWorker"):
                found.append(p)
        except OSError:
            pass
    return sorted(found)


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


# -- outcomes --------------------------------------------------------------------------------

class BadOutput(Exception):
    """A 200 whose content is wrong: a forced tool call missing, JSON that does not parse, ..."""


def classify(e: BaseException) -> tuple[str, bool]:
    """(class, expected) of a well-formed request's failure: 429 and 503 (with Retry-After) are
    the server's designed answers to load; anything else is unexpected."""
    status = getattr(e, "status_code", None)
    if status is None and isinstance(e, httpx.HTTPStatusError):
        status = e.response.status_code
    if status is not None:
        return str(status), status in (429, 503)
    if isinstance(e, BadOutput):
        return "bad output", False
    name = type(e).__name__
    cause = e.__cause__ or e.__context__
    if "Timeout" in name or isinstance(e, (httpx.TimeoutException, socket.timeout)):
        return "timeout", False
    if "Connection" in name or isinstance(e, (httpx.TransportError, OSError)):
        return f"connection error ({type(cause).__name__ if cause is not None else name})", False
    return name, False


class Row(NamedTuple):
    t: float                # when it was sent, seconds into the soak
    server: str
    kind: str
    seconds: float          # until its answer was read (or the client left)
    outcome: str            # "ok", a status code, or a failure's class
    expected: bool | None   # a refusal the request asked for (None: ok)
    detail: str
    note: str | None        # a finish reason


class Record:
    """Every request's outcome, from all client threads."""

    def __init__(self, t0: float):
        self.t0, self.rows, self.lock = t0, [], threading.Lock()

    def add(self, server: str, kind: str, start: float, outcome: str = "ok", expected: bool | None = None,
            detail: str = "", note: str | None = None) -> None:
        with self.lock:
            self.rows.append(Row(start - self.t0, server, kind, time.monotonic() - start, outcome, expected, detail,
                                 note))


# -- clients ---------------------------------------------------------------------------------

def _own_httpx(lib):
    """The httpx the official client is built on (openai and anthropic 3.x ship `httpx2`): a
    client bound to a source address must be of that module."""
    base = next(k for k in lib.DefaultHttpxClient.__mro__[1:] if k.__module__ != lib.__name__)
    return importlib.import_module(base.__module__.split(".")[0])


def malformed_cases(big_body: bytes) -> list[tuple[str, str, bytes, dict, set[int]]]:
    """(name, path, body, extra headers, the statuses it may get): each a user's mistake the
    server must refuse with a 4xx (tests/serve/test_bad_input.py, test_security.py)."""
    chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

    def j(**patch) -> bytes:
        return json.dumps({**chat, **patch}).encode()

    return [
        ("bad JSON", "/v1/chat/completions", b'{"model": "m", "messages": [', {}, {400}),
        ("messages not a list", "/v1/chat/completions", j(messages="hi"), {}, {400}),
        ("max_tokens a string", "/v1/chat/completions", j(max_tokens="5"), {}, {400}),
        ("temperature out of range", "/v1/chat/completions", j(temperature=-1), {}, {400}),
        ("max_tokens over the cap", "/v1/chat/completions", j(max_tokens=10 ** 9), {}, {400}),
        ("n over 16", "/v1/chat/completions", j(n=17), {}, {400}),
        ("unknown field", "/v1/chat/completions", j(unknown_field=1), {}, {400}),
        ("unknown model", "/v1/chat/completions", j(model="gpt-4o"), {}, {404}),
        ("nested brackets", "/v1/completions", b"[" * 5000 + b"]" * 5000, {}, {400}),
        ("bad tool schema", "/v1/chat/completions",
         j(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]), {}, {400}),
        ("anthropic content a number", "/v1/messages",
         json.dumps({"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}).encode(),
         {}, {400}),
        ("text/plain body", "/v1/chat/completions", j(), {"content-type": "text/plain"}, {415}),
        ("foreign Origin", "/v1/chat/completions", j(), {"origin": "http://evil.example"}, {403}),
        ("5 MiB body", "/v1/chat/completions", big_body, {}, {413}),
        ("both framings", "/v1/chat/completions", b"", {}, {400}),  # raw socket: Content-Length and chunked
    ]


class Client(threading.Thread):
    """One client address sending a shuffled deck of request kinds, in turn, until stopped."""

    def __init__(self, server: Server, source: str, seed: int, stop: threading.Event, record: Record,
                 cases: list, think_s: float):
        super().__init__(daemon=True, name=f"client-{server.name}-{source}")
        import anthropic
        import openai

        self.server, self.source, self.stop, self.record, self.cases, self.think_s = \
            server, source, stop, record, cases, think_s
        self.rng = random.Random(seed)
        self.deck = [k for k, w in KINDS.items() for _ in range(w)]
        self.rng.shuffle(self.deck)
        self.case = seed  # which malformed case comes next
        self.lib: str | None = None  # the client library a request went through ...
        self.used_at: dict[str, float] = {}  # ... and when each one's pooled connection last finished a request (a failure's detail says how long it was idle)
        ox, ax = _own_httpx(openai), _own_httpx(anthropic)
        self.oa = openai.OpenAI(base_url=server.url + "/v1", api_key="soak", max_retries=0, timeout=TIMEOUT_S,
                                http_client=openai.DefaultHttpxClient(transport=ox.HTTPTransport(local_address=source)))
        self.an = anthropic.Anthropic(base_url=server.url, api_key="soak", max_retries=0, timeout=TIMEOUT_S,
                                      http_client=anthropic.DefaultHttpxClient(
                                          transport=ax.HTTPTransport(local_address=source)))
        self.http = httpx.Client(base_url=server.url, timeout=TIMEOUT_S,
                                 transport=httpx.HTTPTransport(local_address=source))

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            kind = self.deck[i % len(self.deck)]
            i += 1
            start = time.monotonic()
            self.lib = None
            try:
                result = getattr(self, kind)()
            except Exception as e:  # noqa: BLE001 - every failure is counted by class
                outcome, expected = classify(e)
                idle = start - self.used_at[self.lib] if self.lib in self.used_at else None
                self.record.add(self.server.name, kind, start, outcome, expected,
                                f"{type(e).__name__}: {e}"[:300] + ("" if idle is None else f" (idle {idle:.2f} s)"))
                self.used_at.pop(self.lib, None)  # the pool drops a failed connection
            else:
                if self.lib is not None:
                    self.used_at[self.lib] = time.monotonic()
                if kind == "malformed":
                    name, status, allowed = result
                    self.record.add(self.server.name, kind, start, str(status), status in allowed, name)
                else:
                    self.record.add(self.server.name, kind, start, note=result)
            if self.think_s:
                self.stop.wait(self.rng.expovariate(1 / self.think_s))
        for c in (self.oa, self.an, self.http):
            c.close()

    # Each kind returns a note (a finish reason) or raises; malformed returns (case, status, allowed).
    def _messages(self) -> list[dict]:
        topic = self.rng.choice(TOPICS)
        msgs = [{"role": "user", "content": f"Tell me about {topic}."}]
        if self.rng.random() < 0.3:  # a follow-up turn: the KV slot holding the first turn is reused
            msgs += [{"role": "assistant", "content": f"{topic.capitalize()} is a long story."},
                     {"role": "user", "content": "Go on, in more detail."}]
        return msgs

    def _tokens(self) -> int:
        return self.rng.randint(8, 48)

    def chat(self):
        self.lib = "openai"
        system = [{"role": "system", "content": "You are terse."}] if self.rng.random() < 0.5 else []
        r = self.oa.chat.completions.create(model=MODEL_ID, messages=system + self._messages(),
                                            max_tokens=self._tokens(), temperature=self.rng.choice([0, 0.7]),
                                            seed=self.rng.randrange(2 ** 32))
        if not r.choices or r.usage is None or r.usage.completion_tokens < 1:
            raise BadOutput(f"no completion: {r}")
        return r.choices[0].finish_reason

    def chat_stream(self):
        self.lib = "openai"
        stream = self.oa.chat.completions.create(model=MODEL_ID, messages=self._messages(), max_tokens=self._tokens(),
                                                 temperature=0.7, seed=self.rng.randrange(2 ** 32), stream=True,
                                                 stream_options={"include_usage": True})
        finish, usage, chunks = None, None, 0
        for chunk in stream:
            if chunk.choices:
                chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None or finish is None or chunks < 2:
            raise BadOutput(f"stream ended without a finish reason or usage ({chunks} chunks)")
        return finish

    def messages(self):
        self.lib = "anthropic"
        r = self.an.messages.create(model=MODEL_ID, max_tokens=self._tokens(), messages=self._messages(),
                                    system="You are terse." if self.rng.random() < 0.5 else "",
                                    extra_body={"temperature": self.rng.choice([0.0, 0.7])})
        if r.usage.output_tokens < 1 or r.stop_reason is None:
            raise BadOutput(f"no answer: {r}")
        return r.stop_reason

    def messages_stream(self):
        self.lib = "anthropic"
        with self.an.messages.stream(model=MODEL_ID, max_tokens=self._tokens(), messages=self._messages(),
                                     extra_body={"temperature": 0.7}) as s:
            for _ in s.text_stream:
                pass
            final = s.get_final_message()
        if final.usage.output_tokens < 1 or final.stop_reason is None:
            raise BadOutput(f"no answer: {final}")
        return final.stop_reason

    def tools(self):
        city = self.rng.choice(CITIES)
        ask = [{"role": "user", "content": f"What is the weather in {city}?"}]
        if self.rng.random() < 0.5:
            return self._anthropic_tools(ask)
        self.lib = "openai"
        choice = self.rng.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
        if self.rng.random() < 0.4:  # streamed: the call arrives as delta.tool_calls
            calls: dict[int, dict] = {}
            finish = None
            for chunk in self.oa.chat.completions.create(model=MODEL_ID, messages=ask, tools=OPENAI_TOOLS,
                                                         tool_choice=choice, max_tokens=64, stream=True):
                if not chunk.choices:
                    continue
                finish = chunk.choices[0].finish_reason or finish
                for d in chunk.choices[0].delta.tool_calls or []:
                    c = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    c["name"] += (d.function.name or "") if d.function else ""
                    c["arguments"] += (d.function.arguments or "") if d.function else ""
            got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        else:
            r = self.oa.chat.completions.create(model=MODEL_ID, messages=ask, tools=OPENAI_TOOLS, tool_choice=choice,
                                                max_tokens=64, temperature=0.7, seed=self.rng.randrange(2 ** 32))
            finish = r.choices[0].finish_reason
            got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []]
        if not got:
            raise BadOutput(f"a forced tool call is missing (finish_reason {finish})")
        for name, arguments in got:
            args = json.loads(arguments)
            if name not in ("get_weather", "get_time") or args.get("city") not in CITIES:
                raise BadOutput(f"a call outside the tools' schemas: {name} {arguments}")
        if isinstance(choice, dict) and got[0][0] != "get_weather":
            raise BadOutput(f"the named tool was not called: {got}")
        return finish

    def _anthropic_tools(self, ask):
        self.lib = "anthropic"
        choice = self.rng.choice([{"type": "any"}, {"type": "tool", "name": "get_weather"}])
        r = self.an.messages.create(model=MODEL_ID, max_tokens=64, messages=ask, tools=ANTHROPIC_TOOLS,
                                    tool_choice=choice)
        uses = [b for b in r.content if b.type == "tool_use"]
        if not uses or any(u.input.get("city") not in CITIES for u in uses):
            raise BadOutput(f"a forced tool_use is missing or outside its schema ({r.stop_reason}): {r.content}")
        return r.stop_reason

    def json_schema(self):
        self.lib = "openai"
        r = self.oa.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": f"The weather in {self.rng.choice(CITIES)}, as JSON."}],
            max_tokens=96, temperature=0.7, seed=self.rng.randrange(2 ** 32),
            response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT_SCHEMA,
                                                                    "strict": True}})
        finish, text = r.choices[0].finish_reason, r.choices[0].message.content
        if finish == "stop":  # cut at max_tokens ("length") cannot parse; a finished one must
            report = json.loads(text)
            if report.get("city") not in CITIES or set(report) != set(REPORT_SCHEMA["properties"]):
                raise BadOutput(f"output outside the schema: {text!r}")
        return finish

    def n3(self):
        self.lib = "openai"
        r = self.oa.chat.completions.create(model=MODEL_ID, messages=self._messages(), max_tokens=self._tokens(),
                                            n=3, temperature=0.9, seed=self.rng.randrange(2 ** 32))
        if sorted(c.index for c in r.choices) != [0, 1, 2]:
            raise BadOutput(f"n=3 gave choices {[c.index for c in r.choices]}")
        return r.choices[0].finish_reason

    def leave(self):
        """Read three events of a long stream, then close the connection."""
        anthropic_api = self.rng.random() < 0.4
        self.lib = "httpx"
        body = {"model": MODEL_ID, "messages": self._messages(), "max_tokens": MAX_TOKENS, "stream": True,
                "ignore_eos": True}
        if anthropic_api:
            body.pop("ignore_eos")
        with self.http.stream("POST", "/v1/messages" if anthropic_api else "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise httpx.HTTPStatusError(f"{r.status_code}: {r.text[:200]}", request=r.request, response=r)
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    break
        self.used_at.pop("httpx", None)  # leaving closed the connection
        self.lib = None
        if seen < 3:
            raise BadOutput(f"the stream ended after {seen} events")
        return "left"

    def malformed(self):
        name, path, body, headers, allowed = self.cases[self.case % len(self.cases)]
        self.case += 1
        if name == "both framings":
            return name, self._both_framings(), allowed
        self.lib = "httpx"
        r = self.http.post(path, content=body, headers={"content-type": "application/json", **headers})
        return name, r.status_code, allowed

    def _both_framings(self) -> int | str:
        """Content-Length and Transfer-Encoding together: a 400, and the connection closed."""
        with socket.socket() as s:
            s.bind((self.source, 0))
            s.settimeout(30)
            s.connect(("127.0.0.1", self.server.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
                      b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
            head = b""
            while b"\r\n" not in head:
                data = s.recv(4096)
                if not data:
                    break
                head += data
        return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else "closed without an answer"


def probe(server: Server) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=PROBE, timeout=TIMEOUT_S)
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"]}


# -- the slowloris wave ----------------------------------------------------------------------

class SlowlorisWave(threading.Thread):
    """`per_address` header drippers from each of `sources` (each under the per-address cap),
    every one reopened as soon as the server closes it; what each close said is counted.
    Once `stop` is set none is reopened, and those still open keep dripping until the server
    cuts them off or `drain_s` passes (`uncut`: how many it never closed). So every dripper of
    the wave meets the header deadline, however late a busy machine fires it."""

    def __init__(self, port: int, sources: list[str], per_address: int, drain_s: float, every: float = 0.5):
        super().__init__(daemon=True, name="slowloris")
        self.port, self.sources, self.per_address, self.every = port, sources, per_address, every
        self.drain_s = drain_s
        self.stop = threading.Event()
        self.opened, self.closes, self.uncut = 0, Counter(), 0
        self.sel = selectors.DefaultSelector()

    def _open(self, source: str) -> None:
        s = socket.socket()
        s.bind((source, 0))
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", self.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        except OSError:
            pass  # refused at once: the selector sees it closed
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, source)
        self.opened += 1

    def run(self) -> None:
        for source in self.sources:
            for _ in range(self.per_address):
                self._open(source)
        last, drain_until = time.monotonic(), None
        while self.sel.get_map():
            if self.stop.is_set():
                drain_until = drain_until or time.monotonic() + self.drain_s
                if time.monotonic() >= drain_until:
                    break
            for key, _ in self.sel.select(timeout=0.05):
                try:
                    data = key.fileobj.recv(64)
                    said = data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else ("closed" if not data else "?")
                except OSError as e:
                    said = type(e).__name__
                self.closes[said] += 1
                self.sel.unregister(key.fileobj)
                key.fileobj.close()
                if not self.stop.is_set():
                    self._open(key.data)
            if time.monotonic() - last >= self.every:
                last = time.monotonic()
                for key in list(self.sel.get_map().values()):
                    try:
                        key.fileobj.send(b"x-drip: 1\r\n")
                    except OSError:
                        pass
        self.uncut = len(self.sel.get_map())
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()


# -- the run ---------------------------------------------------------------------------------

def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summary_of(samples: list[dict], key: str) -> dict:
    vals = [s[key] for s in samples]
    if not vals:
        return {}
    # the drift of the second half, per hour (a leak shows as a steady slope)
    half = samples[len(samples) // 2:]
    slope = 0.0
    if len(half) >= 2 and half[-1]["t"] > half[0]["t"]:
        ts, vs = [s["t"] for s in half], [s[key] for s in half]
        mt, mv = statistics.fmean(ts), statistics.fmean(vs)
        var = sum((t - mt) ** 2 for t in ts)
        slope = sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / var * 3600 if var else 0.0
    return {"first": vals[0], "median": statistics.median(vals), "last": vals[-1], "max": max(vals),
            "second_half_per_hour": slope}


def make_model(work: Path, preset: str) -> Path:
    from tools import synthetic_moe

    return synthetic_moe.write_container(work / f"soak-{preset}", preset, progress=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="a MoE container (default: the synthetic --preset, "
                                                             "written under --work)")
    ap.add_argument("--preset", default="tiny", help="tools.synthetic_moe preset when no --model (default tiny)")
    ap.add_argument("--minutes", type=float, default=30.0, help="traffic time (default 30)")
    ap.add_argument("--clients", type=int, default=6, help="client threads on the streamed server (default 6)")
    ap.add_argument("--cluster-clients", type=int, default=2, help="client threads on the cluster server (default 2)")
    ap.add_argument("--workers", type=int, default=2, help="--expert-workers of the cluster server (default 2)")
    ap.add_argument("--no-cluster", action="store_true", help="no --cluster local server (no worker killed)")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--ram-gb", type=float, default=None,
                    help="the servers' --ram-gb (default: the dense weights and a third of the experts)")
    ap.add_argument("--threads", type=int, default=1, help="kernel threads per server (default 1: two servers, "
                                                           "Ray's workers and the clients share the cores)")
    ap.add_argument("--think-s", type=float, default=0.2, help="mean pause between a client's requests")
    ap.add_argument("--probe-every", type=float, default=60.0, help="seconds between probes (default 60)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS/fd/thread samples")
    ap.add_argument("--wave-s", type=float, default=60.0, help="the slowloris wave's length (at most a fifth "
                                                               "of the run)")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="the servers' --header-timeout (default "
                                                                         "10, theirs): when the wave's drippers hear 408")
    ap.add_argument("--wave-addresses", type=int, default=8)
    ap.add_argument("--wave-per-address", type=int, default=7, help="drippers per address (the cap is 8)")
    ap.add_argument("--work", type=Path, default=None, help="model, state and logs here (default: a temporary "
                                                            "directory, removed unless the soak failed)")
    add_json_arg(ap)
    a = ap.parse_args()
    # the report on stdout (--json -) stays parseable: the tables go to stderr then
    out = sys.stderr if a.json == "-" else sys.stdout

    def say(*args, **kw):
        print(*args, **kw, file=out, flush=True)

    say(machine_line())
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    say(f"# commit {commit}")
    work = a.work or Path(tempfile.mkdtemp(prefix="colibri-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or make_model(work, a.preset)
    from colibri.io.container import Container

    c = Container(model)
    if not c.expert_layouts:
        raise SystemExit(f"{model} has no routed experts: the soak streams a MoE's experts")
    ram_gb = a.ram_gb or (c.dense_bytes + c.expert_bytes / 3) / GiB
    env = child_env({**os.environ, "NUMBA_NUM_THREADS": str(a.threads), "OMP_NUM_THREADS": str(a.threads)})
    env.pop("COLI_MAX_BATCH", None)
    base = [sys.executable, "-m", "colibri.cli", "serve", "--model", str(model), "--model-id", MODEL_ID,
            "--max-batch", str(a.max_batch), "--ram-gb", f"{ram_gb:.6f}", "--threads", str(a.threads),
            "--max-tokens", str(MAX_TOKENS), "--header-timeout", str(a.header_timeout), "--log-level", "warning"]
    specs = [("streamed", base + ["--state-dir", str(work / "state-streamed")])]
    if not a.no_cluster:
        specs.append(("cluster", base + ["--state-dir", str(work / "state-cluster"), "--cluster", "local",
                                         "--expert-workers", str(a.workers)]))
    say(f"model {model} ({c.dense_bytes / 2**20:.1f} MiB dense, {c.expert_bytes / 2**20:.2f} MiB of experts); "
        f"--ram-gb {ram_gb:.4f}: {max(0, ram_gb * GiB - c.dense_bytes) / c.expert_bytes:.0%} of the experts fit")
    servers: dict[str, Server] = {}
    failed = True
    try:
        for name, cmd in specs:  # started together: each compiles or loads its kernels meanwhile
            servers[name] = Server(name, cmd + ["--port", str(free_port())], env, work / f"{name}.log")
        for s in servers.values():
            s.wait_ready(900)
            say(f"{s.name}: {' '.join(s.cmd[2:])} (pid {s.pid})")
        report = soak(a, servers, say)
        failed = not report["ok"]
    finally:
        for s in servers.values():
            s.stop()
        if failed or a.work:
            say(f"logs and state kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report["servers"] = {n: {"cmd": s.cmd[2:], "exit_code": s.exit_code, **report["servers"].get(n, {})}
                         for n, s in servers.items()}
    say("servers stopped (SIGTERM, drained): exit status " + ", ".join(f"{n} {s.exit_code}" for n, s in servers.items()))
    for n, s in servers.items():
        if s.exit_code != 0:
            report["unexpected"][f"exit status {s.exit_code} ({n})"] = 1
            report["ok"] = False
            say(f"soak FAILED: the {n} server did not drain and exit cleanly")
    write_json(a.json, {"commit": commit, "model": str(model), "ram_gb": ram_gb, **report}, args=a)
    return 0 if report["ok"] else 1


def soak(a, servers: dict[str, Server], say) -> dict:
    duration = a.minutes * 60
    local = can_bind("127.0.0.2")
    src = iter(f"127.0.0.{10 + i}" if local else "127.0.0.1" for i in range(200))
    main_srv, cluster = servers["streamed"], servers.get("cluster")
    probes: list[dict] = []

    def run_probe(s: Server, when: str) -> None:
        try:
            p = probe(s)
        except Exception as e:  # noqa: BLE001
            probes.append({"server": s.name, "when": when, "error": f"{type(e).__name__}: {e}"[:300]})
            return
        ref = probes[0] if probes and "tokens" in probes[0] else p
        probes.append({"server": s.name, "when": when, "tokens": p["tokens"], "logprobs": p["logprobs"],
                       "identical": p["tokens"] == ref["tokens"],
                       "max_logprob_diff": max(abs(x - y) for x, y in zip(p["logprobs"], ref["logprobs"]))})

    for s in servers.values():
        run_probe(s, "start")
    big = json.dumps({"model": MODEL_ID, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode()
    cases = malformed_cases(big)
    t0 = time.monotonic()
    record, stop = Record(t0), threading.Event()
    clients = [Client(main_srv, next(src), i, stop, record, cases, a.think_s) for i in range(a.clients)]
    if cluster:
        clients += [Client(cluster, next(src), 100 + i, stop, record, cases, a.think_s)
                    for i in range(a.cluster_clients)]
    samples: dict[str, list[dict]] = {n: [] for n in servers}
    died: dict[str, float] = {}

    def sample() -> None:
        t = time.monotonic() - t0
        for n, s in servers.items():
            f = proc_figures(s.pid) if s.alive() else None
            if f is None:
                died.setdefault(n, t)
            else:
                samples[n].append({"t": round(t, 1), **f})

    ticking = threading.Event()  # set when the traffic ends: the sampler and the prober stop

    def probe_all() -> None:
        for s in servers.values():
            run_probe(s, f"{(time.monotonic() - t0) / 60:.1f} min")

    sample()
    tickers = [periodic(a.sample_s, sample, ticking), periodic(a.probe_every, probe_all, ticking)]
    for cl in clients:
        cl.start()
    wave_at, wave_len = 0.25 * duration, min(a.wave_s, 0.2 * duration)
    kill_at = 0.5 * duration
    wave = None
    wave_info: dict = {}
    kill: dict = {}

    def end_wave() -> None:  # no dripper reopened from here; those open drain while the run goes on
        wave.stop.set()
        wave_info.update(end_s=time.monotonic() - t0)

    while (now := time.monotonic() - t0) < duration and not died:
        if wave is None and now >= wave_at and local:
            sources = [f"127.0.1.{i}" for i in range(1, a.wave_addresses + 1)]
            wave = SlowlorisWave(main_srv.port, sources, a.wave_per_address, drain_s=2 * a.header_timeout + 10)
            wave.start()
            wave_info = {"start_s": now, "drippers": len(sources) * a.wave_per_address, "addresses": len(sources)}
        if wave is not None and "end_s" not in wave_info and now >= wave_at + wave_len:
            end_wave()
        if cluster and not kill and now >= kill_at:
            kill = kill_worker(cluster, t0)
            run_probe(cluster, "after the kill")
        if kill and "back_s" not in kill:
            watch_worker(cluster, kill, t0)
        time.sleep(0.1)
    traffic_s = time.monotonic() - t0
    stop.set()
    ticking.set()
    if wave is not None:
        if "end_s" not in wave_info:
            end_wave()
        wave.join(wave.drain_s + 30)
        # uncut -1: the wave's thread had not finished draining (its counts are not final)
        wave_info.update(opened=wave.opened, closes=dict(wave.closes), uncut=-1 if wave.is_alive() else wave.uncut)
    for t in clients + tickers:
        t.join(TIMEOUT_S + 30)
    deadline = time.monotonic() + 60
    while kill and "back_s" not in kill and time.monotonic() < deadline and cluster.alive():
        watch_worker(cluster, kill, t0)
        time.sleep(0.2)
    for s in servers.values():
        if s.alive():
            run_probe(s, "end")
    sample()
    finals = {n: final_state(s) for n, s in servers.items() if s.alive()}
    return summarize(a, servers, record, probes, samples, died, wave_info, kill, finals, traffic_s, say)


def periodic(period: float, fn, stop: threading.Event) -> threading.Thread:
    """A thread calling fn() every `period` seconds until `stop` is set."""
    def run():
        while not stop.wait(period):
            fn()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def kill_worker(cluster: Server, t0: float) -> dict:
    pids = expert_workers(cluster.pid)
    if not pids:
        return {"error": "no ray::ExpertWorker process found under the cluster server"}
    victim = pids[-1]
    os.kill(victim, signal.SIGKILL)
    return {"at_s": time.monotonic() - t0, "pid": victim, "workers_before": pids, "log_at": len(cluster.log_text())}


def watch_worker(cluster: Server, kill: dict, t0: float) -> None:
    """When a new worker process stands in the killed one's place, and when the head logs it back."""
    if "pid" not in kill:
        kill["new_worker_s"] = kill["back_s"] = None
        return
    now = time.monotonic() - t0
    if "new_worker_s" not in kill:
        pids = expert_workers(cluster.pid)
        if kill["pid"] not in pids and len(pids) >= len(kill["workers_before"]):
            kill["new_worker_s"], kill["workers_after"] = now - kill["at_s"], pids
    if "back_s" not in kill and " is back (pid" in cluster.log_text()[kill["log_at"]:]:
        kill["back_s"] = now - kill["at_s"]


def final_state(s: Server) -> dict:
    """/health once the clients are gone (no generation left running) and the counters of /metrics."""
    health, deadline = {}, time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(s.url + "/health", timeout=30).json()
        if health.get("active") == 0 and health.get("queued") == 0:
            break
        time.sleep(0.5)
    text = httpx.get(s.url + "/metrics", timeout=30).text
    names = {"evicted": "colibri_connections_evicted_total", "header_timeouts": "colibri_header_timeouts_total",
             "worker_faults": "colibri_expert_worker_faults_total", "expert_hits": "colibri_expert_hits_total",
             "expert_misses": "colibri_expert_misses_total", "expert_bytes_read": "colibri_expert_bytes_read_total"}
    out = {k: metric(text, v) for k, v in names.items()}
    out["refused"] = sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("colibri_connections_refused_total{"))
    out.update({k: health.get(k) for k in ("active", "queued", "completed", "cancelled", "failed", "rejected")})
    return out


def summarize(a, servers, record: Record, probes, samples, died, wave_info, kill, finals, traffic_s, say) -> dict:
    rows = record.rows
    names = list(servers)
    kinds: dict[str, dict[str, dict]] = {n: {} for n in names}
    for n in names:
        for k in KINDS:
            mine = [r for r in rows if r.server == n and r.kind == k]
            ok = [r for r in mine if r.outcome == "ok" or (k == "malformed" and r.expected and r.outcome.isdigit())]
            lat = [r.seconds * 1e3 for r in ok]
            kinds[n][k] = {"served": len(ok), "p50_ms": quantile(lat, 0.5), "p99_ms": quantile(lat, 0.99),
                           "notes": dict(Counter(r.note for r in ok if r.note))}
    expected = Counter((r.outcome, r.detail if r.kind == "malformed" else r.kind) for r in rows
                       if r.outcome != "ok" and r.expected)
    unexpected = Counter(f"{r.outcome} ({r.server} {r.kind})" for r in rows if r.outcome != "ok" and not r.expected)
    examples: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        key = f"{r.outcome} ({r.server} {r.kind})"
        if r.outcome != "ok" and not r.expected and len(examples[key]) < 3:
            examples[key].append(f"t={r.t:.1f}s {r.detail}")
    log_warnings: dict[str, dict[str, int]] = {}  # reported, not failed on: kinds of warning
    for n, s in servers.items():  # an internal error keeps its traceback in the server's log
        text = s.log_text()
        for what, count in (("traceback", text.count("Traceback (most recent call last)")),
                            ("ERROR line", sum(line.startswith("ERROR") for line in text.splitlines()))):
            if count:
                unexpected[f"{what} in the log ({n})"] += count
        log_warnings[n] = dict(Counter(line.split(": ", 1)[-1].strip()[:120] for line in text.splitlines()
                                       if line.startswith("WARNING") or "Warning: " in line))
    for n, t in died.items():
        unexpected[f"server died ({n})"] += 1
    good = [p for p in probes if "tokens" in p]
    probe_ok = bool(good) and len(good) == len(probes) and all(p["identical"] for p in good)
    leftover = {n: f["active"] + f["queued"] for n, f in finals.items() if f.get("active") is not None}
    for n, left in leftover.items():
        if left:
            unexpected[f"generations still running at the end ({n})"] += left
    if kill and (kill.get("error") or finals.get("cluster", {}).get("worker_faults", 0) < 1):
        unexpected["worker kill not seen by the head"] += 1
    if "cluster" in servers and not kill and "cluster" not in died:
        unexpected["no worker was killed (the run ended before its midpoint was reached)"] += 1
    normal = [r for r in rows if r.server == "streamed" and r.outcome == "ok" and r.kind != "malformed"]
    during = (lambda r: wave_info["start_s"] <= r.t <= wave_info.get("end_s", 1e18)) if wave_info else (lambda r: False)
    in_wave = [r for r in normal if during(r)]
    outside = [r for r in normal if not during(r)]
    if wave_info:
        wave_info.update(served=len(in_wave), p50_ms=quantile([r.seconds * 1e3 for r in in_wave], 0.5),
                         p99_ms=quantile([r.seconds * 1e3 for r in in_wave], 0.99),
                         p99_outside_ms=quantile([r.seconds * 1e3 for r in outside], 0.99))
    if wave_info and (wave_info["uncut"] != 0 or not wave_info["closes"].get("408")):
        unexpected["slowloris drippers not cut off with 408 at the header deadline"] += max(1, wave_info["uncut"])
    resources = {n: {key: summary_of(samples[n], key) for key in ("rss_mb", "fds", "threads")} for n in names}
    ok = probe_ok and not unexpected and not died

    # -- the printed report
    served = sum(k["served"] for n in names for k in kinds[n].values())
    say(f"\nsoak: {traffic_s / 60:.1f} min of traffic, {len(rows)} requests ({served} answered as they should: "
        f"{served / traffic_s:.1f}/s), {a.clients} + {a.cluster_clients if 'cluster' in servers else 0} clients")
    head = f"{'kind':16}" + "".join(f" {n + ': served':>17} {'p50 ms':>8} {'p99 ms':>8}" for n in names)
    say(head)
    for k in KINDS:
        say(f"{k:16}" + "".join(f" {kinds[n][k]['served']:17d} {kinds[n][k]['p50_ms']:8.0f} {kinds[n][k]['p99_ms']:8.0f}"
                                for n in names))
    say("expected (refusals the requests asked for): "
        + (", ".join(f"{st} {what} x{c}" for (st, what), c in sorted(expected.items())) or "none"))
    say("unexpected errors: " + (", ".join(f"{k} x{c}" for k, c in sorted(unexpected.items())) or "none"))
    for k, ex in examples.items():
        for e in ex:
            say(f"  {k}: {e}")
    say(f"\nresources (sampled every {a.sample_s:g} s, {len(samples[names[0]])} samples)")
    say(f"{'server':10} {'what':8} {'first':>8} {'median':>8} {'last':>8} {'max':>8} {'2nd half /h':>12}")
    for n in names:
        for key, label in (("rss_mb", "RSS MB"), ("fds", "open fds"), ("threads", "threads")):
            r = resources[n][key]
            if r:
                say(f"{n:10} {label:8} {r['first']:8.1f} {r['median']:8.1f} {r['last']:8.1f} {r['max']:8.1f} "
                    f"{r['second_half_per_hour']:+12.1f}")
    for n in names:
        pts = samples[n]
        if pts:
            idx = sorted({round(i * (len(pts) - 1) / 9) for i in range(10)})
            say(f"{n} RSS over time (MB at min): " + ", ".join(f"{pts[i]['rss_mb']:.0f}@{pts[i]['t'] / 60:.1f}"
                                                                 for i in idx))
    if wave_info:
        say(f"\nslowloris wave: {wave_info['drippers']} drippers from {wave_info['addresses']} addresses, "
            f"{wave_info['start_s'] / 60:.1f}-{wave_info.get('end_s', 0) / 60:.1f} min, opened "
            f"{wave_info.get('opened')} times, closed with {wave_info.get('closes')} ({wave_info['uncut']} never "
            f"cut off); meanwhile {len(in_wave)} "
            f"requests served, p99 {wave_info['p99_ms']:.0f} ms (outside the wave {wave_info['p99_outside_ms']:.0f} ms); "
            f"evicted {finals.get('streamed', {}).get('evicted')}, refused {finals.get('streamed', {}).get('refused')}")
    if kill:
        if "pid" in kill:
            say(f"worker kill: ray::ExpertWorker pid {kill['pid']} SIGKILLed at {kill['at_s'] / 60:.1f} min; faults "
                f"counted {finals.get('cluster', {}).get('worker_faults')}; a new worker process after "
                f"{_s(kill.get('new_worker_s'))}, serving again after {_s(kill.get('back_s'))}")
        else:
            say(f"worker kill: {kill['error']}")
    for n, f in finals.items():
        hits, misses = f.get("expert_hits"), f.get("expert_misses")
        rate = hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None
        f["expert_hit_rate"] = rate
        say(f"{n}: completed {f['completed']}, cancelled {f['cancelled']} (clients that left), failed {f['failed']}, "
            f"rejected {f['rejected']}; expert hit rate {'-' if rate is None else f'{rate:.2f}'}, "
            f"{(f.get('expert_bytes_read') or 0) / 1e9:.2f} GB of experts read; left running at the end: "
            f"{leftover.get(n)}")
    diffs = [p["max_logprob_diff"] for p in good]
    say(f"probe: {len(probes)} probes ({', '.join(sorted({p['server'] for p in probes}))}; start, every "
        f"{a.probe_every:g} s{', after the kill' if kill else ''}, end): "
        + ("tokens identical to the first" if probe_ok else "TOKENS DIFFER or a probe failed")
        + (f", largest logprob difference {max(diffs):.2g}" if diffs else ""))
    for n, w in log_warnings.items():
        say(f"warnings in the {n} server's log: " + ("; ".join(f"{k} x{c}" for k, c in w.items()) or "none"))
    say("soak " + ("held" if ok else "FAILED"))
    return {"ok": ok, "traffic_s": traffic_s, "requests": len(rows), "served": served, "kinds": kinds,
            "expected": {f"{st} {what}": c for (st, what), c in expected.items()},
            "unexpected": dict(unexpected), "unexpected_examples": dict(examples),
            "probe": {"identical": probe_ok, "count": len(probes), "tokens": good[0]["tokens"] if good else None,
                      "probes": [{k: v for k, v in p.items() if k not in ("tokens", "logprobs")} for p in probes]},
            "resources": resources, "samples": samples, "died": died, "wave": wave_info, "worker_kill": kill,
            "log_warnings": log_warnings, "servers": finals}


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
