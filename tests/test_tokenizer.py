"""Tokenizer and chat templates vs transformers: the tokenizer built from the SmolLM2 GGUF must
give transformers' GGUF tokenizer's ids, and templates must render to the same text."""
import json
import random
from datetime import datetime

import pytest

from colibri.errors import ColibriError
from colibri.io.gguf_import import read_gguf
from colibri.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(smollm2_gguf):
    return read_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2")
    (d / "tokenizer.json").write_text(checkpoint.tokenizer_json, encoding="utf-8")
    for name, data in (("tokenizer_config", checkpoint.tokenizer_config), ("config", checkpoint.config),
                       ("generation_config", checkpoint.generation_config)):
        (d / f"{name}.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm2_gguf):
    import os

    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf),
                                                      gguf_file=os.path.basename(smollm2_gguf))


# ---------------------------------------------------------------- test strings

_FIXED = [
    "", " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n \t\t\n   ", "Hello world", "hello world!", " Hello",
    "Hello, world. How are you?", "I'm sure you'll see they've done it; we'd go, isn't it?", "HELLO World hELLo",
    "café naïve résumé Ångström crème brûlée", "e\u0301 (combining) vs é", "Straße Œuvre ﬁ ligature",
    "Ελληνικά γράμματα", "Русский текст, ёжик", "العربية نص", "עברית", "हिन्दी भाषा", "ภาษาไทย", "한국어 문장",
    "日本語のテキスト、カタカナ", "中文文本，标点。", "繁體中文測試", "Tiếng Việt có dấu", "ქართული",
    "👍", "👍🏽 👋🏿", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag 🇫🇷🇯🇵", "🧑‍💻 coder", "emoji🙂in🙃words", "❤️‍🔥",
    "def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    '{"key": [1, 2.5, null], "nested": {"a": "b"}}', "SELECT * FROM t WHERE id = 42;", "<div class=\"x\">&amp;</div>",
    "3.14159 1,000,000 2024-01-01 0x1F 1e-10 -42", "1234567890", "phone: +1 (555) 123-4567",
    "<|im_start|>user\nhi<|im_end|>\n", "text <|endoftext|> more", "<|im_start", "<|im_start|><|im_start|>",
    "a<|im_end|>b", "<repo_name>x<file_sep>", "<|IM_START|>", "< |im_start| >",
    "tabs\tbetween\twords", "trailing spaces   ", "   leading spaces", "many\n\n\n\nnewlines",
    "\u00a0nbsp\u00a0here", "zero\u200bwidth\u200djoiner", "\x00\x01\x7f control", "∑ ∫ √ ≤ ≥ ≠ ∞ π", "™ © ® § ¶ †",
    "https://example.com/path?q=1&b=two#frag", "user@example.com", "C:\\Users\\name\\file.txt", "'''\"\"\"``` ~~~",
    "The quick brown fox jumps over the lazy dog. " * 40, "日本語" * 100, "🙂" * 50, " " * 100, "\n" * 30,
]

_POOLS = [
    [chr(c) for c in range(0x20, 0x7F)],
    [chr(c) for c in range(0xA0, 0x180)],
    [chr(c) for c in range(0x370, 0x400)] + [chr(c) for c in range(0x400, 0x460)],
    [chr(c) for c in range(0x4E00, 0x4E00 + 400)] + [chr(c) for c in range(0x3041, 0x3097)],
    [chr(c) for c in range(0x1F600, 0x1F650)] + [chr(c) for c in range(0x1F300, 0x1F340)],
    [" ", "  ", "\t", "\n", "\r\n", "   \n ", "\u3000"],
    [str(n) for n in range(0, 2000, 7)],
    ["the", " and", " of", "ing", "tion", " Python", "print", "()", "=>", "::", "\u200d", "\ufe0f", "\u0301"],
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<jupyter_code>", "<|im", "end|>"],
]


