"""What the API modules share: the server's state (engine, scheduler, config, facts derived from
the model once) and the asyncio side of a generation (`Turn`), with the helpers that turn its
events into responses. The app (app.py) imports the API modules, which import this; nothing
here imports them back.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache

import anyio
from fastapi import Request
from starlette.responses import Response, StreamingResponse

from colibri.engine import Engine, TokenEvent
from colibri.errors import ColibriError, EngineFault
from colibri.generate import Penalties
from colibri.serve import schemas
from colibri.serve.errors import ApiError, bad_request, error_body
from colibri.serve.metrics import ServeMetrics
from colibri.serve.harmony import HarmonySplitter, is_harmony
from colibri.serve.reasoning import ReasoningSplitter, always_thinks, has_thinking_switch, prompt_opens_thinking
from colibri.serve.scheduler import Failed, Finished, Job, Rejected, Scheduler, Started
from colibri.serve.security import MAX_BODY_BYTES
from colibri.serve.tools import probe_tool_support

log = logging.getLogger("colibri.serve")


@dataclass
class ServeConfig:
    model_id: str | None = None          # the name clients ask for (default: the model directory's name)
    model_aliases: set[str] = field(default_factory=set)  # other names accepted for it (--served-model-name)
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)   # exact origins; "*" only when asked for
    allow_any_content_type: bool = False  # POST bodies need not say application/json (--allow-any-content-type)
    allowed_hosts: set[str] | None = None  # Host header names; None accepts any
    queue_timeout: float = 300.0         # seconds a request may wait for its turn before a 429
    max_tokens: int = 4096               # the most tokens one request may generate (larger asks get a 400)
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout: float = 30.0           # seconds to receive a request body


class ServerState:
    """What every route needs: the engine (through the scheduler for generation), the config,
    the metrics, and the facts derived from the model once."""

    def __init__(self, engine: Engine, scheduler: Scheduler, config: ServeConfig, metrics: ServeMetrics):
        self.engine, self.scheduler, self.config, self.metrics = engine, scheduler, config, metrics
        self.model_id = config.model_id or engine.model_id
        self.created = int(time.time())
        self.tokenizer = engine.tokenizer
        self.thinking_switch = has_thinking_switch(self.tokenizer.chat_template if self.tokenizer else None)
        self.harmony = is_harmony(self.tokenizer.chat_template if self.tokenizer else None)  # gpt-oss
        self.always_thinks = self._always_thinks()
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self._tool_support: tuple[bool, str] | None = None
        self.special_tokens = frozenset(t.content for t in self.tokenizer.backend.get_added_tokens_decoder().values()
                                        if t.special) if self.tokenizer else frozenset()
        self.responses = None  # the Responses API's stored responses (responses_api.ResponseStore), on first use

    def _always_thinks(self) -> bool:
        template = self.tokenizer.chat_template if self.tokenizer else None
        if not template or has_thinking_switch(template):
            return False
        try:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except Exception:  # a template that cannot render a plain chat: the requests will say so
            return False
        return always_thinks(template, prompt)

    def tool_support(self) -> tuple[bool, str]:
        """(whether the chat template renders tools itself, the model's tool-call format),
        found once by rendering a probe tool (colibri.serve.tools)."""
        if self._tool_support is None:
            self._tool_support = probe_tool_support(self.tokenizer, self.engine.model_type)
        return self._tool_support

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else ""

    # ------------------------------------------------------------------ request checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id and name not in self.config.model_aliases:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def check_slot(self, slot: int | None) -> int | None:
        if slot is not None and slot >= len(self.engine.slots):
            raise bad_request(f"cache_slot {slot} does not exist: this server has {len(self.engine.slots)} KV slots "
                              "(0-based; start it with --kv-slots N for more)", param="cache_slot")
        return slot

    def check_prompt(self, ids: list[int], param: str) -> list[int]:
        """`param`: the field the prompt came in (`messages`, or `prompt` on /v1/completions)."""
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if len(ids) >= self.engine.max_context:
            raise bad_request(f"this model's context holds {self.engine.max_context} tokens, but the prompt has "
                              f"{len(ids)}; shorten it", param=param, code="context_length_exceeded")
        return ids

    def token_budget(self, requested: int | None, param: str, n_prompt: int,
                     default: int | None = None) -> tuple[int, str | None]:
        """-> (the tokens this request may generate, a note when that is fewer than it asked for).

        More than --max-tokens is a 400 naming the field, as OpenAI and Anthropic refuse more
        than a model's output limit. An ask that runs past the end of the context (max_context -
        prompt tokens) is shortened to it: the generation ends there with finish_reason "length"
        (Anthropic: stop_reason "max_tokens") and the response says so in `x-colibri-adjusted`.
        Without an ask: `default` (else --max-tokens), up to the context end, with no note."""
        cap = self.config.max_tokens
        if requested is not None and requested > cap:
            raise bad_request(f"'{param}' is {requested}, but this server generates at most {cap} tokens per request "
                              f"(its --max-tokens); ask for at most {cap}", param=param, code="max_tokens_too_large")
        room = self.engine.max_context - n_prompt
        want = min(cap, default if default is not None else cap) if requested is None else requested
        if want <= room:
            return want, None
        return room, f"{param}={room}; reason=context_end" if requested is not None else None

    def thinking(self, enable: bool | None, param: str) -> tuple[dict, bool]:
        """-> (chat-template variables, whether to split reasoning from the answer).
        A template without a thinking switch cannot think: asking it to is a 400, not ignored.
        A harmony model (gpt-oss) always reasons first, on its analysis channel."""
        if self.harmony:
            if enable is False:
                raise bad_request(f"'{param}': this model always reasons before it answers (harmony's analysis "
                                  "channel); leave the field out", param=param)
            return {}, True
        if enable is None:
            return {}, self.thinking_switch or self.always_thinks  # the template's default; it may think
        if self.always_thinks:  # nothing to switch: its reasoning is split off whatever was asked
            return {}, True
        if not self.thinking_switch:
            if enable:
                raise bad_request(f"'{param}': this model's chat template has no thinking switch; it answers "
                                  "without a reasoning phase (leave the field out)", param=param)
            return {}, False
        return {"enable_thinking": enable}, True

    def sampling(self, *, max_tokens: int, temperature: float | None, top_p: float | None,
                 top_k: int | None, seed: int | None, stop: list[str], logprobs: int | None,
                 req=None) -> dict:
        """engine.stream keywords, with the APIs' defaults (temperature 1, top_p 1). `max_tokens`
        comes from token_budget; `seed` is in 0..2**64-1 (the schema refuses others). `req`, an
        OpenAI SamplingRequest, adds its penalties, logit_bias, min_p and ignore_eos."""
        t = 1.0 if temperature is None else temperature
        p = 1.0 if top_p is None else top_p
        if p == 0:  # the limit of nucleus sampling is the most likely token
            t, p = 0.0, 1.0
        options = dict(max_tokens=max_tokens, temperature=t, top_p=p, top_k=max(0, top_k or 0), seed=seed,
                       stop=stop, logprobs=logprobs)
        if req is not None:
            def field(name):  # the Responses API has none of these
                return getattr(req, name, None)

            options["min_p"] = field("min_p") or 0.0
            if field("ignore_eos"):
                options["stop_at_eos"] = False
            repetition = field("repetition_penalty")
            penalties = Penalties(logit_bias=self._logit_bias(field("logit_bias")),
                                  repetition=1.0 if repetition is None else repetition,
                                  frequency=field("frequency_penalty") or 0.0, presence=field("presence_penalty") or 0.0)
            if penalties.active:
                options["penalties"] = penalties
        return options

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's logit_bias: token ids as strings -> -100..100 (a 400 naming the entry)."""
        out = {}
        for key, value in (bias or {}).items():
            param = f"logit_bias.{key}"
            try:
                tok = int(key)
            except ValueError:
                raise bad_request(f"'{param}': logit_bias keys are token ids, not {key!r}", param=param) from None
            if not 0 <= tok < self.engine.vocab_size:
                raise bad_request(f"'{param}': token {tok} is outside the vocabulary (0..{self.engine.vocab_size - 1})",
                                  param=param)
            if not -100 <= value <= 100:
                raise bad_request(f"'{param}': a bias must be between -100 and 100, not {value}", param=param)
            out[tok] = float(value)
        return out

    # ------------------------------------------------------------------ prompts
    async def encode_chat(self, messages: list[dict], prefill: str = "", **template_kwargs) -> tuple[list[int], str]:
        """Messages -> (ids, prompt text), as engine.encode_prompt renders them; `prefill` starts
        the assistant's answer (Anthropic's trailing assistant message)."""
        if self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions with a plain prompt")

        def render():
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
            text += prefill
            return self.tokenizer.encode(text, add_special_tokens=False), text

        try:
            return await anyio.to_thread.run_sync(render)
        except ColibriError as e:
            raise bad_request(str(e), param="messages") from None

    async def encode(self, prompt, raw: bool = True) -> list[int]:
        try:
            return await anyio.to_thread.run_sync(lambda: self.engine.encode_prompt(prompt, raw=raw))
        except ColibriError as e:
            raise bad_request(str(e), param="prompt") from None

    def splitter(self, split: bool, prompt_text: str) -> ReasoningSplitter | HarmonySplitter | None:
        if self.harmony:  # the channels split the answer, and carry its tool calls (colibri/serve/harmony.py)
            return HarmonySplitter()
        return ReasoningSplitter(prompt_opens_thinking(prompt_text)) if split else None


