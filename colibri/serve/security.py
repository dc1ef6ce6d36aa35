"""The server's guards, as plain ASGI middleware: request ids, a Host allowlist against DNS
rebinding, an Origin check and a JSON-only body rule against other web pages, the API key
(constant-time, Bearer or x-api-key), and a body size limit with a read deadline and one
framing. Each refusal is answered in the envelope of the API the path belongs to."""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import re
import socket
import uuid

from colibri.errors import ColibriError
from colibri.serve.errors import error_response
from colibri.serve.web import is_public

MAX_BODY_BYTES = 4 * 1024 * 1024
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages/count_tokens", "/v1/messages",
           "/v1/models", "/health", "/metrics", "/tokenize", "/detokenize", "/v1/telemetry/stream",
           "/v1/telemetry", "/")


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def check_bind(host: str, api_key: str | None, allow_insecure: bool) -> None:
    """Refuse to expose an unauthenticated server beyond this machine unless told to."""
    if not is_loopback(host) and not api_key and not allow_insecure:
        raise ColibriError(f"refusing to listen on {host} without an API key: anyone who can reach it could use "
                           "the model. Pass --api-key KEY (or COLI_API_KEY), or --allow-insecure-bind if this "
                           "network is trusted")


def allowed_hosts(bind_host: str, extra: list[str] | None) -> set[str] | None:
    """Host header names accepted; None accepts any (`--allowed-host '*'`)."""
    extra = [h.lower().strip() for h in extra or []]
    if "*" in extra:
        return None
    names = {*LOOPBACK_NAMES, *extra}
    if bind_host not in ("0.0.0.0", "::", ""):
        names.add(bind_host.lower().strip("[]"))
    else:  # every interface: this machine's own name and addresses
        name = socket.gethostname().lower()
        names.add(name)
        try:
            names.update(info[4][0].lower() for info in socket.getaddrinfo(name, None))
        except OSError:
            pass
    return names


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def _state(scope) -> dict:
    return scope.setdefault("state", {})


def route_label(path: str) -> str:
    for r in _ROUTES:
        if path == r:
            return r
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if is_public(path):
        return "/web/{file}"
    return "other"


class RequestIdMiddleware:
    """`x-request-id` on every response (the client's own when it sent a sane one), and the
    HTTP response counter."""

    def __init__(self, app, metrics=None):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = given if _REQUEST_ID.match(given) else f"req_{uuid.uuid4().hex}"
        _state(scope)["request_id"] = rid
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.metrics:
                self.metrics.http_responses.labels(route_label(scope["path"]), str(status)).inc()


class HostAllowlistMiddleware:
    """A browser page on evil.example that rebinds its DNS name to 127.0.0.1 still sends
    `Host: evil.example`: refusing unknown names keeps such pages off a local server."""

    def __init__(self, app, allowed: set[str] | None):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.allowed is not None:
            raw = _header(scope, b"host")
            if raw is not None:  # HTTP/1.0 clients may omit it; browsers never do
                host = _hostname(raw.decode("latin-1"))
                if host not in self.allowed:
                    resp = error_response(scope["path"], 403, f"Host '{host}' is not allowed; start the server with "
                                          "--allowed-host NAME to accept it", code="host_not_allowed")
                    return await resp(scope, receive, send)
        await self.app(scope, receive, send)


class BrowserGuardMiddleware:
    """Keeps other web pages off the server, key or no key. A page may send a cross-origin
    "simple request" (a POST with a text/plain, form or typeless body) without asking the
    server first (no CORS preflight), so answering without CORS headers would still have run it.
    So every state-changing request that names an Origin other than the server's own or one
    given with --cors-origin is refused (browsers always send Origin on such requests), and a
    body must be declared `application/json` (415 otherwise, unless --allow-any-content-type),
    which no page can send cross-origin without the preflight that CORS then refuses."""

    def __init__(self, app, cors_origins: list[str], any_content_type: bool = False):
        self.app, self.any_content_type = app, any_content_type
        self.any_origin = "*" in cors_origins
        self.origins = {o.lower().rstrip("/") for o in cors_origins}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in STATE_CHANGING:
            return await self.app(scope, receive, send)
        origin = _header(scope, b"origin")
        if origin is not None and not self._allowed(origin.decode("latin-1"), scope):
            resp = error_response(scope["path"], 403, f"requests from the web page origin "
                                  f"'{origin.decode('latin-1')}' are not allowed; start the server with "
                                  "--cors-origin ORIGIN to accept it", code="origin_not_allowed")
            return await resp(scope, receive, send)
        if scope["method"] != "DELETE" and not self.any_content_type:
            given = (_header(scope, b"content-type") or b"").decode("latin-1")
            if given.split(";", 1)[0].strip().lower() != "application/json":
                resp = error_response(scope["path"], 415, "the request body must be sent as 'Content-Type: "
                                      f"application/json', not {given or 'without a type'!r}; start the server "
                                      "with --allow-any-content-type for clients that cannot set it",
                                      param="content-type", code="unsupported_media_type",
                                      headers={"connection": "close"})
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)

    def _allowed(self, origin: str, scope) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        host = (_header(scope, b"host") or b"").decode("latin-1").strip().lower()
        _, sep, authority = origin.partition("://")
        return bool(sep and host) and authority == host  # the server's own page (the dashboard)


def _hostname(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients),
    compared in constant time. /health stays reachable: it answers only "ok" to strangers; so
    does the dashboard's page (it holds no secrets and asks for the key itself)."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None

    def authenticated(self, scope) -> bool:
        if self.key is None:
            return True
        given = _header(scope, b"x-api-key")
        auth = _header(scope, b"authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return given is not None and hmac.compare_digest(given, self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ok = self.authenticated(scope)
        _state(scope)["authenticated"] = ok
        if not ok and scope["path"] != "/health" and not is_public(scope["path"]):
            resp = error_response(scope["path"], 401, "missing or wrong API key: send 'Authorization: Bearer KEY' "
                                  "or 'x-api-key: KEY'", code="invalid_api_key",
                                  headers={"www-authenticate": "Bearer"})
            return await resp(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the whole body (at most `max_bytes`, within `read_timeout` seconds against slow
    clients) before the app sees the request, then replays it."""

    def __init__(self, app, max_bytes: int = MAX_BODY_BYTES, read_timeout: float = 30.0):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        length = _header(scope, b"content-length")
        if length is not None and _header(scope, b"transfer-encoding") is not None:
            # Two framings: a proxy in front may read the body by the other one, so what follows
            # it on this connection could be smuggled in as a request of its own (RFC 9112 6.3)
            resp = error_response(path, 400, "the request has both Content-Length and Transfer-Encoding; send one",
                                  code="ambiguous_framing", headers={"connection": "close"})
            return await resp(scope, receive, send)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except asyncio.TimeoutError:
            resp = error_response(path, 408, f"the request body did not arrive within {self.read_timeout:g} s",
                                  code="request_timeout", headers={"connection": "close"})
            return await resp(scope, receive, send)
        except _TooLarge:
            return await self._too_large(scope, receive, send)
        if body is None:  # the client went away
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes | None:
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope, receive, send):
        resp = error_response(scope["path"], 413, f"the request body is larger than {self.max_bytes} bytes",
                              code="request_too_large", headers={"connection": "close"})
        await resp(scope, receive, send)


class _TooLarge(Exception):
    pass
