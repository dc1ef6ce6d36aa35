"""Request bodies of the HTTP API as strict pydantic models (OpenAI chat/completions, Anthropic
messages, tokenize), and `parse`, which turns any malformed body into a 400 naming the field.

Strict: a number sent as a string is a wrong type, not something to coerce. Unknown fields are
refused by name (never silently ignored); fields of the real APIs that colibri does not implement
are declared here and refused in the protocol modules when set to anything but their neutral value.
"""
from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from colibri.serve.errors import bad_request

MAX_STOP = 4
MAX_STOP_CHARS = 1024  # each stop string: the decoder holds back that much text while it might match
MAX_TOP_LOGPROBS = 20
MAX_N = 16  # choices per request: each is a full generation, one after another
# Seeds are what numpy's generator takes without folding: 0..2**64-1. A negative or larger seed
# is a 400 naming `seed` (leave it out for a random one), never silently reduced modulo 2**64.
MAX_SEED = 2 ** 64 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ContentBlock(BaseModel):
    """A content block: its `type` decides which other keys it has, so they are checked by type."""
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


# ---------------------------------------------------------------------------------- OpenAI
class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentBlock] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    # not implemented (tool calling, audio): refused when present
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    audio: Any = None


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # there is nothing to obfuscate on a local server


class SamplingRequest(_Strict):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: off (vLLM and llama.cpp spellings)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    cache_slot: int | None = Field(None, ge=0)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> -100..100
    # vLLM's and llama.cpp's extensions
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool | None = None                    # generate max_tokens even past end-of-sequence
    guided_json: dict[str, Any] | str | None = None   # a JSON schema (object or its JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None                 # Lark (llguidance's dialect)
    # accepted and without effect on a local single-user server
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    enable_thinking: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# ---------------------------------------------------------------------------------- Anthropic
class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)
    display: str | None = None


class AnthropicPrompt(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[ContentBlock] | None = None
    thinking: ThinkingConfig | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    cache_slot: int | None = Field(None, ge=0)


class MessagesRequest(AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # not in Anthropic's API; colibri's extension, as for OpenAI
    # accepted and without effect on a local server
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: Any = None
    inference_geo: str | None = None
    workspace_id: str | None = None
    user_profile_id: str | None = None


class CountTokensRequest(AnthropicPrompt):
    cache_control: Any = None


# ---------------------------------------------------------------------------------- Responses
class ResponsesRequest(_Strict):
    """OpenAI's Responses API (POST /v1/responses). Items are checked by type in responses_api.py."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    cache_slot: int | None = Field(None, ge=0)
    # accepted and without effect on a local server
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    moderation: Any = None
    # not implemented: refused when set
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    context_management: Any = None
    access_programs: Any = None


# ---------------------------------------------------------------------------------- tokenizer
class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # with messages: rendered as the chat route renders them
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    enable_thinking: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------- parsing
T = TypeVar("T", bound=BaseModel)


def parse(body: bytes, model: type[T]) -> T:
    """JSON bytes -> a validated request; anything wrong -> ApiError(400) naming the field."""
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(obj).__name__}")
    try:
        _check_text(obj, "")
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = field_path(obj, err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field '{param}': colibri does not implement it", param=param) from None
        if err["type"] == "missing":
            raise bad_request(f"'{param}' is required", param=param) from None
        raise bad_request(f"'{param}': {err['msg']}", param=param) from None


def field_path(obj: Any, loc: tuple) -> str:
    """pydantic's error location as the request spells it (`messages[0].content`), leaving out
    the union-member tags pydantic inserts (`str`, `list[ContentBlock]`)."""
    out = ""
    for part in loc:
        if isinstance(part, int) and isinstance(obj, list) and 0 <= part < len(obj):
            out, obj = f"{out}[{part}]", obj[part]
        elif isinstance(part, str) and isinstance(obj, dict):
            out, obj = (f"{out}.{part}" if out else part), obj.get(part)
    return out or "body"


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_text(value: Any, path: str) -> None:
    """Strings must be encodable Unicode: JSON can carry lone UTF-16 surrogates ("\\ud800") that
    no tokenizer can take."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"'{path or 'body'}' contains a lone UTF-16 surrogate; send valid Unicode text",
                              param=path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, path)
            _check_text(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}[{i}]")
