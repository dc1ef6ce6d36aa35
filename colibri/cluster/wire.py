"""The head <-> expert-worker data path: one TCP connection per worker, fixed binary frames.

Why not Ray's actor calls: a Ray call with one decode row measured 1.5-2.1 ms round trip on the
2-core Xeon VM (2.9 ms to two workers at once), this connection 0.07 ms to the same actor
(bench/scale/cluster.py prints both). At one call per worker per MoE layer that difference is
the whole cost of the hop. Ray still places, starts, restarts and finds the workers; the
arrays go over this link.

The frames carry numpy arrays and short strings only: nothing is unpickled, so a peer can at
worst send wrong numbers. A worker listens on its node's own address only (the one Ray runs
on), and a connection must first present the head's secret (random per cluster start, handed
to the worker through Ray, whose own channel is authenticated), compared in constant time.

    hello     head -> worker   b"CXH1" + 32-byte secret         worker -> head  b"CXOK"
    request   head -> worker   REQUEST header, prefix, mode, x [L, D] f32, weights [L, K] f32,
                               ids [L, K] i64, experts [n] i64
    response  worker -> head   RESPONSE header, then rows [N, D] f32 (status 0) or an error
                               message of N bytes (status 1)
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("colibri.cluster")

HELLO = b"CXH1"
WELCOME = b"CXOK"
SECRET_BYTES = 32
# magic, sequence, flags (bit 0: one_token_rows), prefix length, mode length, L, D, K, experts
REQUEST = struct.Struct("<4sIBHBIIII")
REQUEST_MAGIC = b"CXQ1"
# magic, sequence, status, N, D, the worker's compute seconds, and its seconds from having the
# request's header to sending this answer (compute plus reading, parsing and writing)
RESPONSE = struct.Struct("<4sIBIIdd")
RESPONSE_MAGIC = b"CXR1"
MAX_ROWS = 1 << 20    # a frame asking for more is damaged, not a prefill chunk
MAX_WIDTH = 1 << 17
HELLO_TIMEOUT_S = 10.0
# A head that vanished without closing (a cut link, a frozen machine) is noticed by TCP
# keepalive: first probe after 20 s idle, then every 5 s, dropped after 4 unanswered.
KEEPALIVE = (20, 5, 4)


# Python hands the GIL to a waiting thread only every switch interval (5 ms by default). A thread
# woken by its socket (the worker's on a request, the head's on an answer) waits that long when
# another thread of the process holds the GIL (Ray's own threads; a numba kernel holds it while it
# runs): measured with the head and one worker on a core each, 2.6-2.9 ms of each layer's round
# trip went to that, 0.28 ms was left at 0.1 ms. Both ends set it on their process.
SWITCH_INTERVAL_S = 1e-4


def quick_handoff() -> None:
    """Set this process's GIL switch interval to SWITCH_INTERVAL_S (never raise it)."""
    if sys.getswitchinterval() > SWITCH_INTERVAL_S:
        sys.setswitchinterval(SWITCH_INTERVAL_S)


class WireError(ConnectionError):
    """The peer closed, timed out, or sent a frame that is not ours."""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a frame is one write: send it now
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise WireError("the peer closed the connection")
        got += k
    return buf


