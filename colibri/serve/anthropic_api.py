"""Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): a translation onto the same
generation path as the OpenAI routes, answered in the shapes and SSE event order the official
`anthropic` client parses (message_start, content_block_start/delta/stop, message_delta, message_stop)."""
from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from colibri.serve.state import ClientGone, ServerState, Turn, collect, error_event, read_json, sse, sse_response
from colibri.serve.errors import bad_request
from colibri.serve.reasoning import prompt_opens_thinking
from colibri.serve.openai_api import stop_list
from colibri.serve.profile_api import profile_field
from colibri.serve.scheduler import Failed, Finished
from colibri.serve.schemas import AnthropicPrompt, CountTokensRequest, MessagesRequest
from colibri.serve.tools import (AnswerStream, ArgsDelta, CallStart, Reasoning, TextDelta, ToolPlan, check_tool_count,
                                 compile_grammar, function_tool, parse_arguments, plan, render_messages)

router = APIRouter()
PATH = "/v1/messages"


def _text_blocks(blocks, where: str, allow_thinking: bool = False) -> tuple[str, str]:
    """Content blocks -> (text, thinking). Only text (and, in assistant turns, thinking) is served."""
    texts, thinking = [], []
    for j, b in enumerate(blocks):
        if b.type == "text" and isinstance(b.text, str):
            texts.append(b.text)
        elif b.type == "thinking" and allow_thinking:
            thinking.append(str((b.model_extra or {}).get("thinking", "")))
        elif b.type in ("thinking", "redacted_thinking") and allow_thinking:
            continue
        elif b.type == "text":
            raise bad_request(f"'{where}[{j}].text' must be a string", param=f"{where}[{j}].text")
        else:
            raise bad_request(f"'{where}[{j}]': '{b.type}' content is not supported; this server takes text only",
                              param=f"{where}[{j}].type")
    return "\n".join(texts), "\n".join(thinking)


def _tools(tools: list | None) -> list[dict]:
    """Anthropic client tools ({name, description, input_schema}) -> checked function definitions."""
    check_tool_count(tools)
    out = []
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"'{param}' must be an object", param=param)
        if t.get("type") not in (None, "custom"):
            raise bad_request(f"'{param}.type': server tools ({t.get('type')!r}) are not available here; "
                              "only client tools with an input_schema are", param=f"{param}.type")
        if "input_schema" not in t:
            raise bad_request(f"'{param}.input_schema' is required", param=f"{param}.input_schema")
        out.append(function_tool(t.get("name"), t.get("description"), t["input_schema"], param,
                                 schema_field="input_schema"))
    names = [t["function"]["name"] for t in out]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"'tools[{i}]': two tools are named {name!r}", param=f"tools[{i}]")
    return out


def _tool_choice(choice) -> tuple[str | None, str | None, bool]:
    """Anthropic's tool_choice -> (none | auto | required | named | None, name, parallel allowed)."""
    if choice is None:
        return None, None, True
    kinds = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise bad_request("'tool_choice.type' must be auto, any, tool or none", param="tool_choice.type")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise bad_request("'tool_choice.name' is required for type tool", param="tool_choice.name")
    return kinds[choice["type"]], choice.get("name"), not choice.get("disable_parallel_tool_use", False)


