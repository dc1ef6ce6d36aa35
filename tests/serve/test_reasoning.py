"""The thinking switch: splitting `<think>` reasoning from the answer (unit), and end to end on a
copy of SmolLM2 whose chat template is given a Qwen3-style switch."""
from __future__ import annotations

import json

import httpx
import pytest

from colibri.serve.reasoning import ReasoningSplitter, has_thinking_switch, split_reasoning
from colibri.serve.schemas import field_path

MODEL_ID = "smollm2"  # the --model-id tests/serve/conftest.py starts servers with
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.mark.parametrize("pieces", [["<think>plan</think>\n\nanswer"],
                                    ["<th", "ink>pl", "an</th", "ink>", "\n", "ans", "wer"],
                                    list("<think>plan</think>\n\nanswer"), ["  <think>", "plan</think>answer"]])
def test_splitter_never_leaks_a_tag_across_pieces(pieces):
    s = ReasoningSplitter()
    out = [s.feed(p) for p in pieces] + [s.flush()]
    assert "".join(r for r, _ in out) == "plan"
    assert "".join(c for _, c in out) == "answer"


def test_splitter_cases():
    assert split_reasoning("no thinking here") == ("", "no thinking here")
    assert split_reasoning("<thinker") == ("", "<thinker")
    assert split_reasoning("<thi") == ("", "<thi")  # ended before it could be a tag
    assert split_reasoning("still thinking", in_reasoning=True) == ("still thinking", "")
    assert split_reasoning("a</think>b", in_reasoning=True) == ("a", "b")
    assert split_reasoning("<think>unfinished</th") == ("unfinished</th", "")
    assert has_thinking_switch(THINKING_TEMPLATE) and not has_thinking_switch("{{ messages }}")


def test_field_path_drops_union_tags():
    obj = {"messages": [{"role": "user", "content": 5}]}
    assert field_path(obj, ("messages", 0, "content", "str")) == "messages[0].content"
    assert field_path(obj, ("messages", 0, "content", "list[ContentBlock]")) == "messages[0].content"
    assert field_path({}, ()) == "body"


@pytest.fixture(scope="module")
def thinking_srv(start_server, smollm2_container, tmp_path_factory):
    """SmolLM2 with a template that has a thinking switch (the files linked, the template added)."""
    d = tmp_path_factory.mktemp("thinking") / "model"
    d.mkdir()
    for f in smollm2_container.iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return start_server("--max-tokens", "4", model_dir=d)


def test_thinking_on_and_off_end_to_end(thinking_srv):
    ask = {"model": MODEL_ID, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 4,
           "temperature": 0}
    with thinking_srv.client() as c:
        on = c.post("/v1/chat/completions", json={**ask, "enable_thinking": True}).json()["choices"][0]["message"]
        assert on["reasoning_content"] and on["content"] == ""  # the answer never left the think block
        effort = c.post("/v1/chat/completions", json={**ask, "reasoning_effort": "low"}).json()
        assert effort["choices"][0]["message"]["reasoning_content"] == on["reasoning_content"]
        off = c.post("/v1/chat/completions", json={**ask, "enable_thinking": False}).json()["choices"][0]["message"]
        assert off["content"] and not off.get("reasoning_content")
        with c.stream("POST", "/v1/chat/completions", json={**ask, "enable_thinking": True, "stream": True}) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == on["reasoning_content"]
        assert not "".join(d.get("content") or "" for d in deltas)
        n_on = c.post("/tokenize", json={"messages": ask["messages"], "enable_thinking": True}).json()["count"]
        n_off = c.post("/tokenize", json={"messages": ask["messages"], "enable_thinking": False}).json()["count"]
        assert n_off > n_on
        m = c.post("/v1/messages", json={**ask, "thinking": {"type": "enabled", "budget_tokens": 1024}}).json()
        assert m["content"][0] == {"type": "thinking", "thinking": on["reasoning_content"], "signature": ""}
        with c.stream("POST", "/v1/messages", json={**ask, "stream": True,
                                                    "thinking": {"type": "enabled", "budget_tokens": 1024}}) as r:
            starts = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        blocks = [e["content_block"]["type"] for e in starts if e["type"] == "content_block_start"]
        assert blocks[0] == "thinking"
    anthropic = pytest.importorskip("anthropic")
    a = anthropic.Anthropic(base_url=thinking_srv.url, api_key="x", max_retries=0)
    msg = a.messages.create(model=MODEL_ID, max_tokens=4, messages=ask["messages"],
                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert msg.content[0].type == "thinking"
    assert httpx.get(thinking_srv.url + "/health").status_code == 200
