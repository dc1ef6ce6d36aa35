"""Anthropic Messages API (/v1/messages, /v1/messages/count_tokens): a translation onto the same
generation path as the OpenAI routes, answered in the shapes and SSE event order the official
`anthropic` client parses (message_start, content_block_start/delta/stop, message_delta, message_stop)."""
from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, StreamingResponse

from colibri.serve.app import ClientGone, ServerState, Turn, collect, error_event, gone_response, read_json, sse
from colibri.serve.errors import bad_request
from colibri.serve.openai_api import stop_list
from colibri.serve.scheduler import Failed, Finished
from colibri.serve.schemas import CountTokensRequest, MessagesRequest, AnthropicPrompt

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


async def _prompt(state: ServerState, req: AnthropicPrompt) -> tuple[list[int], str, bool]:
    """-> (prompt ids, prompt text, whether to split thinking from the answer)."""
    if req.tools:
        raise bad_request("'tools': tool use is not implemented yet", param="tools")
    if req.tool_choice is not None and (not isinstance(req.tool_choice, dict) or req.tool_choice.get("type") != "none"):
        raise bad_request("'tool_choice': tool use is not implemented yet", param="tool_choice")
    enable = None
    if req.thinking is not None:
        enable = req.thinking.type != "disabled"
    template_kwargs, split = state.thinking(enable, "thinking")
    messages = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else _text_blocks(req.system, "system")[0]
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            text, thinking = m.content, ""
        else:
            text, thinking = _text_blocks(m.content, f"messages[{i}].content", allow_thinking=m.role == "assistant")
        msg = {"role": m.role, "content": text}
        if thinking:
            msg["reasoning_content"] = thinking
        messages.append(msg)
    prefill = ""
    if messages[-1]["role"] == "assistant":  # the answer starts with this text; the model continues it
        prefill = messages.pop()["content"]
    ids, text = await state.encode_chat(messages, prefill=prefill, **template_kwargs)
    return ids, text, split


def _usage(g) -> dict:
    # Anthropic counts cache reads apart from input_tokens (input = input_tokens + cache reads).
    return {"input_tokens": g.prompt_tokens - g.prompt_tokens_reused, "output_tokens": g.completion_tokens,
            "cache_read_input_tokens": g.prompt_tokens_reused, "cache_creation_input_tokens": 0}


def _stop(state: ServerState, g, stops: list[str]) -> tuple[str, str | None]:
    """-> (stop_reason, stop_sequence). The engine ends on a stop string or an end token alike;
    the stop string, when one ended it, is in the decoded tokens (it never reaches the text)."""
    if g.finish_reason == "length":
        return "max_tokens", None
    if stops:
        full = state.tokenizer.decode(g.token_ids)
        found = [(full.find(s), s) for s in stops if s and s in full]
        if found:
            return "stop_sequence", min(found)[1]
    return "end_turn", None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, CountTokensRequest)
    state.check_model(req.model)
    ids, _, _ = await _prompt(state, req)
    return {"input_tokens": len(ids)}


@router.post(PATH)
async def messages(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, MessagesRequest)
    state.check_model(req.model)
    ids, prompt_text, split = await _prompt(state, req)
    state.check_prompt(ids, "messages")
    stops = stop_list(req.stop_sequences, "stop_sequences")
    max_tokens, adjusted = state.token_budget(req.max_tokens, "max_tokens", len(ids))
    options = state.sampling(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                             top_k=req.top_k, seed=req.seed, stop=stops, logprobs=None)
    turn = Turn(state, request, ids, options, state.check_slot(req.cache_slot), adjusted=adjusted)
    await turn.start()
    splitter = state.splitter(split, prompt_text)
    mid = "msg_" + uuid.uuid4().hex[:24]
    if req.stream:
        return StreamingResponse(_stream(state, turn, mid, stops, splitter), media_type="text/event-stream",
                                 headers={**turn.headers, "cache-control": "no-cache"})
    try:
        _, done = await collect(turn)
    except ClientGone:
        return gone_response()
    finally:
        turn.close()
    g = done.generation
    content = []
    text = g.text
    if splitter is not None:
        r1, c1 = splitter.feed(g.text)
        r2, c2 = splitter.flush()
        if r1 + r2:
            content.append({"type": "thinking", "thinking": r1 + r2, "signature": ""})
        text = c1 + c2
    content.append({"type": "text", "text": text})
    reason, sequence = _stop(state, g, stops)
    return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": state.model_id,
                         "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(g)},
                        headers=turn.headers)


async def _stream(state: ServerState, turn: Turn, mid: str, stops: list[str], splitter):
    blocks = {"index": -1, "type": None}

    def switch(kind: str):
        """Close the open content block and open one of `kind` (thinking or text)."""
        if blocks["type"] == kind:
            return
        if blocks["type"] is not None:
            yield sse({"type": "content_block_stop", "index": blocks["index"]}, "content_block_stop")
        blocks["index"] += 1
        blocks["type"] = kind
        block = {"type": "text", "text": ""} if kind == "text" else \
            {"type": "thinking", "thinking": "", "signature": ""}
        yield sse({"type": "content_block_start", "index": blocks["index"], "content_block": block},
                  "content_block_start")

    def deltas(text: str, final: bool = False):
        if splitter is None:
            pairs = [("", text)]
        else:
            pairs = [splitter.feed(text)] + ([splitter.flush()] if final else [])
        for reasoning, content in pairs:
            if reasoning:
                yield from switch("thinking")
                yield sse({"type": "content_block_delta", "index": blocks["index"],
                           "delta": {"type": "thinking_delta", "thinking": reasoning}}, "content_block_delta")
            if content:
                yield from switch("text")
                yield sse({"type": "content_block_delta", "index": blocks["index"],
                           "delta": {"type": "text_delta", "text": content}}, "content_block_delta")

    s = turn.started
    try:
        n_prompt = len(turn.job.ids)
        yield sse({"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": state.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": n_prompt - s.reused, "output_tokens": 0, "cache_read_input_tokens": s.reused,
                      "cache_creation_input_tokens": 0}}}, "message_start")
        if splitter is None:
            for frame in switch("text"):
                yield frame
        yield sse({"type": "ping"}, "ping")
        while True:
            item = await turn.next()
            if isinstance(item, Failed):
                yield sse(error_event(PATH, item.error), "error")
                return
            if isinstance(item, Finished):
                g = item.generation
                for frame in deltas("", final=True):
                    yield frame
                if blocks["type"] is None:  # nothing was said: still one (empty) text block
                    for frame in switch("text"):
                        yield frame
                yield sse({"type": "content_block_stop", "index": blocks["index"]}, "content_block_stop")
                reason, sequence = _stop(state, g, stops)
                yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                           "usage": _usage(g)}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
                return
            for frame in deltas(item.text):
                yield frame
    except ClientGone:
        return
    finally:
        turn.close()
