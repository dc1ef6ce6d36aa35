"""OpenAI-compatible routes: /v1/chat/completions and /v1/completions, streamed (SSE) or not,
in the shapes the official `openai` client parses (vLLM's and llama.cpp's servers as models)."""
from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from colibri.engine import TokenEvent
from colibri.serve.state import (ClientGone, ServerState, Turn, collect_choices, error_event, read_json, sse,
                                 sse_response)
from colibri.serve.tools import (AnswerStream, ArgsDelta, CallStart, Reasoning, TextDelta, ToolCall, ToolPlan,
                                 compile_grammar, guided_spec, openai_tools, parse_arguments, plan,
                                 render_messages, response_format_spec)
from colibri.serve.errors import bad_request
from colibri.serve.profile_api import profile_field
from colibri.serve.reasoning import prompt_opens_thinking
from colibri.serve.scheduler import Failed, Finished
from colibri.serve.schemas import MAX_STOP, MAX_STOP_CHARS, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest

router = APIRouter()


# ---------------------------------------------------------------------------------- checks
def refuse_unsupported(req: SamplingRequest) -> None:
    """Fields of the API that colibri does not implement get a 400 naming them, never silence."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options")


def stop_list(stop, param: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"'{param}' takes at most {MAX_STOP} strings, not {len(stops)}", param=param)
    for i, s in enumerate(stops):
        if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
            where = param if isinstance(stop, str) else f"{param}[{i}]"
            raise bad_request(f"'{where}' is {len(s)} characters long; a stop string has at most {MAX_STOP_CHARS}",
                              param=where)
    return stops


def _refuse_unsupported_chat(req: ChatCompletionRequest) -> None:
    refuse_unsupported(req)
    for name in ("functions", "function_call"):
        if getattr(req, name) is not None:
            raise bad_request(f"'{name}' is the deprecated form of tool calling; send 'tools' and 'tool_choice'",
                              param=name)
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(req, name) is not None:
            raise bad_request(f"'{name}' is not implemented", param=name)
    if req.modalities and set(req.modalities) - {"text"}:
        raise bad_request("'modalities': only text output is implemented", param="modalities")
    if req.verbosity not in (None, "medium"):
        raise bad_request("'verbosity' is not implemented; leave it out", param="verbosity")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")


def tool_choice(choice, param: str = "tool_choice") -> tuple[str | None, str | None]:
    """OpenAI's tool_choice -> (none | auto | required | named | None for the default, name)."""
    if choice is None:
        return None, None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")  # chat / Responses shapes
        if isinstance(name, str):
            return "named", name
    raise bad_request(f"'{param}' must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                      "{'name': ...}}", param=param)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the chat template's, in the Hugging Face convention: developer is
    system, assistant tool calls carry their arguments as objects, tool results name their call."""
    out = []
    calls: dict[str, str] = {}  # call id -> function name, from the assistant turns so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        for name in ("function_call", "audio"):
            if getattr(m, name) is not None:
                raise bad_request(f"'{where}.{name}' is not implemented", param=f"{where}.{name}")
        if m.role == "function":
            raise bad_request(f"'{where}.role': 'function' messages are the deprecated form; send 'tool' messages",
                              param=f"{where}.role")
        content = _text_content(m, where)
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise bad_request(f"'{where}.tool_calls' belongs to assistant messages", param=f"{where}.tool_calls")
            msg["tool_calls"] = _tool_calls(m.tool_calls, f"{where}.tool_calls", calls)
        if m.role == "tool":
            cid = m.tool_call_id
            if not isinstance(cid, str):
                raise bad_request(f"'{where}.tool_call_id' is required for tool messages", param=f"{where}.tool_call_id")
            if cid not in calls:
                raise bad_request(f"'{where}.tool_call_id' {cid!r} answers no tool call of an earlier assistant message",
                                  param=f"{where}.tool_call_id")
            msg.update(tool_call_id=cid, name=calls[cid])
        elif m.tool_call_id is not None:
            raise bad_request(f"'{where}.tool_call_id' belongs to tool messages", param=f"{where}.tool_call_id")
        out.append(msg)
    return out


def _text_content(m: ChatMessage, where: str) -> str:
    if isinstance(m.content, list):
        parts = []
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise bad_request(f"'{where}.content[{j}]': '{part.type}' content is not supported; "
                                  "this server takes text only", param=f"{where}.content[{j}].type")
            if not isinstance(part.text, str):
                raise bad_request(f"'{where}.content[{j}].text' must be a string", param=f"{where}.content[{j}].text")
            parts.append(part.text)
        return "\n".join(parts)
    if m.content is None:
        if m.role != "assistant":
            raise bad_request(f"'{where}.content' is required", param=f"{where}.content")
        return ""
    return m.content


def _tool_calls(raw, where: str, calls: dict[str, str]) -> list[dict]:
    if not isinstance(raw, list):
        raise bad_request(f"'{where}' must be a list of tool calls", param=where)
    out = []
    for j, c in enumerate(raw):
        param = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise bad_request(f"'{param}' must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                              "'arguments': ...}}}}", param=param)
        calls[c["id"]] = fn["name"]
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": parse_arguments(fn.get("arguments", "{}"), f"{param}.function.arguments")}})
    return out


# ---------------------------------------------------------------------------------- shared pieces
def usage(g, gens: list | None = None) -> dict:
    """Usage of one generation, or of a request's n choices (one prompt, their outputs summed)."""
    completion = sum(x.completion_tokens for x in gens) if gens else g.completion_tokens
    return {"prompt_tokens": g.prompt_tokens, "completion_tokens": completion,
            "total_tokens": g.prompt_tokens + completion,
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


def finish_reason(g, calls: list) -> str:
    """"tool_calls" when the answer ended with its calls; a cut-off one stays "length"."""
    return "tool_calls" if calls and g.finish_reason == "stop" else g.finish_reason


def _tool_call_json(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


# ---------------------------------------------------------------------------------- chat
@dataclass
class ChatSetup:
    """A chat request made ready to run: its prompt, the engine options, and what shapes its answer."""

    ids: list[int]
    prompt_text: str
    options: dict
    split: bool
    tools: ToolPlan | None
    adjusted: str | None


async def prepare_chat(state: ServerState, req, messages: list[dict], tools: list[dict], choice, format_spec,
                       *, thinking: tuple[bool | None, str], limit: tuple[int | None, str], logprobs: int | None,
                       stop: list[str], choice_param: str = "tool_choice", format_param: str = "response_format",
                       prompt_param: str = "messages") -> ChatSetup:
    """What the chat and Responses routes share: tools, grammar, template, token budget,
    sampling. `format_spec`: a grammar spec for the answer (response_format_spec), or None;
    `thinking`: (enable_thinking or None, the field it came from); `limit`: (max tokens asked
    for or None, its field); `req` gives temperature, top_p and the optional sampling extras."""
    mode, name = tool_choice(choice, choice_param)
    mode = mode or ("auto" if tools else "none")
    tool_plan = plan(state, tools, mode, name, req.parallel_tool_calls is not False, choice_param)
    template_kwargs, split = state.thinking(*thinking)
    ids, prompt_text = await state.encode_chat(render_messages(messages, tool_plan), **template_kwargs,
                                               **tool_plan.template_kwargs())
    if tool_plan.forced:
        grammar = compile_grammar(state, tool_plan.grammar_spec(split and prompt_opens_thinking(prompt_text)),
                                  choice_param)
    else:  # under tool_choice auto a JSON answer cannot also be a call: the format wins, tools stay listed
        grammar = compile_grammar(state, format_spec, format_param)
    state.check_prompt(ids, prompt_param)
    budget = state.token_budget(limit[0], limit[1], len(ids))
    options = state.sampling(max_tokens=budget[0], temperature=req.temperature, top_p=req.top_p,
                             top_k=getattr(req, "top_k", None), seed=getattr(req, "seed", None), stop=stop,
                             logprobs=logprobs, req=req)
    if grammar is not None:
        options["grammar"] = grammar
    return ChatSetup(ids, prompt_text, options, split, tool_plan if tool_plan.active else None, budget[1])


def answer_stream(state: ServerState, setup: ChatSetup) -> AnswerStream:
    return AnswerStream(state.splitter(setup.split, setup.prompt_text),
                        setup.tools.parser() if setup.tools is not None else None)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, ChatCompletionRequest)
    state.check_model(req.model)
    _refuse_unsupported_chat(req)
    enable, param = req.enable_thinking, "enable_thinking"
    if enable is None and req.reasoning_effort is not None:
        enable, param = req.reasoning_effort != "none", "reasoning_effort"
    if req.max_completion_tokens is not None:  # OpenAI's newer name wins over the deprecated one
        limit = (req.max_completion_tokens, "max_completion_tokens")
    else:
        limit = (req.max_tokens, "max_tokens")
    fmt, fmt_param = response_format_spec(req.response_format), "response_format"
    guided, guided_param = guided_spec(req)
    if guided is not None:
        if fmt is not None:
            raise bad_request(f"send either 'response_format' or '{guided_param}'", param=guided_param)
        fmt, fmt_param = guided, guided_param
    setup = await prepare_chat(state, req, template_messages(req.messages), openai_tools(req.tools), req.tool_choice,
                               fmt, thinking=(enable, param), limit=limit, format_param=fmt_param,
                               logprobs=(req.top_logprobs or 0) if req.logprobs else None, stop=stop_list(req.stop))
    n = req.n or 1
    turn = Turn(state, request, setup.ids, setup.options, state.check_slot(req.cache_slot), adjusted=setup.adjusted,
                n=n)
    await turn.start()
    rid = "chatcmpl-" + turn.job.request_id.removeprefix("req_")
    created = int(time.time())
    want_logprobs = setup.options["logprobs"] is not None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(turn, _chat_stream(state, turn, setup, rid, created, include_usage, want_logprobs))
    choices = await collect_choices(turn)
    out = []
    for index, (events, done) in enumerate(choices):
        g = done.generation
        answer = answer_stream(state, setup)
        answer.feed(g.text)
        answer.finish()
        message = {"role": "assistant", "content": answer.content, "refusal": None}
        if answer.calls:
            message["tool_calls"] = [_tool_call_json(c) for c in answer.calls]
            if not answer.content.strip():
                message["content"] = None
        if answer.splitter is not None:
            message["reasoning_content"] = answer.reasoning
        lp = None
        if want_logprobs:  # token_id None: the final event of held-back text; chat leaves out the end token
            lp = {"content": [_chat_logprob(state, ev) for ev in events if ev.token_id is not None and not ev.end],
                  "refusal": None}
        out.append({"index": index, "message": message, "finish_reason": finish_reason(g, answer.calls),
                    "logprobs": lp})
    gens = [done.generation for _, done in choices]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": state.model_id,
            "system_fingerprint": "colibri", "choices": out, "usage": usage(gens[0], gens),
            "colibri": profile_field(gens)}
    return JSONResponse(body, headers=turn.headers)


