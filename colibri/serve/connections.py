"""Connection-level guards of `colibri serve`, below the ASGI app: a cap on open connections per
client address and in all, and a deadline for a request's headers (the "slowloris" defence).

They live in uvicorn's h11 protocol (one instance per TCP connection) because the app only
sees a request once its headers are complete: a client that drips header bytes, or connects
and says nothing, never reaches the API key check or any middleware, yet holds a connection
that counts against the server's limit.

A connection over a cap is not refused as it opens: a client that gets a close (or a reset)
before it has sent its request never reads the answer. It waits instead, outside the table,
while its request line and headers arrive (at most MAX_HEAD_BYTES, within the header
deadline), then gets its 429 / 503 with Retry-After and a close. When the table is full and a
waiting client's headers are complete, the admitted connection that has sent the least of
its current headers (an idle kept-alive one, then the slowest dripper) is closed to make room,
so drippers from many addresses, each under the per-address cap, cannot lock out a client that
sends its whole request at once (nginx closes idle keep-alive connections the same way). A
client at its own address's cap makes room the same way from its own idle kept-alive
connections only: a pooling client's idle connections (kept KEEP_ALIVE_S) never lock it out.
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
MAX_HEAD_BYTES = 16 * 1024  # a waiting client's request line and headers (h11's and uvicorn's own limit)
# An idle kept-alive connection is closed after this many seconds. Longer than the clients' own
# idle expiry (httpx 5 s, undici 4 s, aiohttp 15 s) so that the client, not the server, closes
# it: a server closing at the moment the client reuses the connection resets that request (the
# soak saw it with httpx at the 5 s both sides had). Idle connections are evictable under both
# caps, so the longer wait holds no place a request needs. nginx's default is 75 s too.
KEEP_ALIVE_S = 75


@dataclass
class ConnectionLimits:
    max_total: int = 64          # open connections in all
    max_per_ip: int = 8          # open connections from one address (IPv6: one /64)
    header_timeout: float = 10.0  # seconds from connect (or a request's first byte) to complete headers

    @property
    def max_waiting(self) -> int:
        """Connections over a cap that are read until their headers are in, to be answered."""
        return self.max_total


@dataclass
class ConnectionGuard:
    """Open connections per client address, those waiting to be answered, and what was refused.
    Touched only from the event loop's thread (protocol callbacks, the /metrics route), so it
    needs no lock."""

    limits: ConnectionLimits
    per_ip: dict[str, int] = field(default_factory=dict)
    total: int = 0
    refused_per_ip: int = 0
    refused_total: int = 0
    header_timeouts: int = 0
    evicted: int = 0                 # admitted connections closed to make room for a complete request
    admitted: set = field(default_factory=set)     # GuardedH11Protocol, counted in `total`
    waiting: dict = field(default_factory=dict)    # GuardedH11Protocol -> None, oldest first
    lingering: int = 0
    _unlogged: dict[str, int] = field(default_factory=dict)
    _logged_at: float = 0.0

    def over_cap(self, key: str) -> str | None:
        """Why a connection from `key` cannot be counted now ("per_ip", "total"), or None."""
        if self.per_ip.get(key, 0) >= self.limits.max_per_ip:
            return "per_ip"
        if self.total >= self.limits.max_total:
            return "total"
        return None

    def count(self, conn: GuardedH11Protocol) -> None:
        self.per_ip[conn.key] = self.per_ip.get(conn.key, 0) + 1
        self.total += 1
        self.admitted.add(conn)

    def release(self, conn: GuardedH11Protocol) -> None:
        if conn in self.admitted:
            self.admitted.discard(conn)
            n = self.per_ip.get(conn.key, 0) - 1
            if n > 0:
                self.per_ip[conn.key] = n
            else:
                self.per_ip.pop(conn.key, None)
            self.total -= 1
        self.waiting.pop(conn, None)

    def least_sent(self) -> GuardedH11Protocol | None:
        """The admitted connection to close for a newcomer: one between requests or in its
        headers (never one whose request is being answered) that has sent the fewest header
        bytes, the oldest of those first."""
        candidates = [c for c in self.admitted if c.in_headers()]
        return min(candidates, key=lambda c: (c.head_bytes, c.head_started), default=None)

    def idle_of(self, key: str) -> GuardedH11Protocol | None:
        """An admitted connection from `key` idle between requests (kept alive, no byte of a
        next request yet), the longest idle first."""
        idle = [c for c in self.admitted if c.key == key and not c.head_bytes and c.in_headers()]
        return min(idle, key=lambda c: c.head_started, default=None)

    def refused(self, reason: str, key: str) -> None:
        if reason == "per_ip":
            self.refused_per_ip += 1
        else:
            self.refused_total += 1
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at >= WARN_EVERY_S:  # one line per interval, not one per connection
            self._logged_at = now
            parts = ", ".join(f"{n} over the {_LIMIT_NAMES[r]}" for r, n in sorted(self._unlogged.items()))
            log.warning("refused %s connection(s) (%s; the latest from %s)", sum(self._unlogged.values()),
                        parts, key)
            self._unlogged.clear()


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
    app, which would pick Anthropic's by the path, is never reached)."""
    kind = {429: "rate_limit_error", 503: "service_unavailable_error", 408: "timeout_error"}[status]
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close"}
    if retry_after is not None:
        headers["retry-after"] = str(retry_after)
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("latin-1") + body


