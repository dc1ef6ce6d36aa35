"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions, streamed (SSE) or not,
in the shapes the official `openai` client parses (vLLM's and llama.cpp's servers as models)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, StreamingResponse

from colibri.engine import TokenEvent
from colibri.serve.app import ClientGone, ServerState, Turn, collect, error_event, gone_response, read_json, sse
from colibri.serve.errors import bad_request
from colibri.serve.scheduler import Failed, Finished
from colibri.serve.schemas import MAX_STOP, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest

router = APIRouter()


# ---------------------------------------------------------------------------------- checks
def refuse_unsupported(req: SamplingRequest) -> None:
    """Fields of the API that colibri does not implement get a 400 naming them, never silence."""
    if req.n not in (None, 1):
        raise bad_request("'n' > 1 is not supported: colibri generates one choice per request", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise bad_request(f"'{name}' is not implemented; leave it out or send 0", param=name)
    if req.logit_bias:
        raise bad_request("'logit_bias' is not implemented", param="logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")


def stop_list(stop, param: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"'{param}' takes at most {MAX_STOP} strings, not {len(stops)}", param=param)
    return stops


def _refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    refuse_unsupported(req)
    fmt = (req.response_format or {}).get("type", "text")
    if fmt != "text":
        raise bad_request(f"'response_format' type '{fmt}' is not implemented; only 'text' is",
                          param="response_format")
    if req.tools or req.functions:
        name = "tools" if req.tools else "functions"
        raise bad_request(f"'{name}': tool calling is not implemented yet", param=name)
    for name in ("tool_choice", "function_call"):
        if getattr(req, name) not in (None, "none", "auto"):
            raise bad_request(f"'{name}': tool calling is not implemented yet", param=name)
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(req, name) is not None:
            raise bad_request(f"'{name}' is not implemented", param=name)
    if req.modalities and set(req.modalities) - {"text"}:
        raise bad_request("'modalities': only text output is implemented", param="modalities")
    if req.verbosity not in (None, "medium"):
        raise bad_request("'verbosity' is not implemented; leave it out", param="verbosity")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the chat template's (text content only; developer is system)."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role in ("tool", "function"):
            raise bad_request(f"'{where}.role': '{m.role}' messages need tool calling, which is not implemented yet",
                              param=f"{where}.role")
        for name in ("tool_calls", "tool_call_id", "function_call", "audio"):
            if getattr(m, name) is not None:
                raise bad_request(f"'{where}.{name}' is not implemented", param=f"{where}.{name}")
        if isinstance(m.content, list):
            parts = []
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise bad_request(f"'{where}.content[{j}]': '{part.type}' content is not supported; "
                                      "this server takes text only", param=f"{where}.content[{j}].type")
                if not isinstance(part.text, str):
                    raise bad_request(f"'{where}.content[{j}].text' must be a string",
                                      param=f"{where}.content[{j}].text")
                parts.append(part.text)
            content = "\n".join(parts)
        elif m.content is None:
            if m.role != "assistant":
                raise bad_request(f"'{where}.content' is required", param=f"{where}.content")
            content = ""
        else:
            content = m.content
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


# ---------------------------------------------------------------------------------- shared pieces
def usage(g) -> dict:
    return {"prompt_tokens": g.prompt_tokens, "completion_tokens": g.completion_tokens,
            "total_tokens": g.prompt_tokens + g.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": g.prompt_tokens_reused}}


def _chat_logprob(state: ServerState, ev: TokenEvent) -> dict:
    def entry(tok: int, lp: float) -> dict:
        text = state.token_text(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {**entry(ev.token_id, ev.logprob), "top_logprobs": [entry(t, lp) for t, lp in ev.top_logprobs or []]}


def _completion_logprobs(state: ServerState, events: list[TokenEvent], offset0: int) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = offset0
    for ev in events:
        if ev.token_id is not None:  # not the final event of held-back text
            out["tokens"].append(state.token_text(ev.token_id))
            out["token_logprobs"].append(ev.logprob)
            out["top_logprobs"].append({state.token_text(t): lp for t, lp in ev.top_logprobs or []})
            out["text_offset"].append(pos)
        pos += len(ev.text)
    return out


# ---------------------------------------------------------------------------------- chat
@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, ChatCompletionRequest)
    state.check_model(req.model)
    _refuse_unsupported_chat(req)
    enable = req.enable_thinking
    param = "enable_thinking"
    if enable is None and req.reasoning_effort is not None:
        enable, param = req.reasoning_effort != "none", "reasoning_effort"
    template_kwargs, split = state.thinking(enable, param)
    ids, prompt_text = await state.encode_chat(template_messages(req.messages), **template_kwargs)
    state.check_prompt(ids, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.max_completion_tokens is not None:  # OpenAI's newer name wins over the deprecated one
        budget = state.token_budget(req.max_completion_tokens, "max_completion_tokens", len(ids))
    else:
        budget = state.token_budget(req.max_tokens, "max_tokens", len(ids))
    options = state.sampling(max_tokens=budget[0], temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             seed=req.seed, stop=stop_list(req.stop), logprobs=logprobs)
    turn = Turn(state, request, ids, options, state.check_slot(req.cache_slot), adjusted=budget[1])
    await turn.start()
    splitter = state.splitter(split, prompt_text)
    rid = "chatcmpl-" + turn.job.request_id.removeprefix("req_")
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_chat_stream(state, turn, rid, created, include_usage, logprobs is not None, splitter),
                                 media_type="text/event-stream", headers={**turn.headers, "cache-control": "no-cache"})
    try:
        events, done = await collect(turn)
    except ClientGone:
        return gone_response()
    finally:
        turn.close()
    g = done.generation
    message = {"role": "assistant", "content": g.text, "refusal": None}
    if splitter is not None:
        r1, c1 = splitter.feed(g.text)
        r2, c2 = splitter.flush()
        message["content"] = c1 + c2
        message["reasoning_content"] = r1 + r2
    lp = None
    if logprobs is not None:  # token_id None: the final event of held-back text
        lp = {"content": [_chat_logprob(state, ev) for ev in events if ev.token_id is not None], "refusal": None}
    body = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_id,
            "system_fingerprint": "colibri",
            "choices": [{"index": 0, "message": message, "finish_reason": g.finish_reason, "logprobs": lp}],
            "usage": usage(g)}
    return JSONResponse(body, headers=turn.headers)


async def _chat_stream(state: ServerState, turn: Turn, rid: str, created: int, include_usage: bool,
                       want_logprobs: bool, splitter):
    def chunk(delta: dict, finish=None, logprobs=None) -> str:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
             "system_fingerprint": "colibri",
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return sse(c)

    def text_delta(text: str) -> dict:
        if splitter is None:
            return {"content": text} if text else {}
        reasoning, content = splitter.feed(text)
        return _split_delta(reasoning, content)

    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            item = await turn.next()
            if isinstance(item, Failed):
                yield sse(error_event("/v1/chat/completions", item.error))
                return
            if isinstance(item, Finished):
                g = item.generation
                if splitter is not None:
                    delta = _split_delta(*splitter.flush())
                    if delta:
                        yield chunk(delta)
                yield chunk({}, finish=g.finish_reason)
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": state.model_id, "system_fingerprint": "colibri", "choices": [],
                               "usage": usage(g)})
                yield sse("[DONE]")
                return
            delta = text_delta(item.text)
            logprobs = None
            if want_logprobs and item.token_id is not None:  # None: the final event of held-back text
                logprobs = {"content": [_chat_logprob(state, item)], "refusal": None}
            if delta or logprobs:
                yield chunk(delta, logprobs=logprobs)
    except ClientGone:
        return
    finally:
        turn.close()