async def _chat_stream(state: ServerState, turn: Turn, setup: ChatSetup, rid: str, created: int, include_usage: bool,
                       want_logprobs: bool):
    index = 0

    def chunk(delta: dict, finish=None, logprobs=None, profile=None) -> str:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
             "system_fingerprint": "colibri",
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        if profile is not None:
            c["colibri"] = profile
        return sse(c)

    def deltas(events: list) -> list[dict]:
        out = []
        for ev in events:
            if isinstance(ev, Reasoning):
                out.append({"reasoning_content": ev.text})
            elif isinstance(ev, TextDelta):
                out.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                out.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                            "function": {"name": ev.name, "arguments": ""}}]})
            elif isinstance(ev, ArgsDelta) and ev.fragment:
                out.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]})
        return out

    gens = []
    try:
        while index < turn.job.n:
            answer = answer_stream(state, setup)
            yield chunk({"role": "assistant", "content": ""})
            while True:
                item = await turn.next()
                if isinstance(item, Failed):
                    yield sse(error_event("/v1/chat/completions", item.error))
                    return
                if isinstance(item, Finished):
                    g = item.generation
                    gens.append(g)
                    for delta in deltas(answer.finish()):
                        yield chunk(delta)
                    # The turns' profile (`colibri`) rides on the stream's last chunk: the usage
                    # chunk when asked for (its choices empty, as OpenAI sends it), else this one.
                    # A chunk of its own with empty choices would break the usual
                    # `chunk.choices[0]` loop of clients that never asked for usage.
                    last = index == turn.job.n - 1 and not include_usage
                    yield chunk({}, finish=finish_reason(g, answer.calls),
                                profile=profile_field(gens) if last else None)
                    break
                logprobs = None
                if want_logprobs and item.token_id is not None and not item.end:  # None: held-back text
                    logprobs = {"content": [_chat_logprob(state, item)], "refusal": None}
                ds = deltas(answer.feed(item.text))
                for k, delta in enumerate(ds):
                    yield chunk(delta, logprobs=logprobs if k == 0 else None)
                if logprobs and not ds:
                    yield chunk({}, logprobs=logprobs)
            index += 1
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_id,
                       "system_fingerprint": "colibri", "choices": [], "usage": usage(gens[0], gens),
                       "colibri": profile_field(gens)})
        yield sse("[DONE]")
    except ClientGone:
        return
    finally:
        turn.close()