class ClientGone(Exception):
    """The HTTP client disconnected."""


class Turn:
    """The asyncio side of one generation: admission, then the events as the scheduler makes them.
    `start` returns only once the job has its turn and its first token (or its end) exists, so
    every refusal still has its own status code: nothing has been sent yet."""

    def __init__(self, state: ServerState, request: Request, ids: list[int], options: dict, slot: int | None,
                 adjusted: str | None = None, n: int = 1):
        self.state, self.request, self.adjusted = state, request, adjusted
        self.job = Job(ids, options, asyncio.get_running_loop(), slot=slot,
                       request_id=request.scope.get("state", {}).get("request_id", ""), n=n)
        self.started: Started | None = None
        self._gone = asyncio.ensure_future(_wait_disconnect(request))
        self._pending: list = []

    @property
    def headers(self) -> dict[str, str]:
        s = self.started
        h = {"x-colibri-queue-wait-ms": str(round(s.queue_wait_s * 1000)), "x-colibri-kv-slot": str(s.slot),
             "x-colibri-prompt-tokens-reused": str(s.reused)}
        if self.adjusted:
            h["x-colibri-adjusted"] = self.adjusted
        return h

    async def start(self) -> None:
        scheduler = self.state.scheduler
        if self.adjusted:
            log.info("request %s: %s (the context holds %d tokens, the prompt has %d)", self.job.request_id,
                     self.adjusted, self.state.engine.max_context, len(self.job.ids))
        try:
            scheduler.submit(self.job)
        except Rejected as r:
            self.close()
            raise ApiError(r.status, r.message, code=r.reason, headers={"retry-after": str(r.retry_after)}) from None
        try:
            item = await self._next(self.state.config.queue_timeout)
            if item is None:  # no turn within the queue timeout
                if scheduler.withdraw(self.job, timed_out=True):
                    raise ApiError(429, f"the request waited {self.state.config.queue_timeout:g} s for its turn; "
                                   "the server is busy, retry later", code="queue_timeout",
                                   headers={"retry-after": str(scheduler.retry_after())})
                item = await self._next(None)  # it started meanwhile
            self.started = item
            first = await self._next(None)
            if isinstance(first, Failed):
                raise failure(first.error)
            self._pending.append(first)
        except BaseException:
            self.close()
            raise

    async def next(self):
        """The next TokenEvent, Finished or Failed."""
        if self._pending:
            return self._pending.pop()
        return await self._next(None)

    async def _next(self, timeout: float | None):
        get = asyncio.ensure_future(self.job.events.get())
        try:
            done, _ = await asyncio.wait({get, self._gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Also when this wait is cancelled (Starlette cancels a stream whose client left): a
            # get left pending on the queue is destroyed by the garbage collector, with errors in the log.
            if not get.done():
                get.cancel()
        if get in done:
            return get.result()
        if self._gone in done:
            raise ClientGone
        return None

    def close(self) -> None:
        """Called when the response is over, whichever way: a job still running is cancelled
        (the scheduler stops it at the next token), one still queued is withdrawn."""
        self.job.cancel()
        self.state.scheduler.withdraw(self.job)
        self._gone.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def failure(error: Exception) -> ApiError:
    """What a generation's exception tells the client. A ColibriError is the request's fault
    (400); an EngineFault is the server's (a damaged expert file, non-finite logits): a 500 with
    its message, which names the file and expert to blame, so whoever sees it can report it;
    anything else is a bug, whose details stay in the server log (the scheduler logs its
    traceback)."""
    if isinstance(error, ColibriError):
        return bad_request(str(error))
    if isinstance(error, EngineFault):
        return ApiError(500, str(error), code="engine_fault")
    return ApiError(500, f"internal error: {type(error).__name__}; see the server log", code="internal_error")


def error_event(path: str, error: Exception) -> dict:
    """The error frame of a stream whose headers (200) are already sent: the same body a
    non-streamed request would get with its status code."""
    e = failure(error)
    return error_body(path, e.status, e.message, e.param, e.code)


async def collect(turn: Turn) -> tuple[list[TokenEvent], Finished]:
    """All events of a non-streamed generation (see collect_choices)."""
    return (await collect_choices(turn))[0]


async def collect_choices(turn: Turn) -> list[tuple[list[TokenEvent], Finished]]:
    """Each of the job's n choices: its events and its end. The turn is closed whatever happens;
    a disconnect raises ClientGone, which the app answers with gone_response()."""
    choices, events = [], []
    try:
        while len(choices) < turn.job.n:
            item = await turn.next()
            if isinstance(item, Finished):
                choices.append((events, item))
                events = []
            elif isinstance(item, Failed):
                raise failure(item.error)
            else:
                events.append(item)
    finally:
        turn.close()
    return choices


def sse_response(turn: Turn, frames) -> StreamingResponse:
    """A streamed answer: `frames` (an async generator of SSE text) with the turn's headers."""
    return StreamingResponse(frames, media_type="text/event-stream", headers={**turn.headers, "cache-control": "no-cache"})


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


async def read_json(request: Request, model):
    return schemas.parse(await request.body(), model)


def gone_response() -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