def _recv_array(sock: socket.socket, shape: tuple, dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    if out.nbytes:
        _recv_exact(sock, out.nbytes, memoryview(out).cast("B"))
    return out


def _send(sock: socket.socket, parts: list) -> None:
    """One write for a small frame (a decode row: header and arrays in one segment), part by
    part for a large one (no copy of a prefill chunk)."""
    views = [memoryview(p).cast("B") if isinstance(p, np.ndarray) else memoryview(p) for p in parts]
    if sum(v.nbytes for v in views) <= 1 << 16:
        sock.sendall(b"".join(views))
    else:
        for v in views:
            sock.sendall(v)


# ---------------------------------------------------------------------------------- worker side
PORTS_ENV = "COLIBRI_WIRE_PORTS"


def _listen(host: str, ports: str | None) -> socket.socket:
    """A listening socket on `host`: the first free port of `ports` ("LO-HI", for a firewall
    rule; default: COLIBRI_WIRE_PORTS in the environment of the node's `ray start`), else any."""
    ports = ports if ports is not None else os.environ.get(PORTS_ENV, "")
    if not ports:
        return socket.create_server((host, 0), backlog=8)
    try:
        lo, hi = (int(p) for p in ports.split("-")) if "-" in ports else (int(ports), int(ports))
    except ValueError:
        raise ValueError(f"{PORTS_ENV} must be a port or a range LO-HI, not {ports!r}") from None
    for port in range(lo, hi + 1):
        try:
            return socket.create_server((host, port), backlog=8)
        except OSError:
            continue
    raise OSError(f"no free port in {PORTS_ENV}={ports} on {host}")


class WireServer:
    """Serves one ExpertWorker's `compute(prefix, x, weights, ids, experts, one_token_rows, mode)
    -> (rows, seconds)` to heads that present `secret`, on `host` (the node's own address).
    One thread per connection; computing is serialized by the caller's lock.

    `last_seen` (time.monotonic) moves while a head is connected or sends anything: the worker's
    orphan watchdog reads it."""

    def __init__(self, host: str, secret: bytes, compute, ports: str | None = None):
        self.secret, self.compute = secret, compute
        self.sock = _listen(host, ports)
        quick_handoff()
        self.host, self.port = host, self.sock.getsockname()[1]
        self.connected = 0
        self.last_seen = time.monotonic()
        self._closed = False
        threading.Thread(target=self._accept, name="colibri-wire-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, peer), name="colibri-wire", daemon=True).start()

    def _serve(self, conn: socket.socket, peer) -> None:
        with conn:
            try:
                conn.settimeout(HELLO_TIMEOUT_S)
                hello = bytes(_recv_exact(conn, len(HELLO) + SECRET_BYTES))
                if hello[:4] != HELLO or not hmac.compare_digest(hello[4:], self.secret):
                    log.warning("expert wire: refused a connection from %s:%s (no valid secret)", *peer[:2])
                    return
                conn.settimeout(None)
                _tune(conn)
                conn.sendall(WELCOME)
            except (OSError, WireError):
                return
            self.connected += 1
            try:
                while True:
                    self.last_seen = time.monotonic()
                    self._answer(conn)
            except (OSError, WireError):
                pass
            finally:
                self.connected -= 1
                self.last_seen = time.monotonic()

    def _answer(self, conn: socket.socket) -> None:
        magic, seq, flags, plen, mlen, L, D, K, n = REQUEST.unpack(_recv_exact(conn, REQUEST.size))
        t0 = time.perf_counter()
        if magic != REQUEST_MAGIC or L > MAX_ROWS or D > MAX_WIDTH or K > 4096 or n > 1 << 16:
            raise WireError("not a request frame")
        names = bytes(_recv_exact(conn, plen + mlen)).decode()
        prefix, mode = names[:plen], names[plen:]
        x = _recv_array(conn, (L, D), np.float32)
        weights = _recv_array(conn, (L, K), np.float32)
        ids = _recv_array(conn, (L, K), np.int64)
        experts = _recv_array(conn, (n,), np.int64).tolist()
        try:
            rows, seconds = self.compute(prefix, x, weights, ids, experts, bool(flags & 1), mode)
        except Exception as e:  # the head logs it and computes these experts itself
            message = f"{type(e).__name__}: {e}".encode()[:4096]
            _send(conn, [RESPONSE.pack(RESPONSE_MAGIC, seq, 1, len(message), 0, 0.0, 0.0), message])
            return
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        header = RESPONSE.pack(RESPONSE_MAGIC, seq, 0, rows.shape[0], rows.shape[1], seconds,
                               time.perf_counter() - t0)
        _send(conn, [header, rows])

    def close(self) -> None:
        self._closed = True
        try:  # shutdown first: close() alone leaves the port listening while accept() blocks on it
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# ------------------------------------------------------------------------------------ head side
@dataclass
class Pending:
    seq: int
    sent_at: float


class WireLink:
    """The head's connection to one worker's WireServer. `send` a layer's work, later `receive`
    its answer by a deadline; any error or timeout raises WireError and leaves the link closed
    (the head then treats the worker as failed)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float = HELLO_TIMEOUT_S):
        self.address = (host, port)
        self.sock = socket.create_connection(self.address, timeout=timeout_s)
        try:
            _tune(self.sock)
            self.sock.sendall(HELLO + secret)
            if bytes(_recv_exact(self.sock, len(WELCOME))) != WELCOME:
                raise WireError(f"{host}:{port} did not accept the secret")
        except (OSError, WireError):
            self.sock.close()
            raise
        self.sock.settimeout(None)
        self._seq = 0
        self.pending: Pending | None = None
        self.round_trip_s = self.answered_at = 0.0

    def send(self, prefix: str, x: np.ndarray, weights: np.ndarray, ids: np.ndarray, experts: list[int],
             one_token_rows: bool, mode: str) -> None:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        x = np.ascontiguousarray(x, dtype=np.float32)
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        names = prefix.encode() + mode.encode()
        header = REQUEST.pack(REQUEST_MAGIC, self._seq, int(one_token_rows), len(prefix.encode()), len(mode.encode()),
                              x.shape[0], x.shape[1], ids.shape[1], len(experts))
        sent_at = time.perf_counter()
        try:
            self.sock.settimeout(HELLO_TIMEOUT_S)  # a worker that stopped reading must not hang the head
            _send(self.sock, [header, names, x, weights, ids, np.asarray(experts, np.int64)])
        except OSError as e:
            self.close()
            raise WireError(f"sending to {self.address[0]}:{self.address[1]}: {e}") from None
        self.pending = Pending(self._seq, sent_at)

    def receive(self, timeout_s: float) -> tuple[np.ndarray, float, float]:
        """(rows [N, D], the worker's compute seconds, its seconds handling the request) of the
        request in flight; `round_trip_s` then holds the time from sending it to having the answer."""
        try:
            self.sock.settimeout(max(1e-3, timeout_s))
            magic, seq, status, N, D, seconds, handled = RESPONSE.unpack(_recv_exact(self.sock, RESPONSE.size))
            if magic != RESPONSE_MAGIC or self.pending is None or seq != self.pending.seq or N > MAX_ROWS * 4096:
                raise WireError("not the answer to the request in flight")
            if status:
                raise WireError(f"the worker failed: {bytes(_recv_exact(self.sock, N)).decode(errors='replace')}")
            rows = _recv_array(self.sock, (N, D), np.float32)
        except socket.timeout:
            self.close()
            raise WireError(f"no answer within {timeout_s:g} s") from None
        except (OSError, WireError) as e:
            self.close()
            raise WireError(str(e)) from None
        self.answered_at = time.perf_counter()
        self.round_trip_s = self.answered_at - self.pending.sent_at
        self.pending = None
        return rows, seconds, handled

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
