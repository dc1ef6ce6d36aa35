"""Connection-level guards of `colibri serve`, below the ASGI app: a cap on open connections per
client address and in all, and a deadline for a request's headers (the "slowloris" defence).

They live in uvicorn's h11 protocol (one instance per TCP connection) because the app only
sees a request once its headers are complete: a client that drips header bytes, or connects
and says nothing, never reaches the API key check or any middleware, yet holds a connection
that counts against the server's limit. Refusals are written straight to the socket, a few
bytes and a close, so a flood costs the server almost nothing.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import time
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

log = logging.getLogger("colibri.serve")

WARN_EVERY_S = 10.0  # a flood of refusals is logged once per this many seconds, with a count
LINGER_S = 2.0       # how long a refused upload is read and dropped after its answer (see _LingeringTransport)


@dataclass
class ConnectionLimits:
    max_total: int = 64          # open connections in all
    max_per_ip: int = 8          # open connections from one address (IPv6: one /64)
    header_timeout: float = 10.0  # seconds from connect (or a request's first byte) to complete headers


@dataclass
class ConnectionGuard:
    """Open connections per client address, and what was refused. Touched only from the event
    loop's thread (protocol callbacks, the /metrics route), so it needs no lock."""

    limits: ConnectionLimits
    per_ip: dict[str, int] = field(default_factory=dict)
    total: int = 0
    refused_per_ip: int = 0
    refused_total: int = 0
    header_timeouts: int = 0
    _unlogged: dict[str, int] = field(default_factory=dict)
    _logged_at: float = 0.0

    def admit(self, key: str) -> str | None:
        """Count a new connection from `key`; -> None, or why it is refused ("per_ip", "total")."""
        if self.per_ip.get(key, 0) >= self.limits.max_per_ip:
            self.refused_per_ip += 1
            return self._refuse("per_ip", key)
        if self.total >= self.limits.max_total:
            self.refused_total += 1
            return self._refuse("total", key)
        self.per_ip[key] = self.per_ip.get(key, 0) + 1
        self.total += 1
        return None

    def release(self, key: str) -> None:
        n = self.per_ip.get(key, 0) - 1
        if n > 0:
            self.per_ip[key] = n
        else:
            self.per_ip.pop(key, None)
        self.total -= 1

    def _refuse(self, reason: str, key: str) -> str:
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at >= WARN_EVERY_S:  # one line per interval, not one per connection
            self._logged_at = now
            parts = ", ".join(f"{n} over the {_LIMIT_NAMES[r]}" for r, n in sorted(self._unlogged.items()))
            log.warning("refused %s connection(s) (%s; the latest from %s)", sum(self._unlogged.values()),
                        parts, key)
            self._unlogged.clear()
        return reason


_LIMIT_NAMES = {"per_ip": "per-address cap (--max-connections-per-ip)", "total": "total cap (--max-connections)"}


def client_key(addr: tuple | None) -> str:
    """The address a connection counts against. IPv6 clients usually own a whole /64, so one
    host could otherwise open connections from as many addresses as it likes."""
    if not addr:
        return "local"  # a Unix socket
    try:
        ip = ipaddress.ip_address(addr[0].split("%", 1)[0])
    except ValueError:
        return str(addr[0])
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _raw_response(status: int, reason: str, message: str, code: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, in OpenAI's error envelope (the
    path, which would pick Anthropic's, is not known yet)."""
    kind = {429: "rate_limit_error", 503: "service_unavailable_error", 408: "timeout_error"}[status]
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close"}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("latin-1") + body


class _LingeringTransport:
    """The transport as uvicorn sees it, with one change to close(): when the server answers
    before it has read the request body (413 too large, 408 too slow) and closes, the kernel
    would reset a connection that still has unread bytes, and a reset can destroy the answer
    before the client reads it. So the write side is shut (the answer, then end of stream) and
    what the client still sends is read and dropped for up to LINGER_S seconds, then the
    connection closes (nginx's "lingering close")."""

    def __init__(self, transport, protocol: "GuardedH11Protocol"):
        self._transport, self._protocol = transport, protocol
        self._closing = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        first, self._closing = not self._closing, True
        if first and self._protocol.conn.their_state is h11.SEND_BODY and self._transport.can_write_eof():
            self._protocol.linger()
        else:
            self._transport.close()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guard: a connection over a cap is answered and closed
    before anything is parsed; an admitted one must complete each request's headers in time."""

    guard: ConnectionGuard  # set on the subclass protocol_class() makes

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._key: str | None = client_key(get_remote_addr(transport))
        self._header_timer = None
        self._linger_timer = None
        self._got_bytes = False
        refusal = self.guard.admit(self._key)
        if refusal is not None:
            self._key = None
            transport.write(self._refusal(refusal))
            transport.close()  # flushes the few bytes, then closes; asyncio reads nothing more
            return
        super().connection_made(_LingeringTransport(transport, self))
        self._arm_header_deadline()  # also a client that connects and never sends a byte

    def _refusal(self, reason: str) -> bytes:
        lim = self.guard.limits
        if reason == "per_ip":
            return _raw_response(429, "Too Many Requests", f"too many open connections from your address (at most "
                                 f"{lim.max_per_ip}); reuse or close some and retry", retry_after=1,
                                 code="too_many_connections")
        return _raw_response(503, "Service Unavailable", f"the server has {lim.max_total} open connections, its "
                             "limit; retry shortly", retry_after=1, code="server_busy")

    def connection_lost(self, exc) -> None:
        if self._key is None:  # refused in connection_made: uvicorn never set this connection up
            return
        self.guard.release(self._key)
        self._key = None
        self._disarm_header_deadline()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # the rest of a body that was already refused
        self._got_bytes = True
        super().data_received(data)
        self._watch_headers()

    def linger(self) -> None:
        """See _LingeringTransport: answer sent, write side shut, the rest read and dropped."""
        raw = self.transport._transport
        raw.resume_reading()  # uvicorn pauses reading once 64 KiB of body wait unread
        raw.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

    def _watch_headers(self) -> None:
        """After each read: while h11 still waits for a request line and headers (IDLE), a
        deadline runs; once they are in, the body deadline (BodyLimitMiddleware) and the
        keep-alive timeout between requests (uvicorn's) take over."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._disarm_header_deadline()
        else:
            self._arm_header_deadline()  # the first bytes of a request on a kept-alive connection

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.guard.limits.header_timeout, self._headers_too_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.guard.header_timeouts += 1
        if self._got_bytes:  # a silent connection (a browser's preconnect) is just closed, as nginx does
            self.transport.write(_raw_response(408, "Request Timeout", "the request headers did not arrive within "
                                               f"{self.guard.limits.header_timeout:g} s", code="request_timeout"))
        self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """uvicorn instantiates `Config(http=...)` itself, so the guard travels as a class attribute."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