def _random_strings(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pieces = []
        for _ in range(rng.randint(1, 40)):
            pool = _POOLS[rng.randrange(len(_POOLS))]
            pieces.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        out.append("".join(pieces))
    return out


STRINGS = _FIXED + _random_strings(280)


def test_there_are_enough_strings():
    assert len(STRINGS) >= 300 and len(set(STRINGS)) == len(STRINGS)


def test_encode_matches_transformers_gguf_tokenizer(tok, hf_tok):
    for s in STRINGS:
        assert tok.encode(s) == hf_tok(s)["input_ids"], repr(s)
        assert tok.encode(s, add_special_tokens=False) == hf_tok.encode(s, add_special_tokens=False), repr(s)


def test_decode_matches_transformers_and_round_trips(tok, hf_tok):
    round_trips = 0
    for s in STRINGS:
        ids = tok.encode(s)
        text = tok.decode(ids)
        assert text == hf_tok.decode(ids), repr(s)
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True), repr(s)
        if hf_tok.decode(ids) == s:
            assert text == s
            round_trips += 1
    assert round_trips == len(STRINGS)  # byte-level BPE loses nothing


def test_transformers_reads_the_written_directory(model_dir, tok):
    # the tokenizer files colibri writes are a valid Hugging Face tokenizer on their own
    hf_dir = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for s in STRINGS[::7]:
        assert hf_dir(s)["input_ids"] == tok.encode(s), repr(s)


def test_smollm2_special_tokens(tok, hf_tok):
    assert tok.bos_token == hf_tok.bos_token == "<|im_start|>"
    assert tok.eos_token == hf_tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == {2}
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token is false
    assert tok.encode("<|im_start|>")[0] == 1 and tok.token_to_id("<|endoftext|>") == 0


def test_eos_ids_are_a_union(model_dir, checkpoint, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {0, 2, 5}


def test_add_bos_token_in_config_rebuilds_post_processor(checkpoint):
    cfg = {**checkpoint.tokenizer_config, "add_bos_token": True, "add_eos_token": True}
    t = Tokenizer.from_json(checkpoint.tokenizer_json, cfg)
    assert t.encode("hi") == [1] + t.encode("hi", add_special_tokens=False) + [2]


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(ColibriError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_special_tokens_as_added_token_dicts_and_jinja_file(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>", "lstrip": False, "__type": "AddedToken"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token == "<|im_end|>" and t.eos_token_ids == {2}
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


# ---------------------------------------------------------------- chat templates

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? <b>&'\"</b> 🙂"}],
    [{"role": "user", "content": "Écris un poème 👨‍👩‍👧"}, {"role": "assistant", "content": "  Les mots…\n\n"},
     {"role": "user", "content": "Encore\tune fois\n"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "u2 <b>&'\"</b> 🙂"}, {"role": "assistant", "content": "a2"},
     {"role": "user", "content": "u3"}],
]

RAISING = (
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('Conversations must start with a system message.') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 1) %}"
    "{{ raise_exception('Roles must alternate system/user/assistant/user...') }}{% endif %}"
    "<<{{ message['role'] }}>>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<assistant>>\n{% endif %}"
)
TOJSON_LOOPS = (
    "{% for message in messages %}\n"
    "    {% if message.role == 'system' %}{% continue %}{% endif %}\n"
    "    {{ loop.index }}: {{ message | tojson }}\n"
    "    {% if loop.index >= 4 %}{% break %}{% endif %}\n"
    "{% endfor %}\n"
    "{% if tools %}TOOLS {{ tools | tojson(indent=2) }}\n{% endif %}"
    "{{ {'n': messages | length, 'gen': add_generation_prompt} | tojson }}"
)
BOS_NAMESPACE = (
    "{{ bos_token }}{% set ns = namespace(users=0) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}"
    "[{{ m.role | upper }}] {% generation %}{{ m.content | trim }}{% endgeneration %}{{ eos_token }}\n"
    "{% endfor %}users={{ ns.users }}"
    "{% if add_generation_prompt %}\n[ASSISTANT]{% if enable_thinking is defined and not enable_thinking %} /no_think"
    "{% endif %}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _with_template(checkpoint, template):
    return Tokenizer.from_json(checkpoint.tokenizer_json, {**checkpoint.tokenizer_config, "chat_template": template})


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(tok, hf_tok, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                     return_dict=False)
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == list(ids)


def test_smollm2_template_adds_default_system_prompt(tok):
    text = tok.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template", [RAISING, TOJSON_LOOPS, BOS_NAMESPACE], ids=["raise", "tojson", "bos"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "enable_thinking": False}], ids=["plain", "kwargs"])
def test_inline_templates_match_transformers(checkpoint, hf_tok, template, add_generation_prompt, extra):
    ours = _with_template(checkpoint, template)
    for messages in CONVERSATIONS:
        kw = dict(add_generation_prompt=add_generation_prompt, **extra)
        try:
            expected = hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)
        except Exception as exc:  # jinja2's TemplateError from raise_exception
            with pytest.raises(ColibriError) as info:
                ours.apply_chat_template(messages, **kw)
            assert str(info.value) == str(exc)
            continue
        assert ours.apply_chat_template(messages, **kw) == expected


