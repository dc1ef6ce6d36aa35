"""Load: 64 concurrent streaming clients against a queue of 8. Each request either completes in
full or gets a 429 with Retry-After; none hangs, none is lost; /health and /metrics agree with
what the clients saw."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with
CLIENTS = 64


@pytest.fixture(scope="module")
def server(start_server):
    """The shared server's settings, but with room for all 64 clients on one address: here they
    stand for 64 different clients, and this test is about admission (the queue), not about the
    per-address connection cap (8 by default; tests/serve/test_hardening.py covers it)."""
    return start_server("--kv-slots", "3", "--max-tokens", "64", "--max-connections", str(CLIENTS + 8),
                        "--max-connections-per-ip", str(CLIENTS + 8))


async def _one(client: httpx.AsyncClient, i: int) -> str:
    body = {"model": MODEL_ID, "stream": True, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            await r.aread()
            return "rejected"
        assert r.status_code == 200, r.status_code
        finish, done = None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
        assert done and finish in ("stop", "length")
        return "completed"


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_64_streaming_clients_against_a_queue_of_8(server):
    before = server.health()
    metrics_before = httpx.get(server.url + "/metrics").text

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=300) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, i) for i in range(CLIENTS))), 600)

    outcomes = asyncio.run(main())
    completed, rejected = outcomes.count("completed"), outcomes.count("rejected")
    assert completed + rejected == CLIENTS
    assert completed >= 9 and rejected >= 1  # 1 running + 8 queued at least; the rest could not all fit
    after = server.health()
    assert after["active"] == 0 and after["queued"] == 0
    assert after["completed"] - before["completed"] == completed
    assert after["rejected"] - before["rejected"] == rejected
    assert after["admitted"] - before["admitted"] == completed
    text = httpx.get(server.url + "/metrics").text
    assert _metric(text, "colibri_generations_total", '{outcome="completed"}') == after["completed"]
    rej = sum(_metric(text, "colibri_rejected_requests_total", f'{{reason="{r}"}}')
              for r in ("queue_full", "queue_timeout", "draining"))
    assert rej == after["rejected"]
    label = '{route="/v1/chat/completions",status="429"}'
    name = "colibri_http_responses_total"
    assert _metric(text, name, label) - _metric(metrics_before, name, label) == rejected