def _split_delta(reasoning: str, content: str) -> dict:
    d = {}
    if reasoning:
        d["reasoning_content"] = reasoning
    if content:
        d["content"] = content
    return d


# ---------------------------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, CompletionRequest)
    state.check_model(req.model)
    refuse_unsupported(req)
    if req.echo:
        raise bad_request("'echo' is not implemented", param="echo")
    if req.suffix is not None:
        raise bad_request("'suffix' (fill-in-the-middle) is not implemented", param="suffix")
    if req.best_of not in (None, 1):
        raise bad_request("'best_of' > 1 is not supported", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("'prompt': batches of prompts are not supported; send one per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    ids = state.check_prompt(await state.encode(prompt, raw=True), "prompt")
    max_tokens, adjusted = state.token_budget(req.max_tokens, "max_tokens", len(ids), default=16)  # OpenAI's default
    options = state.sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             seed=req.seed, stop=stop_list(req.stop), logprobs=req.logprobs)
    turn = Turn(state, request, ids, options, state.check_slot(req.cache_slot), adjusted=adjusted)
    await turn.start()
    rid = "cmpl-" + turn.job.request_id.removeprefix("req_")
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_completion_stream(state, turn, rid, created, include_usage, req.logprobs is not None),
                                 media_type="text/event-stream", headers={**turn.headers, "cache-control": "no-cache"})
    try:
        events, done = await collect(turn)
    except ClientGone:
        return gone_response()
    finally:
        turn.close()
    g = done.generation
    body = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
            "system_fingerprint": "colibri",
            "choices": [{"index": 0, "text": g.text, "finish_reason": g.finish_reason,
                         "logprobs": _completion_logprobs(state, events, 0) if req.logprobs is not None else None}],
            "usage": usage(g)}
    return JSONResponse(body, headers=turn.headers)


async def _completion_stream(state: ServerState, turn: Turn, rid: str, created: int, include_usage: bool,
                             want_logprobs: bool):
    def chunk(text: str, finish=None, logprobs=None) -> str:
        c = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
             "system_fingerprint": "colibri",
             "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        return sse(c)

    sent = ""
    try:
        while True:
            item = await turn.next()
            if isinstance(item, Failed):
                yield sse(error_event("/v1/completions", item.error))
                return
            if isinstance(item, Finished):
                g = item.generation
                yield chunk("", finish=g.finish_reason)
                if include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
                               "system_fingerprint": "colibri", "choices": [], "usage": usage(g)})
                yield sse("[DONE]")
                return
            logprobs = None
            if want_logprobs and item.token_id is not None:
                logprobs = _completion_logprobs(state, [item], len(sent))
            sent += item.text
            if item.text or logprobs:
                yield chunk(item.text, logprobs=logprobs)
    except ClientGone:
        return
    finally:
        turn.close()