def _head_length(buf: bytearray) -> int | None:
    """The bytes of the request line and headers at the start of `buf` (None while they are
    incomplete); what follows is the body. h11 accepts bare LF line ends too."""
    ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := buf.find(sep)) >= 0]
    return min(ends, default=None)


class _LingeringTransport:
    """The transport as uvicorn sees it, with one change to close(): when the server answers
    before it has read the request body (413 too large, 408 too slow) and closes, the kernel
    would reset a connection that still has unread bytes, and a reset can destroy the answer
    before the client reads it. So the write side is shut (the answer, then end of stream) and
    what the client still sends is read and dropped for up to LINGER_S seconds, then the
    connection closes (nginx's "lingering close")."""

    def __init__(self, transport, protocol: GuardedH11Protocol):
        self._transport, self._protocol = transport, protocol
        self._closing = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        first, self._closing = not self._closing, True
        if first and self._protocol.conn.their_state is h11.SEND_BODY:
            self._protocol.linger()
        else:
            self._transport.close()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guard. A connection under the caps is handed to uvicorn
    at once and must complete each request's headers in time; one over a cap waits outside
    uvicorn until its headers are in (see the module's docstring)."""

    guard: ConnectionGuard  # set on the subclass protocol_class() makes

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.key = client_key(get_remote_addr(transport))
        self._raw = transport
        self._header_timer = None
        self._linger_timer = None
        self._got_bytes = False
        self._refused = False     # answered outside uvicorn: what still comes is dropped
        self._head: bytearray | None = None  # while waiting: the bytes read so far
        self._in_uvicorn = False  # admitted: uvicorn set the connection up, so it must see it lost too
        self.head_bytes = 0       # bytes of the current request's head (eviction picks the fewest)
        self.head_started = time.monotonic()
        guard = self.guard
        self._over = guard.over_cap(self.key)  # the cap it is over, if it waits
        if self._over is None:
            self._admit()
        else:
            # Room among the waiting: the oldest waiter is the slowest, and an address that
            # already has a cap's worth waiting makes room from its own
            mine = [c for c in guard.waiting if c.key == self.key]
            if len(mine) >= guard.limits.max_per_ip:
                mine[0]._refuse(mine[0]._over)
            elif len(guard.waiting) >= guard.limits.max_waiting:
                oldest = next(iter(guard.waiting))
                oldest._refuse(oldest._over)
            self._head = bytearray()
            guard.waiting[self] = None
        self._arm_header_deadline()  # also a client that connects and never sends a byte

    def _admit(self) -> None:
        self.guard.waiting.pop(self, None)
        self.guard.count(self)
        self._in_uvicorn = True
        super().connection_made(_LingeringTransport(self._raw, self))

    def _refusal(self, reason: str) -> bytes:
        lim = self.guard.limits
        if reason == "per_ip":
            return _raw_response(429, "Too Many Requests", f"too many open connections from your address (at most "
                                 f"{lim.max_per_ip}); reuse or close some and retry", retry_after=1,
                                 code="too_many_connections")
        return _raw_response(503, "Service Unavailable", f"the server has {lim.max_total} open connections, its "
                             "limit; retry shortly", retry_after=1, code="server_busy")

    def _refuse(self, reason: str) -> None:
        """Answer a waiting connection and close it, reading and dropping what it still sends
        for a moment so that the answer is not lost to a reset."""
        self.guard.waiting.pop(self, None)
        self.guard.refused(reason, self.key)
        self._refused, self._head = True, None
        self._disarm_header_deadline()
        self._raw.write(self._refusal(reason))
        self._shut_and_linger()

    def _shut_and_linger(self) -> None:
        raw = self._raw
        if raw.is_closing():
            return
        if self.guard.lingering >= self.guard.limits.max_total or not raw.can_write_eof():
            raw.close()  # under a flood, sockets are not kept for politeness
            return
        self.guard.lingering += 1
        raw.resume_reading()  # uvicorn pauses reading once 64 KiB of body wait unread
        raw.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

    def connection_lost(self, exc) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
            self.guard.lingering -= 1
        self._disarm_header_deadline()
        self.guard.release(self)
        if self._in_uvicorn:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None or self._refused:
            return  # the rest of a request that was already answered
        self._got_bytes = True
        if self._head is not None:
            return self._read_waiting(data)
        if self.conn.their_state is h11.IDLE:
            if not self.head_bytes:
                self.head_started = time.monotonic()
            self.head_bytes += len(data)
        super().data_received(data)
        self._watch_headers()

    def _read_waiting(self, data: bytes) -> None:
        self._head += data
        head_len = _head_length(self._head)
        if head_len is None and len(self._head) <= MAX_HEAD_BYTES:
            return
        reason = self.guard.over_cap(self.key)
        # the head's own size: body bytes that came in the same reads do not make it too long
        if reason is not None and head_len is not None and head_len <= MAX_HEAD_BYTES:
            # over the total cap: the least-sent connection of anyone; over its own address's
            # cap: only an idle kept-alive connection of that address (its pool's, long idle
            # under the keep-alive timeout), never one with a request under way
            victim = self.guard.least_sent() if reason == "total" else self.guard.idle_of(self.key)
            if victim is not None:
                victim.evict()
                reason = None
        if reason is not None:
            return self._refuse(reason)
        head, self._head = bytes(self._head), None
        self._disarm_header_deadline()
        self._admit()
        self.head_bytes, self.head_started = len(head), time.monotonic()
        super().data_received(head)
        self._watch_headers()

    def in_headers(self) -> bool:
        """Between requests or inside a request's head: nothing of it is being answered."""
        return (not self.transport.is_closing() and self.conn.their_state is h11.IDLE
                and self.conn.our_state is h11.IDLE)

    def evict(self) -> None:
        """Close an admitted connection to make room (see ConnectionGuard.least_sent)."""
        self.guard.evicted += 1
        if self.head_bytes:  # one that had started a request hears why
            self.transport.write(_raw_response(503, "Service Unavailable", "the server needed this connection for "
                                               "a complete request while your headers were still arriving; retry",
                                               retry_after=1, code="server_busy"))
        # its place is free now, not once the close completes (uvicorn's limit_concurrency
        # counts its own set of connections)
        self.guard.release(self)
        self.connections.discard(self)
        self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def linger(self) -> None:
        """See _LingeringTransport: answer sent, write side shut, the rest read and dropped."""
        self._refused = True
        self._shut_and_linger()

    def _watch_headers(self) -> None:
        """After each read: while h11 still waits for a request line and headers (IDLE), a
        deadline runs; once they are in, the body deadline (BodyLimitMiddleware) and the
        keep-alive timeout between requests (uvicorn's) take over."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._disarm_header_deadline()
            self.head_bytes = 0  # the next request's head counts afresh
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
        self.guard.header_timeouts += 1
        if self._head is not None:  # waiting over a cap: it hears the cap (a silent one, nothing)
            if self._got_bytes:
                return self._refuse(self._over)
            self.guard.waiting.pop(self, None)
            self._refused = True
            return self._raw.close()
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self.guard.header_timeouts -= 1
            return
        if self._got_bytes:  # a silent connection (a browser's preconnect) is just closed, as nginx does
            self.transport.write(_raw_response(408, "Request Timeout", "the request headers did not arrive within "
                                               f"{self.guard.limits.header_timeout:g} s", code="request_timeout"))
        self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def protocol_class(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """uvicorn instantiates `Config(http=...)` itself, so the guard travels as a class attribute."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
