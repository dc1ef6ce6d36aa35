"""Security: the API key (Bearer or x-api-key, both envelopes), /health saying only "ok" to
strangers, the Host allowlist, exact-origin CORS, and the refusal to bind beyond loopback
without a key."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from colibri.errors import ColibriError
from colibri.serve.server import ServeOptions, check

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with
KEY = "s3cret-key"
CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
ORIGIN = "http://app.example:5173"


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--max-tokens", "2", "--cors-origin", ORIGIN, "--allowed-host", "colibri.lan",
                        "--read-timeout", "1", api_key=KEY)


def test_missing_or_wrong_key_is_401_in_the_right_envelope(srv):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"authorization": KEY},
                    {"authorization": "Bearer " + KEY + "x"}):
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["x-request-id"]
        r = httpx.post(srv.url + "/v1/messages", json=CHAT, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for path in ("/v1/models", "/metrics", "/tokenize", "/nope"):
        assert httpx.get(srv.url + path).status_code == 401


def test_official_clients_authenticate(srv):
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    o = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert o.chat.completions.create(**CHAT).choices[0].message.content is not None
    a = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)  # sends x-api-key
    msg = {k: v for k, v in CHAT.items() if k != "temperature"}
    assert a.messages.create(**msg).content[0].type == "text"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0).messages.create(**msg)


def test_health_says_only_ok_to_strangers(srv):
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    full = httpx.get(srv.url + "/health", headers={"x-api-key": KEY}).json()
    assert full["status"] == "ok" and "completed" in full and "kv_slots" in full


def test_host_allowlist(srv):
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.nip.io"):
        r = httpx.get(srv.url + "/health", headers={"host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    r = httpx.post(srv.url + "/v1/messages", json=CHAT, headers={"host": "evil.example", "x-api-key": KEY})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    for host in ("localhost", f"127.0.0.1:{srv.port}", "colibri.lan:1234", "LOCALHOST."):
        assert httpx.get(srv.url + "/health", headers={"host": host}).status_code == 200


def test_cors_allows_exactly_the_given_origin(srv):
    preflight = {"access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    ok = httpx.options(srv.url + "/v1/chat/completions", headers={"origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    for origin in ("http://evil.example", ORIGIN + ".evil.example", "http://app.example:5174", "null"):
        r = httpx.options(srv.url + "/v1/chat/completions", headers={"origin": origin, **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"origin": ORIGIN, "x-api-key": KEY})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-colibri-queue-wait-ms" in r.headers["access-control-expose-headers"]
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers={"origin": "http://evil.example",
                                                                          "x-api-key": KEY})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers


def test_a_keyless_server_runs_no_request_another_web_page_sends(server):
    """A page on any site may POST to a local server without a CORS preflight when the body is
    text/plain, a form or untyped (a "simple request"), so the server itself must refuse it."""
    url = server.url + "/v1/chat/completions"
    body = json.dumps(CHAT).encode()
    for headers in ({"content-type": "text/plain", "origin": "http://evil.example"},
                    {"content-type": "application/json", "origin": "http://evil.example"},
                    {"content-type": "application/json", "origin": "null"}):
        r = httpx.post(url, content=body, headers=headers)
        assert (r.status_code, r.json()["error"]["code"]) == (403, "origin_not_allowed"), headers
    r = httpx.request("DELETE", server.url + "/v1/responses/resp_1", headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    for given in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = httpx.post(url, content=body, headers={"content-type": given} if given else {})
        err = r.json()["error"]
        assert (r.status_code, err["code"], err["param"]) == (415, "unsupported_media_type", "content-type"), given
    r = httpx.post(server.url + "/v1/messages", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    # the server's own page (the dashboard) and clients that send JSON as JSON are served
    own = {"origin": server.url, "content-type": "application/json; charset=utf-8"}
    assert httpx.post(url, content=body, headers=own).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"origin": "http://evil.example"}).status_code == 200


def test_allow_any_content_type_accepts_untyped_bodies(start_server):
    srv = start_server("--max-tokens", "1", "--allow-any-content-type", "--cors-origin", ORIGIN, "--no-persist")
    body = json.dumps(CHAT).encode()
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"content-type": "text/plain"}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"origin": ORIGIN}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers={"origin": "http://evil.example"})
    assert r.status_code == 403  # the flag widens the body types, never the origins


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(server):
    """RFC 9112 6.3: a proxy reading the other framing would see the pipelined request below as
    part of this one's body (request smuggling)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
                  b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                  b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower(), reply
    assert json.loads(body)["error"]["code"] == "ambiguous_framing"
    assert reply.count(b"HTTP/1.1") == 1  # the pipelined request was not answered


def test_oversize_body_is_refused_before_auth_reads_it(srv):
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"x" * (4 * 1024 * 1024 + 1),
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 413


def test_a_slow_body_gets_408(srv):
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nx-api-key: " + KEY.encode() +
                     b"\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 10
    assert httpx.get(srv.url + "/health").status_code == 200


def _serve(model_dir, *args, env=None):
    """`colibri serve` on a model directory that exists but cannot load: an error about the
    options shows they were checked before the model was touched."""
    (model_dir / "config.json").write_text("{}")
    return subprocess.run([sys.executable, "-m", "colibri.cli", "serve", "--model", str(model_dir), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def test_refuses_a_non_loopback_bind_without_a_key(tmp_path):
    r = _serve(tmp_path, "--host", "0.0.0.0", "--kv-slots", "17")  # the bind is checked first
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "refusing to listen" in " ".join(r.stderr.split())
    r = _serve(tmp_path, env={**os.environ, "COLI_HOST": "::", "COLI_KV_SLOTS": "17"})
    assert r.returncode == 1 and "refusing to listen" in " ".join(r.stderr.split())
    for host in ("192.168.1.10", "example.com", "::"):
        with pytest.raises(ColibriError, match="refusing to listen"):
            check(ServeOptions(host=host))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        check(ServeOptions(host=host))
    check(ServeOptions(host="0.0.0.0", api_key="k"))
    check(ServeOptions(host="0.0.0.0", allow_insecure_bind=True))


def test_bad_options_are_one_line_errors(tmp_path):
    r = _serve(tmp_path, "--kv-slots", "17")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "kv-slots" in r.stderr
    r = _serve(tmp_path, env={**os.environ, "COLI_MAX_CONNECTIONS_PER_IP": "0"})
    assert r.returncode == 1 and "--max-connections-per-ip must be >= 1" in r.stderr
    r = _serve(tmp_path, "--header-timeout", "0")
    assert r.returncode == 1 and "--header-timeout" in r.stderr
    for kw in ({"max_tokens": 0}, {"max_queue": -1}, {"port": 70000}, {"queue_timeout": 0}, {"max_connections": 0},
               {"log_level": "loud"}, {"max_connections_per_ip": 0}, {"header_timeout": -1}):
        with pytest.raises(ColibriError):
            check(ServeOptions(**kw))