def _messages(req: AnthropicPrompt) -> list[dict]:
    """Anthropic turns -> template messages in the Hugging Face convention: tool_use blocks become
    the assistant's tool_calls, tool_result blocks become tool messages before the user's text."""
    messages = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _text_blocks(req.system, "system")[0]
        messages.append({"role": "system", "content": system})
    calls: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        blocks = [b for b in m.content if b.type not in ("tool_use", "tool_result")]
        text, thinking = _text_blocks(blocks, where, allow_thinking=m.role == "assistant")
        uses, results = [], []
        for j, b in enumerate(m.content):
            extra = b.model_extra or {}
            param = f"{where}[{j}]"
            if b.type == "tool_use":
                if m.role != "assistant":
                    raise bad_request(f"'{param}': tool_use blocks belong to assistant turns", param=param)
                if not isinstance(extra.get("id"), str) or not isinstance(extra.get("name"), str):
                    raise bad_request(f"'{param}' needs an 'id' and a 'name'", param=param)
                calls[extra["id"]] = extra["name"]
                uses.append({"id": extra["id"], "type": "function",
                             "function": {"name": extra["name"],
                                          "arguments": parse_arguments(extra.get("input", {}), f"{param}.input")}})
            elif b.type == "tool_result":
                if m.role != "user":
                    raise bad_request(f"'{param}': tool_result blocks belong to user turns", param=param)
                cid = extra.get("tool_use_id")
                if cid not in calls:
                    raise bad_request(f"'{param}.tool_use_id' {cid!r} answers no tool_use of an earlier assistant turn",
                                      param=f"{param}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": cid, "name": calls[cid],
                                "content": _result_text(extra, param)})
        if uses:
            msg = {"role": "assistant", "content": text, "tool_calls": uses}
        else:
            msg = {"role": m.role, "content": text}
        if thinking:
            msg["reasoning_content"] = thinking
        messages.extend(results)
        if uses or text or thinking or not results:
            messages.append(msg)
    return messages


def _result_text(block: dict, param: str) -> str:
    """A tool_result's content (a string or text blocks) as the text the model reads; an error
    result says so, as Anthropic's own rendering does."""
    content = block.get("content", "")
    if isinstance(content, list):
        parts = []
        for k, c in enumerate(content):
            if not isinstance(c, dict) or c.get("type") != "text" or not isinstance(c.get("text"), str):
                raise bad_request(f"'{param}.content[{k}]': only text results are supported",
                                  param=f"{param}.content[{k}]")
            parts.append(c["text"])
        content = "\n".join(parts)
    elif not isinstance(content, str):
        raise bad_request(f"'{param}.content' must be a string or text blocks", param=f"{param}.content")
    return f"Error: {content}" if block.get("is_error") else content


async def _prompt(state: ServerState, req: AnthropicPrompt) -> tuple[list[int], str, bool, ToolPlan, object]:
    """-> (prompt ids, prompt text, whether to split thinking from the answer, the tool plan,
    the grammar forcing a call or None)."""
    tools = _tools(req.tools)
    mode, name, parallel = _tool_choice(req.tool_choice)
    tool_plan = plan(state, tools, mode or ("auto" if tools else "none"), name, parallel, "tool_choice")
    enable = None
    if req.thinking is not None:
        enable = req.thinking.type != "disabled"
    template_kwargs, split = state.thinking(enable, "thinking")
    messages = _messages(req)
    prefill = ""
    if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = messages.pop()["content"]  # the answer starts with this text; the model continues it
        if tool_plan.forced:
            raise bad_request("a trailing assistant message cannot be continued when tool_choice forces a call",
                              param="messages")
    ids, text = await state.encode_chat(render_messages(messages, tool_plan), prefill=prefill, **template_kwargs,
                                        **tool_plan.template_kwargs())
    grammar = compile_grammar(state, tool_plan.grammar_spec(split and prompt_opens_thinking(text)), "tool_choice")
    return ids, text, split, tool_plan, grammar


def _usage(g) -> dict:
    # Anthropic counts cache reads apart from input_tokens (input = input_tokens + cache reads).
    return {"input_tokens": g.prompt_tokens - g.prompt_tokens_reused, "output_tokens": g.completion_tokens,
            "cache_read_input_tokens": g.prompt_tokens_reused, "cache_creation_input_tokens": 0}


def _stop(state: ServerState, g, stops: list[str], calls: list) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence). The engine ends on a stop string or an end token alike;
    the stop string, when one ended it, is in the decoded tokens (it never reaches the text)."""
    if g.finish_reason == "grammar_dead_end":
        return g.finish_reason, None
    if g.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if stops:
        full = state.tokenizer.decode(g.token_ids)
        found = [(full.find(s), s) for s in stops if s and s in full]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


def _use_id(call_id: str) -> str:
    """Anthropic's spelling of a call id (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, CountTokensRequest)
    state.check_model(req.model)
    ids = (await _prompt(state, req))[0]
    return {"input_tokens": len(ids)}


