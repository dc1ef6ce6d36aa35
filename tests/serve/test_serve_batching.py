"""`colibri serve --max-batch N`: concurrent streaming clients share forward passes, each gets
exactly the tokens it gets alone, a client that leaves mid-batch does not disturb the others,
and bad settings are refused before the model loads."""
from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest

MODEL_ID = "smollm2"
PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "def fibonacci(n):", "Roses are red,"]


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--max-batch", "4", "--max-tokens", "64")


def complete(url: str, prompt: str, n: int, leave_after: int | None = None) -> tuple[str, int]:
    """Stream a completion; with leave_after, drop the connection after that many frames.
    Returns (text, frames)."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    text, frames = [], 0
    import json

    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                f = json.loads(line[6:])
                if f.get("choices"):
                    text.append(f["choices"][0]["text"])
                    frames += 1
                    if leave_after is not None and frames >= leave_after:
                        break
    return "".join(text), frames


def together(url: str, jobs: list[tuple]) -> list:
    out = [None] * len(jobs)
    go = threading.Barrier(len(jobs))

    def work(i, args):
        go.wait()
        out[i] = complete(url, *args)

    threads = [threading.Thread(target=work, args=(i, a)) for i, a in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_concurrent_clients_get_their_solo_tokens(srv):
    alone = [complete(srv.url, p, 24)[0] for p in PROMPTS]
    got = together(srv.url, [(p, 24) for p in PROMPTS])
    assert [t for t, _ in got] == alone
    metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert "colibri_batch_rows_total" in metrics


def test_a_client_leaving_mid_batch_leaves_the_others_alone(srv):
    alone = [complete(srv.url, p, 40)[0] for p in PROMPTS[:3]]
    got = together(srv.url, [(PROMPTS[0], 40), (PROMPTS[1], 40, 3), (PROMPTS[2], 40)])
    assert got[1][1] == 3
    assert got[0][0] == alone[0] and got[2][0] == alone[2]
    assert srv.health()["status"] == "ok"


def test_a_float16_cache_server_batches_to_its_solo_tokens(start_server):
    """--kv-cache f16 reaches the engine through serve (COLI_KV_CACHE alike): the telemetry
    says so, and concurrent clients still get the tokens each gets alone on that server."""
    s = start_server("--max-batch", "4", "--max-tokens", "32", "--kv-cache", "f16")
    assert httpx.get(s.url + "/v1/telemetry", timeout=30).json()["model"]["kv_cache"] == "f16"
    alone = [complete(s.url, p, 16)[0] for p in PROMPTS[:3]]
    got = together(s.url, [(p, 16) for p in PROMPTS[:3]])
    assert [t for t, _ in got] == alone
    s.stop()


@pytest.mark.parametrize("value", ["0", "17"])
def test_bad_max_batch_is_refused_before_loading(value, smollm2_container):
    p = subprocess.run([sys.executable, "-m", "colibri.cli", "serve", "--model", str(smollm2_container),
                        "--max-batch", value, "--port", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "--max-batch must be between 1 and 16" in p.stderr


def test_default_batch_is_one_kernel_tile_fewer_when_kv_memory_is_short():
    from colibri.batching import KV_MEMORY_SHARE, default_max_batch
    from colibri.kernels.cpu import TILE_A

    slot = 100 << 20  # one full-context KV cache: 100 MiB
    assert default_max_batch(slot, 64 << 30) == TILE_A
    assert default_max_batch(slot, int(3 * slot / KV_MEMORY_SHARE)) == min(3, TILE_A)
    assert default_max_batch(slot, slot) == 1  # not even one fits in the share: still serve one


def test_serve_sizes_its_batch_when_not_told(start_server):
    import re

    from colibri.io.experts import available_memory
    from colibri.kernels.cpu import TILE_A

    s = start_server("--max-tokens", "16", max_batch=None)
    n = int(re.search(r"up to (\d+) generation\(s\) at once \(--max-batch sized to this machine\)", s.log()).group(1))
    assert 1 <= n <= TILE_A
    if available_memory() > 8 << 30:  # SmolLM2's 4 full-context caches take ~1.5 GB
        assert n == TILE_A
    got = together(s.url, [(p, 12) for p in PROMPTS])
    assert [t for t, _ in got] == [complete(s.url, p, 12)[0] for p in PROMPTS]
    assert "colibri_batch_rows_total" in httpx.get(s.url + "/metrics", timeout=30).text
