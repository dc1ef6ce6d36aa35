"""Each turn's profile over HTTP (colibri/serve/profile_api.py) against a real server running a
tiny synthetic MoE whose experts stream from disk: the `colibri` field of non-streamed answers,
the same on the last chunk or event of streamed ones (read through the official `openai` and
`anthropic` clients, whose usual loops must not notice it), and GET /v1/profile."""
from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest

from colibri.engine.turn_profile import PHASE_KEYS, PROFILES_KEPT

EXPERTS = 8  # the tiny preset's experts per layer
LAYERS = 3
HI = [{"role": "user", "content": "Say something about rivers."}]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from tools.synthetic_moe import write_container

    return write_container(tmp_path_factory.mktemp("profile") / "tiny-moe", "tiny", progress=False)


@pytest.fixture(scope="module")
def moe_server(start_server, moe_model):
    from colibri.io.container import Container

    c = Container(moe_model)
    budget = (c.dense_bytes + c.expert_bytes / 3) / 2 ** 30  # a third of the experts fit: most turns read some
    return start_server("--max-tokens", "64", "--no-persist", "--ram-gb", f"{budget:.4f}", model_dir=moe_model)


@pytest.fixture(scope="module")
def model_id(moe_server) -> str:
    return httpx.get(moe_server.url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def openai_client(moe_server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=moe_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_profile(p: dict, completion_tokens: int) -> None:
    """What every turn's profile holds, with sane values."""
    assert p["tokens"]["completion"] == completion_tokens
    assert p["tokens"]["prompt"] > 0 and 0 <= p["tokens"]["reused"] < p["tokens"]["prompt"]
    s = p["seconds"]
    assert s["prefill"] > 0 and s["decode"] > 0 and s["total"] > 0 and s["disk_wait"] >= 0
    # experts stream: the phase clock ran for the whole turn (one generation at a time: no batching)
    assert set(p["phases"]) == set(PHASE_KEYS)
    assert all(v >= 0 for v in p["phases"].values()) and p["phases"]["attention"] > 0
    ram = p["cache"]["ram"]
    assert ram["hits"] + ram["misses"] > 0 and 0.0 <= ram["hit_rate"] <= 1.0
    r = p["routing"]
    assert r["layers"] == list(range(LAYERS)) and r["max_bits"] == pytest.approx(math.log2(EXPERTS))
    assert all(h is not None and 0.0 <= h <= math.log2(EXPERTS) + 1e-9 for h in r["entropy_bits"])


def test_chat_answers_carry_their_turns_profile(openai_client, model_id):
    r = openai_client.chat.completions.create(model=model_id, messages=HI, max_tokens=8, temperature=0)
    profile = r.model_extra["colibri"]
    check_profile(profile, r.usage.completion_tokens)
    assert profile["tokens"]["prompt"] == r.usage.prompt_tokens

    # Streamed, read the usual way: the text is the non-streamed answer's, and the profile rides
    # on the last chunk (the finish chunk: this client did not ask for usage).
    stream = openai_client.chat.completions.create(model=model_id, messages=HI, max_tokens=8, temperature=0,
                                                   stream=True)
    chunks, text = [], ""
    for chunk in stream:
        chunks.append(chunk)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason  # the plain loop's last chunk
    carrying = [c for c in chunks if getattr(c, "colibri", None) is not None]
    assert carrying == [chunks[-1]]
    streamed = chunks[-1].colibri
    check_profile(streamed, r.usage.completion_tokens)
    assert streamed["turn"] == profile["turn"] + 1

    # With usage asked for: on the usage chunk (empty choices), as the last chunk again
    chunks = list(openai_client.chat.completions.create(model=model_id, messages=HI, max_tokens=8, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == r.usage.completion_tokens
    check_profile(last.model_extra["colibri"], last.usage.completion_tokens)
    assert all(getattr(c, "colibri", None) is None for c in chunks[:-1])


def test_completions_and_several_choices(openai_client, model_id):
    r = openai_client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=5, temperature=0)
    check_profile(r.model_extra["colibri"], r.usage.completion_tokens)
    streamed = list(openai_client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=5,
                                                     temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    check_profile(streamed[-1].model_extra["colibri"], r.usage.completion_tokens)
    # n choices: each its own turn
    r = openai_client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=3, n=2,
                                         temperature=0.8, seed=1)
    profiles = r.model_extra["colibri"]["choices"]
    assert [p["turn"] for p in profiles] == [profiles[0]["turn"], profiles[0]["turn"] + 1]
    for p, choice in zip(profiles, r.choices):
        assert p["tokens"]["completion"] == 3 and p["finish_reason"] == choice.finish_reason


def test_anthropic_messages_carry_the_profile(moe_server, model_id):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=moe_server.url, api_key="unused", max_retries=0, timeout=120)
    msg = client.messages.create(model=model_id, messages=HI, max_tokens=6, extra_body={"temperature": 0})
    check_profile(msg.model_extra["colibri"], msg.usage.output_tokens)
    # streamed: on message_delta, which the client's stream helper reads without a complaint
    with client.messages.stream(model=model_id, messages=HI, max_tokens=6, extra_body={"temperature": 0}) as stream:
        deltas = [ev for ev in stream if ev.type == "message_delta"]
        final = stream.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.usage.output_tokens == msg.usage.output_tokens
    assert len(deltas) == 1
    check_profile(deltas[0].model_extra["colibri"], msg.usage.output_tokens)


def test_responses_carry_the_profile(openai_client, model_id):
    r = openai_client.responses.create(model=model_id, input="Name a colour.", max_output_tokens=5, temperature=0)
    check_profile(r.model_extra["colibri"], r.usage.output_tokens)


def test_profile_route_keeps_the_last_turns_in_order(moe_server, model_id):
    url = moe_server.url
    with httpx.Client(base_url=url, timeout=120) as c:
        turns = []
        for i in range(PROFILES_KEPT + 2):  # more than are kept
            r = c.post("/v1/completions", json={"model": model_id, "prompt": [10 + i % 50, 11], "max_tokens": 1})
            r.raise_for_status()
            turns.append(r.json()["colibri"]["turn"])
        body = c.get("/v1/profile").json()
        last_two = c.get("/v1/profile", params={"limit": 2}).json()["data"]
        assert c.get("/v1/profile", params={"limit": -1}).status_code == 400
    assert body["object"] == "list" and len(body["data"]) == PROFILES_KEPT
    kept = [p["turn"] for p in body["data"]]
    assert kept == list(range(turns[-1] - PROFILES_KEPT + 1, turns[-1] + 1))  # oldest first, none missing
    assert body["data"][-1]["tokens"] == {"prompt": 2, "reused": body["data"][-1]["tokens"]["reused"], "completion": 1}
    assert last_two == body["data"][-2:]
