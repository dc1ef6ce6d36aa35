"""colibri.grammar on the real SmolLM2 tokenizer: whatever the logits, a masked generation is a
document the grammar describes. Random logits (argmax of the masked logits, and sampling at
temperature 1 from their softmax) walk the matcher until it is done; the decoded text must
parse as JSON and validate against the schema with `jsonschema` (formats checked)."""
import json
import re

import numpy as np
import pytest

from colibri.grammar import Grammar, GrammarError, Matcher, apply_bitmask, close_objects

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MAX_STEPS = 1500
SOFT_STEPS = 40      # after this many tokens, tokens that can close a string/array/object get a push


@pytest.fixture(scope="module")
def tok(smollm2_gguf):
    from colibri.io.gguf_import import read_gguf
    from colibri.tokenizer import Tokenizer

    c = read_gguf(smollm2_gguf)
    return Tokenizer.from_json(c.tokenizer_json, c.tokenizer_config, c.generation_config, c.config)


@pytest.fixture(scope="module")
def closers(tok):
    """A push (after SOFT_STEPS) for tokens that can end what is open: a quote (a string), an @
    (an email's local part, where braces are legal), a closing bracket. Random walks then end
    in a few hundred tokens instead of wandering through strings 49k tokens wide."""
    bias = np.zeros(tok.vocab_size, dtype=np.float32)
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        bias[i] = 8.0 if '"' in text else 6.0 if "@" in text else 4.0 if ("]" in text or "}" in text) else 0.0
    return bias


def generate(tok, grammar: Grammar, seed: int, mode: str, closers=None) -> tuple[str, Matcher]:
    """Tokens picked from masked random logits until the matcher is done or EOS comes."""
    m = grammar.matcher()
    rng = np.random.default_rng(seed)
    eos = tok.eos_token_ids
    out: list[int] = []
    for step in range(MAX_STEPS):
        logits = rng.standard_normal(grammar.vocab_size).astype(np.float32)
        if closers is not None and step >= SOFT_STEPS:
            logits[:closers.size] += closers
        m.mask(logits)
        assert not m.dead, f"dead end after {tok.decode(out)!r}"
        assert np.isneginf(logits[tok.vocab_size:]).all()
        if mode == "argmax":
            t = int(np.argmax(logits))
        else:
            p = np.exp(logits - logits.max())
            t = int(rng.choice(logits.size, p=p / p.sum()))
        assert np.isfinite(logits[t])
        m.accept(t)
        if t in eos:
            break
        out.append(t)
        if m.done:
            break
    else:
        pytest.fail(f"no end in {MAX_STEPS} steps: {tok.decode(out)[:300]!r}...")
    return tok.decode(out), m


