"""The ASGI app of `colibri serve` (FastAPI): one Engine behind the Scheduler; OpenAI- and
Anthropic-shaped routes in openai_api.py / anthropic_api.py / responses_api.py; the dashboard
(web/) and its telemetry (telemetry.py) and turn profiles (profile_api.py); health, metrics, models and the tokenizer routes here. What the routes share (the server state, a generation's
async side) is in state.py, so imports run one way: app -> API modules -> state.

Follows llama.cpp's and vLLM's OpenAI servers in shape; the engine is reached only through its
public methods (encode_prompt, stream, slots), as the house style asks.
"""
from __future__ import annotations

import logging
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from colibri.engine import Engine
from colibri.errors import EngineFault
from colibri.serve import anthropic_api, openai_api, profile_api, responses_api, schemas, telemetry, web
from colibri.serve.errors import ApiError, api_error_response, bad_request, error_response
from colibri.serve.metrics import CONTENT_TYPE, ServeMetrics
from colibri.serve.scheduler import Scheduler
from colibri.serve.security import (ApiKeyMiddleware, BodyLimitMiddleware, BrowserGuardMiddleware, HostAllowlistMiddleware,
                                   RequestIdMiddleware)
from colibri.serve.state import ClientGone, ServeConfig, ServerState, gone_response, read_json
from colibri.serve.tools import openai_tools, plan, render_messages

log = logging.getLogger("colibri.serve")

__all__ = ["ServeConfig", "create_app", "default_state_dir"]


# ---------------------------------------------------------------------------------- the app
def create_app(engine: Engine, scheduler: Scheduler, config: ServeConfig, metrics: ServeMetrics) -> FastAPI:
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
        # Resident experts, served while they load (experts_in_background): the share of their
        # bytes in RAM (1.0 once all are in)
        loaded = getattr(engine.experts, "loaded_bytes", None) if engine.container.expert_bytes else None
        extra = {} if loaded is None else {"experts_loaded": round(loaded / engine.container.expert_bytes, 4)}
        return JSONResponse({
            "status": "draining" if draining else "ok", "model": state.model_id,
            "active": scheduler.running, "queued": scheduler.queued,
            "max_queue": scheduler.max_queue, "admitted": s.admitted, "completed": s.completed,
            "cancelled": s.cancelled, "failed": s.failed, "rejected": s.rejected,
            "rejected_queue_full": s.rejected_queue_full, "rejected_queue_timeout": s.rejected_queue_timeout,
            "rejected_draining": s.rejected_draining, "prompt_tokens": s.prompt_tokens,
            "prompt_tokens_reused": s.prompt_tokens_reused, "completion_tokens": s.completion_tokens,
            "kv_slots": [len(slot.ids) for slot in engine.slots], "max_context": engine.max_context, **extra,
        }, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics():
        # In a thread: the collectors read the expert store's figures, which with --cluster are
        # remote calls to the workers.
        return Response(await anyio.to_thread.run_sync(metrics.render), media_type=CONTENT_TYPE)

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
            # as the chat route renders them: assistant tool calls and tool results included
            tools = openai_tools(req.tools)
            tool_plan = plan(state, tools, "auto" if tools else "none", None, True, "tools")
            messages = render_messages(openai_api.template_messages(req.messages), tool_plan)
            kwargs.update(tool_plan.template_kwargs())
            if not req.add_generation_prompt:
                text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)
                ids = state.tokenizer.encode(text, add_special_tokens=False)
            else:
                ids, _ = await state.encode_chat(messages, **kwargs)
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await anyio.to_thread.run_sync(lambda: state.tokenizer.encode(req.prompt, add_special_tokens=add))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_context}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's endpoint: what a client needs to tokenize through /tokenize and /detokenize
        (lm-eval's `tokenizer_backend=remote`, picked by its `auto`)."""
        if state.tokenizer is None:
            raise ApiError(404, "this model has no tokenizer", code="no_tokenizer")
        tok = state.tokenizer
        return {**{name: tok.special_tokens.get(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
                "chat_template": tok.chat_template, "model_max_length": engine.max_context,
                "tokenizer_class": "PreTrainedTokenizerFast"}

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
    app.include_router(responses_api.router)
    app.include_router(telemetry.router)
    app.include_router(profile_api.router)
    web.mount(app)

    # Outermost last: request id -> Host check -> Origin and content type -> CORS -> API key ->
    # body limit -> routes.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, read_timeout=config.read_timeout)
    app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type", "x-api-key", "x-request-id",
                                          "anthropic-version", "anthropic-beta"],
                           expose_headers=["x-request-id", "x-colibri-queue-wait-ms", "x-colibri-kv-slot",
                                           "x-colibri-prompt-tokens-reused", "x-colibri-adjusted", "retry-after"],
                           allow_credentials=False, max_age=600)
    app.add_middleware(BrowserGuardMiddleware, cors_origins=config.cors_origins,
                       any_content_type=config.allow_any_content_type)
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
