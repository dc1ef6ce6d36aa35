"""A long prompt on a real server: a client that leaves during its prefill frees the scheduler
within about one prefill chunk (the engine polls the cancel flag between chunks), and the chunks
already prefilled stay in the slot, so a prompt that starts with them reuses them."""
from __future__ import annotations

import time

import httpx
import pytest

MODEL_ID = "smollm2"
CHUNK = 64


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--prefill-chunk", str(CHUNK), "--max-context", "8192", "--max-tokens", "16")


def _long_prompt(url: str, tokens: int) -> list[int]:
    text = "The quick brown fox jumps over the lazy dog near the river bank. " * (tokens // 13)
    return httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_client_leaving_during_prefill_frees_the_server_within_a_chunk(srv):
    prompt = _long_prompt(srv.url, 6000)  # far more than 3 s of prefill
    n_prompt = len(prompt)
    before = srv.health()
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up 3 s into the prefill and hangs up
        httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=3.0))
    left = time.monotonic()
    while time.monotonic() - left < 30:
        h = srv.health()
        if h["active"] == 0 and h["cancelled"] == before["cancelled"] + 1:
            break
        time.sleep(0.02)
    freed_s = time.monotonic() - left
    h = srv.health()
    assert h["active"] == 0 and h["cancelled"] == before["cancelled"] + 1, h
    held = max(h["kv_slots"])
    # It stopped inside the prefill, on a chunk boundary, with the prefilled chunks kept.
    assert 0 < held < n_prompt - 1 and held % CHUNK == 0, (held, n_prompt)
    per_chunk_s = (left - t0) / max(held / CHUNK, 1)
    print(f"\nprompt {n_prompt} tokens; left after {left - t0:.1f} s with {held} prefilled; "
          f"server free {freed_s:.2f} s later (one chunk takes ~{per_chunk_s:.2f} s)")
    assert freed_s < 3 * per_chunk_s + 1.0
    # A prompt that starts with them (the same one, cut a few tokens past the prefilled chunks so
    # the test does not wait for the whole prefill) starts from them, and completes.
    r = httpx.post(srv.url + "/v1/completions", json={**body, "prompt": prompt[:held + 5], "max_tokens": 1},
                   timeout=300)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == held
