"""OpenAI's Responses API: POST /v1/responses (streamed or not), GET and DELETE /v1/responses/{id}.

The same generation path as chat completions (openai_api.prepare_chat): input items become chat
messages in the Hugging Face convention, function tools and `text.format` become the same tool
plan and grammar. A stored response keeps its whole conversation, so `previous_response_id`
continues it: the next prompt renders that conversation plus the new items, and the KV slot
that holds the earlier prompt prefills only what is new (the engine reuses the longest common
prefix). Responses are kept in memory, the most recent STORE_LIMIT of them.
"""
from __future__ import annotations

import copy
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from colibri.serve.errors import ApiError, bad_request
from colibri.serve.openai_api import ChatSetup, answer_stream, prepare_chat, response_format_spec
from colibri.serve.profile_api import profile_field
from colibri.serve.scheduler import Failed, Finished
from colibri.serve.schemas import ResponsesRequest
from colibri.serve.state import ClientGone, ServerState, Turn, collect, error_event, read_json, sse, sse_response
from colibri.serve.tools import (ArgsDelta, CallEnd, CallStart, Reasoning, TextDelta, check_tool_count, function_tool,
                                 parse_arguments)

router = APIRouter()
PATH = "/v1/responses"
STORE_LIMIT = 256
_REFUSED = ("background", "background_options", "conversation", "prompt", "max_tool_calls", "context_management",
            "access_programs")


@dataclass
class Stored:
    body: dict
    messages: list[dict]          # the whole conversation, this response's output included
    calls: dict[str, str]         # call id -> function name, for later function_call_output items


@dataclass
class ResponseStore:
    items: OrderedDict = field(default_factory=OrderedDict)

    def put(self, rid: str, stored: Stored) -> None:
        self.items[rid] = stored
        self.items.move_to_end(rid)
        while len(self.items) > STORE_LIMIT:
            self.items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> Stored:
        stored = self.items.get(rid)
        if stored is None:
            raise ApiError(404 if param is None else 400, f"no stored response has the id {rid!r} (this server keeps "
                           f"the last {STORE_LIMIT}, in memory)", param=param, code="response_not_found")
        return stored


def _store(state: ServerState) -> ResponseStore:
    if state.responses is None:
        state.responses = ResponseStore()
    return state.responses


# ---------------------------------------------------------------------------------- request
def _tools(tools: list | None) -> list[dict]:
    check_tool_count(tools)
    out = []
    for i, t in enumerate(tools or []):
        param = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"'{param}': only function tools are served, not {kind!r}", param=f"{param}.type")
        out.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), param, t.get("strict")))
    names = [t["function"]["name"] for t in out]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"'tools[{i}]': two tools are named {name!r}", param=f"tools[{i}]")
    return out


def _text(content, param: str) -> str:
    """A message's content: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or a list of text parts", param=param)
    parts = []
    for k, c in enumerate(content):
        if not isinstance(c, dict) or c.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(c.get("text"), str):
            kind = c.get("type") if isinstance(c, dict) else None
            raise bad_request(f"'{param}[{k}]': {kind!r} content is not supported; this server takes text only",
                              param=f"{param}[{k}]")
        parts.append(c["text"])
    return "\n".join(parts)


def _messages(items, calls: dict[str, str]) -> list[dict]:
    """Input items -> chat messages (Hugging Face convention). `calls` (call id -> name) grows
    with the function_call items seen, so outputs can be matched to them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"'{where}.role' must be user, system, developer or assistant", param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            cid, name = item.get("call_id"), item.get("name")
            if not isinstance(cid, str) or not isinstance(name, str):
                raise bad_request(f"'{where}' needs 'call_id' and 'name'", param=where)
            calls[cid] = name
            call = {"id": cid, "type": "function",
                    "function": {"name": name, "arguments": parse_arguments(item.get("arguments", "{}"),
                                                                             f"{where}.arguments")}}
            if out and out[-1]["role"] == "assistant":  # the calls of one turn share its message
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if cid not in calls:
                raise bad_request(f"'{where}.call_id' {cid!r} answers no function_call of this conversation",
                                  param=f"{where}.call_id")
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": cid, "name": calls[cid],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: templates drop it from past turns
        else:
            raise bad_request(f"'{where}.type' {kind!r} is not supported (message, function_call, "
                              "function_call_output, reasoning)", param=f"{where}.type")
    return out


