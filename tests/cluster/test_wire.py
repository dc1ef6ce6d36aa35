"""colibri/cluster/wire.py: the head <-> worker data path over real TCP sockets on loopback.
Arrays arrive bit for bit, a wrong secret or a damaged frame is refused without taking the
server down, a worker's error and a silent worker reach the head as WireError."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from colibri.cluster.wire import REQUEST, WireError, WireLink, WireServer

SECRET = bytes(range(32))


def _echo(prefix, x, weights, ids, experts, one_token_rows, mode):
    """Rows that show every field arrived: x scaled by the first weight, plus the expert ids."""
    if prefix == "boom":
        raise RuntimeError("shard not loaded")
    if prefix == "slow":
        time.sleep(1.0)
    out = x * weights[:, :1] + np.float32(sum(experts)) + np.float32(ids.sum())
    return out, 0.25 if one_token_rows and mode == "int8" else 0.5


@pytest.fixture
def server():
    s = WireServer("127.0.0.1", SECRET, _echo)
    yield s
    s.close()


def test_a_layer_goes_and_comes_back_bit_for_bit(server):
    link = WireLink("127.0.0.1", server.port, SECRET)
    rng = np.random.default_rng(0)
    for rows in (1, 3, 700):  # a decode row, batched rows, a prefill chunk past one write
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        weights = rng.random((rows, 4), dtype=np.float32)
        ids = rng.integers(0, 64, (rows, 4))
        link.send("model.layers.3.mlp", x, weights, ids, [5, 9], rows == 1, "int8")
        out, seconds, handled = link.receive(5.0)
        expected, want_s = _echo("x", x, weights, ids, [5, 9], rows == 1, "int8")
        assert out.dtype == np.float32 and np.array_equal(out, expected)
        assert seconds == want_s and 0 < handled < link.round_trip_s
    assert server.connected == 1
    link.close()


def test_a_wrong_secret_is_refused_and_the_server_keeps_serving(server):
    with pytest.raises((WireError, OSError)):
        WireLink("127.0.0.1", server.port, bytes(32))
    # Garbage after a valid hello: that connection is dropped, others are unaffected.
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.sendall(b"CXH1" + SECRET)
    assert raw.recv(4) == b"CXOK"
    raw.sendall(b"\0" * REQUEST.size)
    raw.settimeout(5)
    assert raw.recv(1) == b""  # closed by the server
    link = WireLink("127.0.0.1", server.port, SECRET)
    x = np.ones((1, 8), np.float32)
    link.send("p", x, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int64), [0], True, "f32")
    assert np.array_equal(link.receive(5.0)[0], x)


def test_a_worker_error_and_a_silent_worker_reach_the_head(server):
    link = WireLink("127.0.0.1", server.port, SECRET)
    x = np.ones((1, 8), np.float32)
    args = (x, np.ones((1, 1), np.float32), np.zeros((1, 1), np.int64), [0], True, "f32")
    link.send("boom", *args)
    with pytest.raises(WireError, match="shard not loaded"):
        link.receive(5.0)
    link = WireLink("127.0.0.1", server.port, SECRET)
    link.send("slow", *args)
    t0 = time.monotonic()
    with pytest.raises(WireError, match="no answer within 0.2 s"):
        link.receive(0.2)
    assert time.monotonic() - t0 < 0.9


def test_the_server_listens_on_its_address_only(server):
    """Bound to the address given (the node's own), not to every interface."""
    assert server.sock.getsockname()[0] == "127.0.0.1"
    seen = threading.Event()
    s = WireServer("127.0.0.1", SECRET, lambda *a: (seen.set(), (a[1], 0.0))[1])
    try:
        link = WireLink("127.0.0.1", s.port, SECRET)
        link.send("p", np.zeros((1, 4), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int64),
                  [1], False, "f32")
        link.receive(5.0)
        assert seen.is_set()
    finally:
        s.close()


def test_a_port_range_for_firewalls(monkeypatch):
    """COLIBRI_WIRE_PORTS: the first free port of the range; a full range is an error."""
    first = WireServer("127.0.0.1", SECRET, _echo, ports="0")  # any free port, to build a range from
    base = first.port
    first.close()
    a = WireServer("127.0.0.1", SECRET, _echo, ports=f"{base}-{base + 1}")
    monkeypatch.setenv("COLIBRI_WIRE_PORTS", f"{base}-{base + 1}")
    b = WireServer("127.0.0.1", SECRET, _echo)
    try:
        assert (a.port, b.port) == (base, base + 1)
        with pytest.raises(OSError, match="no free port"):
            WireServer("127.0.0.1", SECRET, _echo)
        with pytest.raises(ValueError, match="COLIBRI_WIRE_PORTS"):
            WireServer("127.0.0.1", SECRET, _echo, ports="10-x")
    finally:
        a.close()
        b.close()
