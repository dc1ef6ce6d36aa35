"""The ASGI app of `colibri serve` (FastAPI): one Engine behind the Scheduler; OpenAI- and
Anthropic-shaped routes in openai_api.py / anthropic_api.py; health, metrics, models and the
tokenizer routes here, with what they share (the server state and a generation's async side).

Follows llama.cpp's and vLLM's OpenAI servers in shape; the engine is reached only through its
public methods (encode_prompt, stream, slots), as the house style asks.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from colibri.engine import Engine, TokenEvent
from colibri.errors import ColibriError, EngineFault
from colibri.serve import schemas
from colibri.serve.errors import ApiError, api_error_response, bad_request, error_body, error_response
from colibri.serve.metrics import CONTENT_TYPE, ServeMetrics
from colibri.serve.reasoning import ReasoningSplitter, has_thinking_switch, prompt_opens_thinking
from colibri.serve.scheduler import Failed, Finished, Job, Rejected, Scheduler, Started
from colibri.serve.security import (MAX_BODY_BYTES, ApiKeyMiddleware, BodyLimitMiddleware, HostAllowlistMiddleware,
                                    RequestIdMiddleware)

log = logging.getLogger("colibri.serve")


@dataclass
class ServeConfig:
    model_id: str | None = None          # the name clients ask for (default: the model directory's name)
    api_key: str | None = None
    cors_origins: list[str] = field(default_factory=list)   # exact origins; "*" only when asked for
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
        self.token_text = lru_cache(maxsize=65536)(self._token_text)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer else ""

    # ------------------------------------------------------------------ request checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_id:
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
        A template without a thinking switch cannot think: asking it to is a 400, not ignored."""
        if enable is None:
            return {}, self.thinking_switch  # the template's default; it may think
        if not self.thinking_switch:
            if enable:
                raise bad_request(f"'{param}': this model's chat template has no thinking switch; it answers "
                                  "without a reasoning phase (leave the field out)", param=param)
            return {}, False
        return {"enable_thinking": enable}, True

    def sampling(self, *, max_tokens: int, temperature: float | None, top_p: float | None,
                 top_k: int | None, seed: int | None, stop: list[str], logprobs: int | None) -> dict:
        """engine.stream keywords, with the APIs' defaults (temperature 1, top_p 1). `max_tokens`
        comes from token_budget; `seed` is in 0..2**64-1 (the schema refuses others)."""
        t = 1.0 if temperature is None else temperature
        p = 1.0 if top_p is None else top_p
        if p == 0:  # the limit of nucleus sampling is the most likely token
            t, p = 0.0, 1.0
        return dict(max_tokens=max_tokens, temperature=t, top_p=p, top_k=max(0, top_k or 0), seed=seed, stop=stop,
                    logprobs=logprobs)

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

    def splitter(self, split: bool, prompt_text: str) -> ReasoningSplitter | None:
        return ReasoningSplitter(prompt_opens_thinking(prompt_text)) if split else None


class ClientGone(Exception):
    """The HTTP client disconnected."""