def accepts(grammar: Grammar, tok, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized the usual way) and may end after it."""
    m = grammar.matcher()
    logits = np.zeros(grammar.vocab_size, dtype=np.float32)
    for t in tok.encode(text, add_special_tokens=False):
        try:
            m.accept(t)
        except GrammarError:
            return False
    m.mask(logits)
    return any(np.isfinite(logits[e]) for e in tok.eos_token_ids)


SCHEMAS = {
    "flat": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"}, "score": {"type": "number"}}, "required": ["name", "age", "ok"]}, True),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]}},
                 "required": ["id", "address"]},
        "note": {"type": ["string", "null"], "maxLength": 20}}, "required": ["user"]}, True),
    "arrays": ({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8},
                 "minItems": 2, "maxItems": 4},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": -9,
                                                                          "maximum": 9}, "maxItems": 3},
                   "maxItems": 3}}, "required": ["tags", "matrix"]}, True),
    "enums": ({"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"enum": [1, 2, 3, None, "huge"]},
        "kind": {"const": "shirt"}}, "required": ["color", "size", "kind"]}, True),
    "anyOf": ({"type": "object", "properties": {"item": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
         "required": ["kind", "n"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "b"}, "s": {"type": "string", "maxLength": 5}},
         "required": ["kind", "s"], "additionalProperties": False},
        {"type": "null"}]}}, "required": ["item"]}, True),
    "formats": ({"type": "object", "properties": {
        "day": {"type": "string", "format": "date"},
        "when": {"type": "string", "format": "date-time"},
        "mail": {"type": "string", "format": "email"},
        "id": {"type": "string", "format": "uuid"},
        "ip": {"type": "string", "format": "ipv4"}}, "required": ["day", "when", "mail", "id", "ip"]}, True),
    "lengths": ({"type": "object", "properties": {
        "code": {"type": "string", "minLength": 3, "maxLength": 3},
        "word": {"type": "string", "minLength": 2, "maxLength": 6},
        "text": {"type": "string", "maxLength": 30}}, "required": ["code", "word"]}, True),
    "integers": ({"type": "object", "properties": {
        "small": {"type": "integer", "minimum": -3, "maximum": 3},
        "big": {"type": "integer", "minimum": 1000, "maximum": 99999},
        "pos": {"type": "integer", "exclusiveMinimum": 0},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["small", "big", "pos", "ratio"]}, True),
    "optional keys": ({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "string", "maxLength": 4},
        "d": {"type": "null"}}, "required": ["c"]}, True),
    "$ref": ({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                               "required": ["x", "y"]}},
              "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}},
              "required": ["from", "to"]}, True),
    "top-level array": ({"type": "array", "items": {"type": "object", "properties": {
        "k": {"enum": ["x", "y"]}, "v": {"type": "integer"}}, "required": ["k", "v"]},
        "minItems": 1, "maxItems": 3}, True),
    # strict false: extra keys allowed where the schema allows them, unsupported keywords ignored
    "lenient": ({"type": "object", "properties": {"id": {"type": "integer"},
                                                  "ids": {"type": "array", "items": {"type": "integer"},
                                                          "uniqueItems": True, "maxItems": 1}},
                 "required": ["id", "ids"]}, False),
}


def check_instance(schema, text):
    value = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    return value


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_random_logits_give_valid_json(tok, closers, name):
    schema, strict = SCHEMAS[name]
    g = Grammar.compile(tok, {"json_schema": schema, "strict": strict}, tok.vocab_size)
    for seed in range(3):
        for mode in ("argmax", "sample"):
            text, m = generate(tok, g, seed, mode, closers)
            check_instance(close_objects(schema) if strict else schema, text)  # strict: no extra keys
            assert m.mask_seconds > 0


def test_strict_closes_objects_and_lenient_does_not(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    strict = Grammar.compile(tok, {"json_schema": schema, "strict": True}, tok.vocab_size)
    loose = Grammar.compile(tok, {"json_schema": schema}, tok.vocab_size)
    assert accepts(strict, tok, '{"a": 1}') and accepts(loose, tok, '{"a": 1}')
    assert not accepts(strict, tok, '{"a": 1, "b": 2}')
    assert accepts(loose, tok, '{"a": 1, "b": 2}')
    assert not accepts(strict, tok, '{"b": 2}') and not accepts(loose, tok, '{"b": 2}')


def test_close_objects_leaves_combinations_alone():
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {}}}},
              "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
              "$defs": {"d": {"type": "object", "properties": {"x": {}}}}}
    out = close_objects(schema)
    assert "additionalProperties" not in out                      # beside allOf
    assert out["properties"]["p"]["additionalProperties"] is False
    assert all("additionalProperties" not in s for s in out["allOf"])
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema["properties"]["p"]  # the input is not modified
    explicit = {"type": "object", "properties": {"x": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(explicit) == explicit


def test_regex(tok):
    pattern = r"[A-Z]{2}-[0-9]{3}( [a-z]{1,8})?"
    g = Grammar.compile(tok, {"regex": pattern}, tok.vocab_size)
    for seed in range(4):
        for mode in ("argmax", "sample"):
            text, _ = generate(tok, g, seed, mode)
            assert re.fullmatch(pattern, text), text


def test_json_object(tok, closers):
    g = Grammar.compile(tok, {"json_object": True}, tok.vocab_size)
    for seed in range(4):
        for mode in ("argmax", "sample"):
            text, m = generate(tok, g, seed, mode, closers)
            assert isinstance(json.loads(text), dict), text
            assert m.done


def test_lark(tok):
    g = Grammar.compile(tok, {"lark": 'start: "answer: " ("yes" | "no") "."'}, tok.vocab_size)
    for seed in range(6):
        text, m = generate(tok, g, seed, "argmax")
        assert text in ("answer: yes.", "answer: no."), text
        assert m.done


@pytest.mark.parametrize("spec, words", [
    ({"json_schema": {"type": "nonsense"}}, ["invalid JSON schema", "nonsense"]),
    ({"json_schema": {"type": "string", "format": "colour"}, "strict": True}, ["not support", "colour"]),
    ({"json_schema": {"type": "array", "uniqueItems": True}, "strict": True}, ["not support", "uniqueItems"]),
    ({"json_schema": {"$ref": "#/$defs/missing"}}, ["invalid JSON schema", "missing"]),
    ({"json_schema": False}, ["invalid JSON schema"]),
    ({"json_schema": "{}"}, ["json_schema", "JSON object"]),
    ({"regex": "a(b"}, ["invalid regex", "unclosed"]),
    ({"regex": "x{3,1}"}, ["invalid regex"]),
    ({"lark": "start: foo"}, ["invalid Lark grammar", "foo"]),
    ({"lark": "start: \"a\" <|no_such_token|>"}, ["invalid Lark grammar", "no_such_token"]),
    ({"regex": "a", "lark": "start: \"a\""}, ["exactly one"]),
    ({"json_object": False}, ["json_object"]),
    ({"regex": "a", "strict": True}, ["strict"]),
    ({}, ["exactly one"]),
    ("regex", ["dict"]),
])
def test_bad_specs_raise_clear_errors(tok, spec, words):
    with pytest.raises(GrammarError) as e:
        Grammar.compile(tok, spec, tok.vocab_size)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_lenient_schema_ignores_unsupported_keywords_with_a_warning(tok):
    g = Grammar.compile(tok, {"json_schema": {"type": "array", "uniqueItems": True}, "strict": False}, tok.vocab_size)
    assert any("uniqueItems" in w for w in g.warnings)


def test_dead_end_is_reported_not_looped(tok):
    """The grammar wants token 49100 after "a", but the logits stop at 49000: nothing allowed."""
    g = Grammar.compile(tok, {"lark": 'start: "a" <[49100]>'}, 49000)
    m = g.matcher()
    logits = np.zeros(49000, dtype=np.float32)
    m.mask(logits)
    assert not m.dead and np.isfinite(logits[tok.token_to_id("a")])
    m.accept(tok.token_to_id("a"))
    steps = 0
    while steps < 10:  # what the engine does: mask, then stop on dead
        logits = np.zeros(49000, dtype=np.float32)
        m.mask(logits)
        if m.dead:
            break
        steps += 1
    assert m.dead and steps == 0 and not m.done
    assert np.isneginf(logits).all()
    with pytest.raises(GrammarError):
        m.accept(49100)  # outside the logits


def test_eos_masked_until_complete(tok):
    eos = min(tok.eos_token_ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = Grammar.compile(tok, {"json_schema": schema, "strict": True}, tok.vocab_size).matcher()
    ids = tok.encode('{"a": 12}', add_special_tokens=False)
    for t in ids:
        logits = np.zeros(tok.vocab_size, dtype=np.float32)
        m.mask(logits)
        assert np.isneginf(logits[eos]) and not m.done
        m.accept(t)
    logits = np.zeros(tok.vocab_size, dtype=np.float32)
    m.mask(logits)
    assert m.done and np.isfinite(logits[eos])
    assert np.count_nonzero(np.isfinite(logits)) == len(tok.eos_token_ids)  # nothing but EOS
    m.accept(eos)
    assert m.done

    # a number may go on or stop: EOS allowed, but not done
    m = Grammar.compile(tok, {"regex": "[0-9]+"}, tok.vocab_size).matcher()
    m.accept(tok.encode("7", add_special_tokens=False)[0])
    logits = np.zeros(tok.vocab_size, dtype=np.float32)
    m.mask(logits)
    assert np.isfinite(logits[eos]) and not m.done
    assert np.isfinite(logits[tok.encode("8", add_special_tokens=False)[0]])


def test_extra_ids_past_the_tokenizer_always_masked(tok):
    vocab = tok.vocab_size + 100
    g = Grammar.compile(tok, {"json_schema": {"type": "object", "properties": {"s": {"type": "string"}}},
                              "strict": True}, vocab)
    m = g.matcher()
    for t in tok.encode('{"s": "some free text', add_special_tokens=False):
        logits = np.full(vocab, 5.0, dtype=np.float32)
        m.mask(logits)
        assert np.isneginf(logits[tok.vocab_size:]).all()
        m.accept(t)
    logits = np.full(vocab, 5.0, dtype=np.float32)
    m.mask(logits)  # inside a string: nearly every real id allowed
    assert np.count_nonzero(np.isfinite(logits)) > tok.vocab_size // 2
    assert np.isneginf(logits[tok.vocab_size:]).all()
    with pytest.raises(GrammarError, match="outside"):
        m.accept(tok.vocab_size + 3)
    with pytest.raises(ValueError, match="vocab_size"):
        m.mask(np.zeros(tok.vocab_size, dtype=np.float32))


def test_forbidden_token_raises_and_leaves_the_state(tok):
    g = Grammar.compile(tok, {"regex": "[0-9]x"}, tok.vocab_size)
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in "7x")
    m = g.matcher()
    with pytest.raises(GrammarError, match="not allowed"):  # no mask computed yet
        m.accept(b)
    m.mask(np.zeros(tok.vocab_size, dtype=np.float32))
    with pytest.raises(GrammarError, match="not allowed"):  # checked against the mask
        m.accept(b)
    m.accept(a)
    m.accept(b)
    assert m.done
    # one Grammar, independent matchers
    m2 = g.matcher()
    m2.accept(a)
    assert not m2.done and m.done


def test_engine_object_cached_per_tokenizer(tok):
    from colibri import grammar

    Grammar.compile(tok, {"regex": "x"}, tok.vocab_size)
    first = grammar._ENGINES[tok]
    Grammar.compile(tok, {"regex": "y"}, tok.vocab_size + 64)
    assert grammar._ENGINES[tok] is first


def test_whitespace_runs_are_bounded(tok):
    g = Grammar.compile(tok, {"json_schema": {"type": "array", "items": {"type": "integer"}}}, tok.vocab_size)
    assert accepts(g, tok, "[1,\n  2]")
    assert accepts(g, tok, "[1," + " " * 32 + "2]")
    assert not accepts(g, tok, "[1," + " " * 33 + "2]")


def test_apply_bitmask_matches_a_plain_where():
    rng = np.random.default_rng(0)
    for n, live, vocab in [(1000, 1000, 1000), (1000, 990, 1030), (70, 64, 64), (5000, 4000, 4000)]:
        for density in (0.0, 0.002, 0.05, 0.5, 0.98, 1.0):
            bits = rng.random(((n + 31) // 32) * 32) < density
            words = np.packbits(bits, bitorder="little").view(np.int32)
            logits = rng.standard_normal((2, vocab)).astype(np.float32)
            keep = np.zeros(vocab, bool)
            keep[:live] = bits[:live]
            expected = np.where(keep, logits, -np.inf).astype(np.float32)
            got = logits.copy()
            apply_bitmask(got, words, live)
            assert np.array_equal(got, expected)
            row = logits[0].copy()
            apply_bitmask(row, words, live)
            assert np.array_equal(row, expected[0])