# ---------------------------------------------------------------------------------- completions
@router.post("/v1/completions")
async def completions(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, CompletionRequest)
    state.check_model(req.model)
    refuse_unsupported(req)
    if req.suffix is not None:
        raise bad_request("'suffix' (fill-in-the-middle) is not implemented", param="suffix")
    if req.best_of not in (None, 1, req.n):
        raise bad_request("'best_of' is not supported beyond 'n' (every choice is returned)", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("'prompt': batches of prompts are not supported; send one per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    ids = state.check_prompt(await state.encode(prompt, raw=True), "prompt")
    max_tokens, adjusted = state.token_budget(req.max_tokens, "max_tokens", len(ids), default=16)  # OpenAI's default
    echo_scores = bool(req.echo) and req.logprobs is not None
    if max_tokens == 0 and not echo_scores:
        raise bad_request("'max_tokens' 0 generates nothing; it is for scoring the prompt with 'echo' and 'logprobs'",
                          param="max_tokens")
    options = state.sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                             seed=req.seed, stop=stop_list(req.stop), logprobs=req.logprobs, req=req)
    if echo_scores:
        options["prompt_logprobs"] = req.logprobs
    spec, spec_param = guided_spec(req)
    grammar = compile_grammar(state, spec, spec_param)
    if grammar is not None:
        options["grammar"] = grammar
    n = req.n or 1
    turn = Turn(state, request, ids, options, state.check_slot(req.cache_slot), adjusted=adjusted, n=n)
    await turn.start()
    rid = "cmpl-" + turn.job.request_id.removeprefix("req_")
    created = int(time.time())
    echo = _echo(state, ids) if req.echo else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(turn, _completion_stream(state, turn, rid, created, include_usage,
                                                     req.logprobs is not None, echo))
    choices = await collect_choices(turn)
    out = []
    for index, (events, done) in enumerate(choices):
        g = done.generation
        text, lp = g.text, None
        if req.logprobs is not None:
            lp = _completion_logprobs(state, events, len(echo[0]) if echo else 0)
            if echo:
                lp = _join_logprobs(_prompt_logprobs(state, echo, g.prompt_logprobs), lp)
        if echo:
            text = echo[0] + text
        out.append({"index": index, "text": text, "finish_reason": g.finish_reason, "logprobs": lp})
    gens = [done.generation for _, done in choices]
    body = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
            "system_fingerprint": "colibri", "choices": out, "usage": usage(gens[0], gens),
            "colibri": profile_field(gens)}
    return JSONResponse(body, headers=turn.headers)