@router.post(PATH)
async def messages(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, MessagesRequest)
    state.check_model(req.model)
    ids, prompt_text, split, tool_plan, grammar = await _prompt(state, req)
    state.check_prompt(ids, "messages")
    stops = stop_list(req.stop_sequences, "stop_sequences")
    max_tokens, adjusted = state.token_budget(req.max_tokens, "max_tokens", len(ids))
    options = state.sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                             top_k=req.top_k, seed=req.seed, stop=stops, logprobs=None)
    if grammar is not None:
        options["grammar"] = grammar
    turn = Turn(state, request, ids, options, state.check_slot(req.cache_slot), adjusted=adjusted)
    await turn.start()
    answer = AnswerStream(state.splitter(split, prompt_text), tool_plan.parser())
    mid = "msg_" + uuid.uuid4().hex[:24]
    if req.stream:
        return sse_response(turn, _stream(state, turn, mid, stops, answer))
    _, done = await collect(turn)
    g = done.generation
    answer.feed(g.text)
    answer.finish()
    content = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content.strip() or not answer.calls:
        content.append({"type": "text", "text": answer.content})
    for c in answer.calls:
        content.append({"type": "tool_use", "id": _use_id(c.id), "name": c.name, "input": json.loads(c.arguments)})
    reason, sequence = _stop(state, g, stops, answer.calls)
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": state.model_id,
                         "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(g),
                         "colibri": profile_field([g])}, headers=turn.headers)


async def _stream(state: ServerState, turn: Turn, mid: str, stops: list[str], answer: AnswerStream):
    blocks = {"index": -1, "type": None}

    def close():
        if blocks["type"] is not None:
            yield sse({"type": "content_block_stop", "index": blocks["index"]}, "content_block_stop")
            blocks["type"] = None

    def open_block(kind: str, block: dict):
        yield from close()
        blocks["index"] += 1
        blocks["type"] = kind
        yield sse({"type": "content_block_start", "index": blocks["index"], "content_block": block},
                  "content_block_start")

    def delta(d: dict):
        yield sse({"type": "content_block_delta", "index": blocks["index"], "delta": d}, "content_block_delta")

    def frames(events: list):
        for ev in events:
            if isinstance(ev, Reasoning):
                if blocks["type"] != "thinking":
                    yield from open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                yield from delta({"type": "thinking_delta", "thinking": ev.text})
            elif isinstance(ev, TextDelta):
                if blocks["type"] != "text":
                    yield from open_block("text", {"type": "text", "text": ""})
                yield from delta({"type": "text_delta", "text": ev.text})
            elif isinstance(ev, CallStart):
                yield from open_block("tool_use", {"type": "tool_use", "id": _use_id(ev.id), "name": ev.name,
                                                   "input": {}})
            elif isinstance(ev, ArgsDelta) and ev.fragment:
                yield from delta({"type": "input_json_delta", "partial_json": ev.fragment})

    s = turn.started
    try:
        n_prompt = len(turn.job.ids)
        yield sse({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": state.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": n_prompt - s.reused, "output_tokens": 0, "cache_read_input_tokens": s.reused,
                      "cache_creation_input_tokens": 0}}}, "message_start")
        if answer.splitter is None and answer.parser is None:  # plain text: the block opens at once
            for frame in open_block("text", {"type": "text", "text": ""}):
                yield frame
        yield sse({"type": "ping"}, "ping")
        while True:
            item = await turn.next()
            if isinstance(item, Failed):
                yield sse(error_event(PATH, item.error), "error")
                return
            if isinstance(item, Finished):
                g = item.generation
                for frame in frames(answer.finish()):
                    yield frame
                if blocks["index"] < 0:  # nothing was said: still one (empty) text block
                    for frame in open_block("text", {"type": "text", "text": ""}):
                        yield frame
                for frame in close():
                    yield frame
                reason, sequence = _stop(state, g, stops, answer.calls)
                # the turn's profile as an extra field of the event the official client already
                # reads at the end (it keeps unknown fields, in model_extra)
                yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": _usage(g), "colibri": profile_field([g])}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
                return
            for frame in frames(answer.feed(item.text)):
                yield frame
    except ClientGone:
        return
    finally:
        turn.close()