def _format_spec(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") != "json_schema":
        return response_format_spec(fmt, "text.format")
    # Responses put the schema fields on the format itself, chat nests them under json_schema
    return response_format_spec({"type": "json_schema", "json_schema": fmt}, "text.format")


# ---------------------------------------------------------------------------------- the route
@router.post(PATH)
async def create_response(request: Request):
    state: ServerState = request.app.state.colibri
    req = await read_json(request, ResponsesRequest)
    state.check_model(req.model)
    for name in _REFUSED:
        if getattr(req, name) not in (None, False):
            raise bad_request(f"'{name}' is not implemented", param=name)
    store = _store(state)
    earlier: list[dict] = []
    calls: dict[str, str] = {}
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id, "previous_response_id")
        earlier, calls = list(prev.messages), dict(prev.calls)
    new = _messages(req.input, calls)
    if not new:
        raise bad_request("'input' is empty", param="input")
    conversation = earlier + new
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    effort = (req.reasoning or {}).get("effort")
    setup = await prepare_chat(state, req, messages, _tools(req.tools), req.tool_choice, _format_spec(req.text),
                               thinking=(None if effort is None else effort != "none", "reasoning.effort"),
                               limit=(req.max_output_tokens, "max_output_tokens"),
                               logprobs=req.top_logprobs, stop=[], format_param="text.format", prompt_param="input")
    turn = Turn(state, request, setup.ids, setup.options, state.check_slot(req.cache_slot), adjusted=setup.adjusted)
    await turn.start()
    rid = "resp_" + uuid.uuid4().hex
    shell = _shell(state, req, rid)
    def save(body: dict, answer) -> None:
        """Keep the response and its conversation for GET and previous_response_id."""
        if req.store is not False:
            made = {c.id: c.name for c in answer.calls}
            store.put(rid, Stored(body, conversation + OutputBuilder.messages(answer), {**calls, **made}))

    if req.stream:
        return sse_response(turn, _stream(state, turn, setup, shell, save))
    _, done = await collect(turn)
    answer = answer_stream(state, setup)
    builder = OutputBuilder()
    builder.apply(answer.feed(done.generation.text))
    builder.apply(answer.finish())
    body = _finish(shell, builder, done.generation)
    save(body, answer)
    return JSONResponse(body, headers=turn.headers)


@router.get(PATH + "/{response_id}")
async def get_response(request: Request, response_id: str):
    return _store(request.app.state.colibri).get(response_id).body


@router.delete(PATH + "/{response_id}")
async def delete_response(request: Request, response_id: str):
    store = _store(request.app.state.colibri)
    store.get(response_id)
    del store.items[response_id]
    return {"id": response_id, "object": "response", "deleted": True}