def _echo(state: ServerState, ids: list[int]) -> tuple[str, list[int], list[int]]:
    """(the prompt's text, its tokens, where each token's text starts in it), for `echo`; one
    incremental decode (its pieces concatenate to decode(ids)), not one decode per prefix."""
    if state.tokenizer is None:
        return "", ids, [0] * len(ids)
    decoder = state.tokenizer.stream_decoder()
    text, offsets = "", []
    for t in ids:
        offsets.append(len(text))
        text += decoder.feed(t)
    return text + decoder.flush(), ids, offsets


def _prompt_logprobs(state: ServerState, echo, scores) -> dict:
    """The prompt's tokens in the completions logprobs shape: the first has no score (null)."""
    _, ids, offsets = echo
    out = {"tokens": [state.token_text(t) for t in ids], "token_logprobs": [None], "top_logprobs": [None],
           "text_offset": offsets}
    for lp, top in scores or []:
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({state.token_text(t): v for t, v in top})
    return out


def _join_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


async def _completion_stream(state: ServerState, turn: Turn, rid: str, created: int, include_usage: bool,
                             want_logprobs: bool, echo):
    index = 0

    def chunk(text: str, finish=None, logprobs=None, profile=None) -> str:
        c = {"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
             "system_fingerprint": "colibri",
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            c["usage"] = None
        if profile is not None:
            c["colibri"] = profile
        return sse(c)

    gens, scores = [], None
    try:
        while index < turn.job.n:
            sent = echo[0] if echo else ""
            echoed = echo is None
            while True:
                item = await turn.next()
                if isinstance(item, Failed):
                    yield sse(error_event("/v1/completions", item.error))
                    return
                if isinstance(item, TokenEvent) and item.prompt_logprobs is not None:
                    scores = item.prompt_logprobs  # the first choice's first event
                    continue
                if not echoed:  # the prompt first, with its scores when asked for
                    yield chunk(echo[0], logprobs=_prompt_logprobs(state, echo, scores) if want_logprobs else None)
                    echoed = True
                if isinstance(item, Finished):
                    gens.append(item.generation)
                    last = index == turn.job.n - 1 and not include_usage
                    yield chunk("", finish=item.generation.finish_reason, profile=profile_field(gens) if last else None)
                    break
                logprobs = None
                if want_logprobs and item.token_id is not None:
                    logprobs = _completion_logprobs(state, [item], len(sent))
                sent += item.text
                if item.text or logprobs:
                    yield chunk(item.text, logprobs=logprobs)
            index += 1
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_id,
                       "system_fingerprint": "colibri", "choices": [], "usage": usage(gens[0], gens),
                       "colibri": profile_field(gens)})
        yield sse("[DONE]")
    except ClientGone:
        return
    finally:
        turn.close()
