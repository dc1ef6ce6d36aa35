"""API errors and their two wire envelopes: OpenAI's `{"error": {...}}` everywhere, Anthropic's
`{"type": "error", "error": {...}}` on /v1/messages (the shapes the official clients parse)."""
from __future__ import annotations

import json

from starlette.responses import Response

# OpenAI's error `type` per status (its API uses these strings; clients mostly read the status).
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "service_unavailable_error"}
# Anthropic's documented error types.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                    415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


class ApiError(Exception):
    """A request the server refuses: status, a one-line message, and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(error_body(path, status, message, param, code), ensure_ascii=False)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def api_error_response(path: str, e: ApiError) -> Response:
    return error_response(path, e.status, e.message, e.param, e.code, e.headers)