def test_raise_exception_message(checkpoint):
    t = _with_template(checkpoint, RAISING)
    with pytest.raises(ColibriError, match="^Conversations must start with a system message.$"):
        t.apply_chat_template(CONVERSATIONS[0])
    assert t.apply_chat_template(CONVERSATIONS[1]).endswith("<<user>>\nHi!\n<<assistant>>\n")


def test_tojson_does_not_escape_html(checkpoint):
    text = _with_template(checkpoint, TOJSON_LOOPS).apply_chat_template(CONVERSATIONS[4])
    assert '<b>&\'\\"</b> 🙂' in text and "\\u003c" not in text
    assert '"S"' not in text and "a2" not in text  # continue and break took effect


def test_strftime_now_and_none_fields(checkpoint):
    t = _with_template(checkpoint, "{{ strftime_now('%Y') }}|{% for m in messages %}{{ m.keys() | list }}{% endfor %}")
    text = t.apply_chat_template([{"role": "assistant", "content": "x", "tool_calls": None}])
    assert text in (f"{datetime.now().year}|['role', 'content']", f"{datetime.now().year - 1}|['role', 'content']")


def test_no_template_is_a_user_error(checkpoint):
    cfg = {k: v for k, v in checkpoint.tokenizer_config.items() if k != "chat_template"}
    t = Tokenizer.from_json(checkpoint.tokenizer_json, cfg)
    assert not t.has_chat_template
    with pytest.raises(ColibriError, match="no chat template; pass raw=True"):
        t.apply_chat_template(CONVERSATIONS[0])


def test_broken_template_is_one_line(checkpoint):
    with pytest.raises(ColibriError, match="not valid jinja") as info:
        _with_template(checkpoint, "{% for m in messages %}{{ m.content }").apply_chat_template(CONVERSATIONS[0])
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- streaming

def _stream(tok, ids, **kw):
    dec = tok.stream_decoder(**kw)
    deltas = [dec.feed(i) for i in ids]
    deltas.append(dec.flush())
    return deltas


def test_stream_decoder_holds_back_partial_characters(tok):
    text = "Family: 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin 👋🏽, CJK 日本語, math ∑∫ — done ✅"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the emoji really are split over byte tokens
    deltas = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 10  # it streams, rather than emitting all at the end


def test_stream_decoder_on_all_strings(tok):
    for s in STRINGS:
        ids = tok.encode(s)
        for skip in (False, True):
            deltas = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), repr(s)
            if "\ufffd" not in s:
                assert not any("\ufffd" in d for d in deltas), repr(s)


def test_stream_decoder_flushes_an_incomplete_tail(tok):
    ids = tok.encode("ok 🦩")  # a rare emoji: four byte-level tokens
    cut = ids[:-1]  # its last byte is missing
    assert tok.decode(cut) == "ok \ufffd"
    deltas = _stream(tok, cut)
    assert "".join(deltas) == tok.decode(cut) and deltas[-1] == " \ufffd"
    assert not any("\ufffd" in d for d in deltas[:-1])


def test_template_failure_on_bad_messages_is_one_line(tok):
    # SmolLM2's template concatenates strings, so OpenAI-style content parts cannot render
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(ColibriError, match="chat template failed on these messages") as info:
        tok.apply_chat_template(messages)
    assert "\n" not in str(info.value)