class Turn:
    """The asyncio side of one generation: admission, then the events as the scheduler makes them.
    `start` returns only once the job has its turn and its first token (or its end) exists, so
    every refusal still has its own status code: nothing has been sent yet."""

    def __init__(self, state: ServerState, request: Request, ids: list[int], options: dict, slot: int | None,
                 adjusted: str | None = None):
        self.state, self.request, self.adjusted = state, request, adjusted
        self.job = Job(ids, options, asyncio.get_running_loop(), slot=slot,
                       request_id=request.scope.get("state", {}).get("request_id", ""))
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
        done, _ = await asyncio.wait({get, self._gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
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
    """All events of a non-streamed generation (a disconnect raises ClientGone)."""
    events = []
    while True:
        item = await turn.next()
        if isinstance(item, Finished):
            return events, item
        if isinstance(item, Failed):
            raise failure(item.error)
        events.append(item)


def sse(data: dict | str, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n" if event else f"data: {payload}\n\n"


async def read_json(request: Request, model):
    return schemas.parse(await request.body(), model)


def gone_response() -> Response:
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


# ---------------------------------------------------------------------------------- the app
def create_app(engine: Engine, scheduler: Scheduler, config: ServeConfig, metrics: ServeMetrics) -> FastAPI:
    from colibri.serve import anthropic_api, openai_api

    state = ServerState(engine, scheduler, config, metrics)
    app = FastAPI(title="colibri", docs_url=None, redoc_url=None)
    app.state.colibri = state

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        return api_error_response(request.url.path, e)

    @app.exception_handler(ClientGone)
    async def on_client_gone(request: Request, e: ClientGone):
        return gone_response()  # it left while waiting for its turn

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        return error_response(request.url.path, e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(EngineFault)
    async def on_engine_fault(request: Request, e: EngineFault):
        log.error("engine fault on %s: %s", request.url.path, e)
        return error_response(request.url.path, 500, str(e), code="engine_fault")

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}; see the server log")

    @app.get("/health")
    async def health(request: Request):
        draining = scheduler.draining
        status = 503 if draining else 200
        if not request.scope.get("state", {}).get("authenticated", False):
            return JSONResponse({"status": "draining" if draining else "ok"}, status_code=status)
        s = scheduler.stats
        return JSONResponse({
            "status": "draining" if draining else "ok", "model": state.model_id,
            "active": int(scheduler.active is not None), "queued": scheduler.queued,
            "max_queue": scheduler.max_queue, "admitted": s.admitted, "completed": s.completed,
            "cancelled": s.cancelled, "failed": s.failed, "rejected": s.rejected,
            "rejected_queue_full": s.rejected_queue_full, "rejected_queue_timeout": s.rejected_queue_timeout,
            "rejected_draining": s.rejected_draining, "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_reused": s.prompt_tokens_reused, "completion_tokens": s.completion_tokens,
            "kv_slots": [len(slot.ids) for slot in engine.slots], "max_context": engine.max_context,
        }, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        state.check_model(model_id)
        return _model_card(state)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = await read_json(request, schemas.TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of 'prompt' (text) or 'messages' (a chat)", param="prompt")
        if req.messages is not None:
            kwargs, _ = state.thinking(req.enable_thinking, "enable_thinking")
            messages = openai_api.template_messages(req.messages)
            if not req.add_generation_prompt:
                text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
                ids = state.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids, _ = await state.encode_chat(messages, **kwargs)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await anyio.to_thread.run_sync(lambda: state.tokenizer.encode(req.prompt, add_special_tokens=add))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await read_json(request, schemas.DetokenizeRequest)
        state.check_model(req.model)
        vocab = engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)

    # Outermost last: request id -> Host check -> CORS -> API key -> body limit -> routes.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, read_timeout=config.read_timeout)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type", "x-api-key", "x-request-id",
                                          "anthropic-version", "anthropic-beta"],
                           expose_headers=["x-request-id", "x-colibri-queue-wait-ms", "x-colibri-kv-slot",
                                           "x-colibri-prompt-tokens-reused", "x-colibri-adjusted", "retry-after"],
                           allow_credentials=False, max_age=600)
    app.add_middleware(HostAllowlistMiddleware, allowed=config.allowed_hosts)
    app.add_middleware(RequestIdMiddleware, metrics=metrics)
    return app


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "colibri",
            "max_model_len": state.engine.max_context}


def default_state_dir(engine: Engine) -> Path:
    """KV slots of a model live in the user's cache directory, keyed by the model's path."""
    import hashlib

    from colibri.default_model import cache_root

    key = hashlib.sha1(str(engine.container.dir.resolve()).encode()).hexdigest()[:10]
    return cache_root() / "serve" / f"{engine.container.dir.name}-{key}"
