"""KV slots persist at every turn end, crash-safely: a server killed with SIGKILL during a turn
leaves the previous complete slot file (or the new one, never a torn one), and after a restart
the conversation continues without re-prefilling, with the tokens a cold run gives."""
from __future__ import annotations

import hashlib
import threading

import httpx
import numpy as np
import pytest

from colibri.engine import common_prefix as _common_prefix  # the engine's own rule for how much of a slot is reused

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with


def _chat(url, messages, max_tokens, slot=0):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "cache_slot": slot})
    assert r.status_code == 200, r.text
    return r.json()


def _ids(path) -> list[int]:
    with np.load(path) as z:  # a torn file fails here
        assert {"ids", "version", "model_id", "k0", "v0"} <= set(z.files)
        assert z["k0"].shape[1] == len(z["ids"])
        return z["ids"].tolist()


def test_sigkill_mid_turn_then_restart_continues_without_prefill(start_server, tmp_path, tokenizer,
                                                                  smollm2_container):
    from colibri.engine import Engine

    state = tmp_path / "state"
    srv = start_server("--kv-slots", "2", state_dir=state)
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    answer = _chat(srv.url, turn1, 6)["choices"][0]["message"]["content"]
    slot_file = state / "slot-0.npz"
    held1 = _ids(slot_file)  # saved at the turn's end, before the response
    assert len(held1) == srv.health()["kv_slots"][0] > 0
    digest1 = hashlib.sha256(slot_file.read_bytes()).hexdigest()

    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "Now count from one to fifty in words."}]
    got_tokens = threading.Event()

    def stream_turn2():
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={
                    "model": MODEL_ID, "messages": turn2, "max_tokens": 200, "temperature": 0, "cache_slot": 0,
                    "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 6:
                        got_tokens.set()
        except httpx.HTTPError:
            pass  # the server died under it

    t = threading.Thread(target=stream_turn2, daemon=True)
    t.start()
    assert got_tokens.wait(60)
    srv.kill()  # SIGKILL, mid-turn
    t.join(30)

    held = _ids(slot_file)
    ids2 = tokenizer.encode_chat(turn2)
    if hashlib.sha256(slot_file.read_bytes()).hexdigest() != digest1:
        assert held[:len(ids2)] == ids2  # the new complete state, never a mix
    else:
        assert held == held1

    srv2 = start_server("--kv-slots", "2", state_dir=state)
    assert srv2.health()["kv_slots"] == [len(held), 0]  # restored at start
    r = _chat(srv2.url, turn2, 6)
    expected = min(_common_prefix(held, ids2), len(ids2) - 1)
    assert r["usage"]["prompt_tokens"] == len(ids2)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == expected >= len(tokenizer.encode_chat(turn1))
    cold = Engine.load(smollm2_container).generate(ids2, max_tokens=6)
    assert r["choices"][0]["message"]["content"] == cold.text


def test_a_damaged_slot_file_starts_that_slot_empty(start_server, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "slot-1.npz").write_bytes(b"PK\x03\x04 torn")
    srv = start_server("--kv-slots", "2", state_dir=state)
    assert srv.health()["kv_slots"] == [0, 0]
    assert _chat(srv.url, [{"role": "user", "content": "Hi"}], 2, slot=1)["choices"][0]["message"]["content"]
    assert len(_ids(state / "slot-1.npz")) > 0  # rewritten whole at the turn's end
    assert "slot 1 starts empty" in srv.log()


@pytest.mark.parametrize("preset,layers", [("qwen3.6-35b-a3b", 4), ("glm-5.3-flash", 5)])
def test_a_hybrid_models_recurrent_state_survives_sigkill(start_server, tmp_path, tokenizer, tmp_path_factory,
                                                          preset, layers):
    """Qwen3.6-35B-A3B's layer structure (Gated DeltaNet layers with a recurrent state, then
    full attention) and GLM-5.3-Flash's (KDA layers, then sparse MLA whose latent and indexer
    rows are its K and V) at 1/16 width: the slot file holds the state beside the attention
    layers' K and V, and after a SIGKILL mid-turn the restarted server continues from it with
    the tokens a cold run gives."""
    from tools import synthetic_moe

    from colibri.engine import Engine

    model = synthetic_moe.write_container(tmp_path_factory.mktemp("hybrid") / "m", preset, layers=layers,
                                          width_divisor=16, vocab=49152, progress=False)
    state = tmp_path / "state"
    srv = start_server("--kv-slots", "1", model_dir=model, state_dir=state)
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    answer = _chat(srv.url, turn1, 6)["choices"][0]["message"]["content"]
    with np.load(state / "slot-0.npz") as z:
        assert {"state_conv0", "state_state0", "state_state2", "k0"} <= set(z.files)
        assert "k1" not in z.files and np.abs(z["state_state0"]).sum() > 0  # one full-attention layer
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a colour?"}]
    got_tokens = threading.Event()

    def stream_turn2():
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120, json={
                    "model": MODEL_ID, "messages": turn2, "max_tokens": 400, "temperature": 0, "cache_slot": 0,
                    "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 6:
                        got_tokens.set()
        except httpx.HTTPError:
            pass

    t = threading.Thread(target=stream_turn2, daemon=True)
    t.start()
    assert got_tokens.wait(60)
    srv.kill()
    t.join(30)
    held = _ids(state / "slot-0.npz")
    srv2 = start_server("--kv-slots", "1", model_dir=model, state_dir=state)
    assert srv2.health()["kv_slots"] == [len(held)]
    ids2 = tokenizer.encode_chat(turn2)
    # A state cannot be cut back: the reuse ends at the live state or a snapshot kept with it (the
    # end of turn 1's prompt at least; the re-rendered answer differs from what was generated).
    shared = min(_common_prefix(held, ids2), len(ids2) - 1)
    with np.load(state / "slot-0.npz") as z:
        snapshots = z["state_snapshots"].tolist()
    kept = [p for p in snapshots + [len(held)] if p <= shared]
    assert len(tokenizer.encode_chat(turn1, add_generation_prompt=True)) in kept
    slot = httpx.get(srv2.url + "/v1/telemetry", timeout=30).json()["scheduler"]["slots"][0]  # the dashboard's view
    assert slot["tokens"] == len(held) and slot["resumable_at"] == snapshots and slot["state_bytes"] > 0
    r = _chat(srv2.url, turn2, 6)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == max(kept)
    assert r["choices"][0]["message"]["content"] == Engine.load(model).generate(ids2, max_tokens=6).text