# ---------------------------------------------------------------------------------- the answer
def _shell(state: ServerState, req: ResponsesRequest, rid: str) -> dict:
    """The response object before its output: what the request asked for, echoed."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": state.model_id, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning or {"effort": None},
            "store": req.store is not False, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": req.truncation or "disabled", "metadata": req.metadata or {},
            "user": req.user, "usage": None}


class OutputBuilder:
    """Answer events -> Responses output items, in order: a reasoning item, a message item,
    function_call items; `stream_events` says what happened for the SSE stream."""

    def __init__(self):
        self.items: list[dict] = []
        self.current: dict | None = None

    def _open(self, item: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.items.append(item)
        self.current = item
        added = copy.deepcopy(item)  # events are sent after later deltas change the item
        if item["type"] == "message":
            added["content"] = []    # its part arrives in content_part.added
        events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": added}))
        if item["type"] == "message":
            events.append(("response.content_part.added", self._part_ref() | {"part": _text_part("")}))
        return events

    def _part_ref(self) -> dict:
        return {"item_id": self.current["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _close(self) -> list[tuple[str, dict]]:
        item, events = self.current, []
        if item is None:
            return events
        ref = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events.append(("response.output_text.done", self._part_ref() | {"text": text, "logprobs": []}))
            events.append(("response.content_part.done", self._part_ref() | {"part": _text_part(text)}))
        elif item["type"] == "reasoning":
            events.append(("response.reasoning_text.done", ref | {"content_index": 0,
                                                                  "text": item["content"][0]["text"]}))
        elif item["type"] == "function_call":
            events.append(("response.function_call_arguments.done", ref | {"arguments": item["arguments"],
                                                                           "name": item["name"]}))
        item["status"] = "completed"
        events.append(("response.output_item.done", {"output_index": len(self.items) - 1, "item": copy.deepcopy(item)}))
        self.current = None
        return events

    def apply(self, events: list) -> list[tuple[str, dict]]:
        out = []
        for ev in events:
            kind = self.current["type"] if self.current else None
            if isinstance(ev, Reasoning):
                if kind != "reasoning":
                    out += self._open({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                                       "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"})
                self.current["content"][0]["text"] += ev.text
                out.append(("response.reasoning_text.delta", self._part_ref() | {"delta": ev.text}))
            elif isinstance(ev, TextDelta):
                if kind != "message":
                    if not ev.text.strip():
                        continue  # whitespace between calls opens no message
                    out += self._open({"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant",
                                       "status": "in_progress", "content": [_text_part("")]})
                self.current["content"][0]["text"] += ev.text
                out.append(("response.output_text.delta", self._part_ref() | {"delta": ev.text, "logprobs": []}))
            elif isinstance(ev, CallStart):
                out += self._open({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": ev.id,
                                   "name": ev.name, "arguments": "", "status": "in_progress"})
            elif isinstance(ev, ArgsDelta) and ev.fragment:
                self.current["arguments"] += ev.fragment
                out.append(("response.function_call_arguments.delta",
                            {"item_id": self.current["id"], "output_index": len(self.items) - 1,
                             "delta": ev.fragment}))
            elif isinstance(ev, CallEnd):
                out += self._close()
        return out

    def done(self) -> list[tuple[str, dict]]:
        return self._close()

    @staticmethod
    def messages(answer) -> list[dict]:
        """This output as the conversation's next assistant message."""
        msg = {"role": "assistant", "content": answer.content}
        if answer.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                 for c in answer.calls]
        return [msg]


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _finish(shell: dict, builder: OutputBuilder, g) -> dict:
    builder.done()
    body = dict(shell, output=builder.items, status="completed")
    if g.finish_reason == "length":
        body.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    elif g.finish_reason == "grammar_dead_end":
        body.update(status="incomplete", incomplete_details={"reason": "grammar_dead_end"})
    body["usage"] = {"input_tokens": g.prompt_tokens, "output_tokens": g.completion_tokens,
                     "total_tokens": g.prompt_tokens + g.completion_tokens,
                     "input_tokens_details": {"cached_tokens": g.prompt_tokens_reused},
                     "output_tokens_details": {"reasoning_tokens": 0}}
    body["colibri"] = profile_field([g])
    return body


async def _stream(state: ServerState, turn: Turn, setup: ChatSetup, shell: dict, save):
    seq = 0

    def event(kind: str, data: dict) -> str:
        nonlocal seq
        frame = sse({"type": kind, "sequence_number": seq, **data}, kind)
        seq += 1
        return frame

    answer = answer_stream(state, setup)
    builder = OutputBuilder()
    try:
        yield event("response.created", {"response": shell})
        yield event("response.in_progress", {"response": shell})
        while True:
            item = await turn.next()
            if isinstance(item, Failed):
                yield sse(error_event(PATH, item.error), "error")
                return
            if isinstance(item, Finished):
                for kind, data in builder.apply(answer.finish()) + builder.done():
                    yield event(kind, data)
                body = _finish(shell, builder, item.generation)
                save(body, answer)
                yield event("response.completed" if body["status"] == "completed" else "response.incomplete",
                            {"response": body})
                return
            for kind, data in builder.apply(answer.feed(item.text)):
                yield event(kind, data)
    except ClientGone:
        return
    finally:
        turn.close()
