"""Grammar engines for constrained decoding, measured where colibri pays for them: llguidance
against xgrammar, at the SmolLM2 vocabulary (49,152 tokens) and at a ~150k one, on JSON schemas.

Per engine and vocabulary:
  import     seconds to import the engine in a fresh interpreter, and whether that pulls in torch
  tok        seconds to build the engine's tokenizer object (once per tokenizer in colibri)
  compile    seconds from schema to a matcher (llguidance: grammar_from_json_schema + LLMatcher;
             xgrammar: compile_json_schema, cache off, + GrammarMatcher)
  first      seconds of the first mask (llguidance builds its lexer lazily, so this is part of
             what a request waits for before its first token)
  mask       per-token mask fill (engine only, into a numpy int32 bitmask), mean and p99 over a
             walk of a valid JSON document token by token (mask, then accept the document's
             token), first mask excluded
  accept     per-token accept (consume) time, mean
Plus, at each vocabulary, colibri.grammar: Grammar.compile (the per-tokenizer object built
before, so tok is that one-off), its first mask and Matcher.mask() per token (llguidance fill +
the numpy apply onto one float32 logits buffer; the two interleaved evict each other's data from
the caches, so this is more than fill + apply measured apart), the apply alone, and schema
coverage at 49k: of ~20 schemas (common
features and known-hard ones), how many each engine compiles, how many accept a valid instance
(walked token by token, EOS allowed at the end), and how many reject an invalid one (a schema
feature compiled but not enforced counts as not enforced).

The ~150k vocabulary: SmolLM2's tokenizer.json with its byte-level BPE vocabulary extended to
150,000 tokens by fragments of real text: Python's standard library sources (code, docstrings,
comments, some non-English test strings), split the way GPT-2-style pre-tokenizers split
(words with their leading space, 1-3 digit numbers, punctuation runs, whitespace runs) plus
word prefixes/suffixes of 3+ characters (the subword pieces BPE vocabularies are full of), most
frequent first. The new tokens get no merges; the model sets ignore_merges (as Llama 3's
tokenizer.json does), so a pre-tokenized word that is in the vocabulary encodes as that one
token: documents encode with the new whole-word tokens (~12% fewer tokens than at 49k) and
stay canonical (llguidance refuses, at forced text, a token that encoding would not give).

The pick: an engine that imports torch is out (torch is a test-only dependency of colibri);
among the rest, the most schemas compiled + enforced, then the lower worst p99 at 150k.

    python -m bench.kernels.grammar_mask                  # both engines, both vocabularies (~30 s)
    python -m bench.kernels.grammar_mask --engines llguidance --steps 500
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from bench.common import add_json_arg, machine_line, write_json
from colibri.io.gguf_import import bytes_to_unicode  # the byte-level BPE alphabet

EXT_VOCAB = 150_000

# ---------------------------------------------------------------- schemas and documents

TEXT = ("Constrained decoding masks the logits of every token that cannot continue a valid "
        "document, so the sampler only ever picks a token the grammar allows. The mask is "
        "computed once per step on the CPU while the model runs; it has to be cheap next to a "
        "decode step, which for a small model is a few milliseconds and for a large mixture "
        "of experts streamed from disk may be much longer. Schemas come from clients: flat "
        "records, nested arrays of objects, enumerations, unions, formatted strings.")
WORDS = TEXT.replace(",", "").replace(".", "").replace(";", "").split()

TIMED = {
    "flat": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "active": {"type": "boolean"},
                       "score": {"type": "number"}, "owner": {"type": "string"}, "notes": {"type": "string"},
                       "count": {"type": "integer"}, "summary": {"type": "string"}},
        "required": ["id", "name", "active", "score", "notes", "summary"],
        "additionalProperties": False,
    },
    "nested+arrays": {
        "type": "object",
        "properties": {
            "team": {"type": "string"},
            "members": {"type": "array", "minItems": 1, "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                                 "zip": {"type": "string"}},
                                "required": ["city"], "additionalProperties": False}},
                "required": ["name", "age", "tags", "address"], "additionalProperties": False}}},
        "required": ["team", "members"], "additionalProperties": False,
    },
    "enum+anyOf": {
        "type": "object",
        "properties": {
            "level": {"enum": ["debug", "info", "warning", "error"]},
            "events": {"type": "array", "items": {"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                                  "y": {"type": "integer"}},
                 "required": ["kind", "x", "y"], "additionalProperties": False},
                {"type": "object", "properties": {"kind": {"const": "key"},
                                                  "key": {"enum": ["Enter", "Escape", "Tab", "Space"]},
                                                  "mods": {"type": "array",
                                                           "items": {"enum": ["ctrl", "alt", "shift", "meta"]}}},
                 "required": ["kind", "key", "mods"], "additionalProperties": False},
                {"type": "null"}]}}},
        "required": ["level", "events"], "additionalProperties": False,
    },
    "formats+lengths": {
        "type": "object",
        "properties": {"records": {"type": "array", "items": {
            "type": "object",
            "properties": {"id": {"type": "string", "format": "uuid"},
                           "created": {"type": "string", "format": "date-time"},
                           "day": {"type": "string", "format": "date"},
                           "email": {"type": "string", "format": "email"},
                           "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "title": {"type": "string", "minLength": 3, "maxLength": 40}},
            "required": ["id", "created", "day", "email", "code", "title"], "additionalProperties": False}}},
        "required": ["records"], "additionalProperties": False,
    },
}


def timed_doc(name: str) -> dict:
    """A valid instance of TIMED[name], a few hundred tokens long, properties in schema order."""
    if name == "flat":
        return {"id": 1234567, "name": "Constrained decoding", "active": True, "score": 0.875,
                "owner": "colibri", "notes": TEXT, "count": 42, "summary": " ".join(WORDS[:40])}
    if name == "nested+arrays":
        return {"team": "engine", "members": [
            {"name": f"{WORDS[i]} {WORDS[i + 1]}", "age": 20 + i, "tags": WORDS[i:i + 1 + i % 4],
             "address": {"city": WORDS[i + 2].title(), "zip": f"{10000 + 37 * i}"}} for i in range(12)]}
    if name == "enum+anyOf":
        keys, mods = ["Enter", "Escape", "Tab", "Space"], ["ctrl", "alt", "shift", "meta"]
        events = []
        for i in range(24):
            if i % 5 == 4:
                events.append(None)
            elif i % 2:
                events.append({"kind": "key", "key": keys[i % 4], "mods": mods[:i % 3]})
            else:
                events.append({"kind": "click", "x": 17 * i, "y": 480 - 9 * i})
        return {"level": "warning", "events": events}
    if name == "formats+lengths":
        return {"records": [{"id": f"{i:08x}-4b1d-4c2e-9f3a-{i * 7919:012x}",
                             "created": f"2025-0{1 + i % 9}-1{i % 10}T0{i % 10}:3{i % 6}:00Z",
                             "day": f"2024-1{i % 3}-2{i % 9}", "email": f"{WORDS[i].lower()}.{i}@example.org",
                             "code": f"{'ABCDEFGH'[i % 8]}{'XYZ'[i % 3]}Q-{1000 + 13 * i}",
                             "title": " ".join(WORDS[i:i + 4])[:40]} for i in range(8)]}
    raise KeyError(name)


# Coverage: (name, schema, a valid instance, an invalid instance the schema's feature rejects)
COVERAGE = [
    ("flat", TIMED["flat"], timed_doc("flat"), {"id": 1, "name": "x"}),
    ("nested+arrays", TIMED["nested+arrays"], timed_doc("nested+arrays"), {"team": "t", "members": []}),
    ("enum+anyOf", TIMED["enum+anyOf"], timed_doc("enum+anyOf"), {"level": "fatal", "events": []}),
    ("formats+lengths", TIMED["formats+lengths"], timed_doc("formats+lengths"),
     {"records": [{"id": "x", "created": "y", "day": "z", "email": "w", "code": "AB", "title": "ab"}]}),
    ("$defs/$ref", {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                     "required": ["x", "y"], "additionalProperties": False}},
                    "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
                    "required": ["a", "b"], "additionalProperties": False},
     {"a": {"x": 1, "y": 2}, "b": {"x": 3.5, "y": -1}}, {"a": {"x": 1}, "b": {"x": 3, "y": 4}}),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
     {"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]}, {"v": 1, "kids": [{"v": 2}]}),
    ("oneOf (disjoint)", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "abc", True),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     {"a": 1, "b": "x"}, {"a": 1}),
    ("prefixItems tuple", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     ["a", 1], ["a", "b"]),
    ("nullable type list", {"type": "object", "properties": {"n": {"type": ["string", "null"]}}, "required": ["n"]},
     {"n": None}, {"n": 1}),
    ("number bounds", {"type": "object", "properties": {
        "p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "k": {"type": "integer", "minimum": -5, "maximum": 1000000}}, "required": ["p", "k"]},
     {"p": 0.5, "k": 999}, {"p": 0.5, "k": 1000001}),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 25, 7),
    ("patternProperties", {"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
                           "additionalProperties": False}, {"x-ab": 1, "x-cd": 2}, {"y": 1}),
    ("map (additionalProperties schema)", {"type": "object", "additionalProperties": {"type": "integer"}},
     {"a": 1, "b": 2}, {"a": "x"}),
    ("min/maxProperties", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1,
                           "maxProperties": 2}, {"a": 1}, {}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2, 3], [1, 1]),
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]},
     {"a": 1}, {"a": "s"}),
    ("if/then/else", {"type": "object", "properties": {"t": {"enum": ["a", "b"]}, "v": {}}, "required": ["t", "v"],
                      "if": {"properties": {"t": {"const": "a"}}}, "then": {"properties": {"v": {"type": "integer"}}},
                      "else": {"properties": {"v": {"type": "string"}}}}, {"t": "a", "v": 1}, {"t": "a", "v": "s"}),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, {"a": 1, "b": 2}, {"a": 1}),
    ("pattern with lookahead", {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4,8}$"}, "ab12", "abcd"),
    ("formats uri/ipv4/hostname", {"type": "object", "properties": {
        "u": {"type": "string", "format": "uri"}, "ip": {"type": "string", "format": "ipv4"},
        "h": {"type": "string", "format": "hostname"}}, "required": ["u", "ip", "h"]},
     {"u": "https://example.org/a?b=c", "ip": "10.0.0.1", "h": "example.org"},
     {"u": "https://example.org/", "ip": "300.1.1.1", "h": "example.org"}),
    ("long maxLength + const", {"type": "object", "properties": {"c": {"const": 3}, "s": {"type": "string", "minLength": 10,
                                                                                      "maxLength": 2000}},
                                "required": ["c", "s"]}, {"c": 3, "s": TEXT}, {"c": 3, "s": "short"}),
]


# ---------------------------------------------------------------- the ~150k vocabulary

_PIECES = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s{1,16}")


def extended_tokenizer_json(base_json: str, target: int = EXT_VOCAB, corpus_bytes: int = 12_000_000) -> str:
    """base_json's byte-level BPE vocabulary grown to `target` tokens by frequent fragments of
    the standard library's sources (see the module docstring). Deterministic."""
    data = json.loads(base_json)
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in data.get("added_tokens", [])}
    next_id = max([*vocab.values(), *(t["id"] for t in data.get("added_tokens", []))]) + 1
    counts: collections.Counter = collections.Counter()
    read = 0
    for path in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True)):
        if "site-packages" in path:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        pieces = _PIECES.findall(text)
        counts.update(pieces)
        for p in pieces:  # subword pieces: prefixes and suffixes of longer words
            w = p.lstrip()
            if len(w) >= 6 and w.isalpha():
                lead = p[:len(p) - len(w)]
                counts.update(lead + w[:k] for k in range(3, len(w) - 2))
                counts.update(w[k:] for k in range(2, len(w) - 3))
        read += len(text)
        if read >= corpus_bytes:
            break
    table = bytes_to_unicode()
    for piece, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if next_id >= target:
            break
        token = "".join(table[b] for b in piece.encode("utf-8"))
        if token not in taken:
            taken.add(token)
            vocab[token] = next_id
            next_id += 1
    if next_id < target:
        raise SystemExit(f"the corpus gave only {next_id} tokens; raise corpus_bytes")
    # No merges make the new tokens; with ignore_merges (as Llama 3's tokenizer.json has it) a
    # pre-tokenized word found in the vocabulary is one token, so the new whole words are what
    # encoding produces (canonical: engines may refuse a token that encoding would never give).
    data["model"]["ignore_merges"] = True
    return json.dumps(data, ensure_ascii=False)


# ---------------------------------------------------------------- engines

def import_cost(module: str) -> tuple[float, bool]:
    code = ("import sys, time; t = time.perf_counter(); import " + module +
            "; print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), out[1] == "True"


class LLG:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: list[int]):
        import llguidance as llg
        import llguidance.numpy as lnp

        self.llg, self.lnp = llg, lnp
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tokenizer_json, eos_token=eos)
        self.tok_s = time.perf_counter() - t0
        self.n = self.tok.vocab_size
        self.fill(self.matcher({"type": "object"}), np.zeros((1, (self.n + 31) // 32), dtype=np.int32))  # warm-up

    def matcher(self, schema: dict):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m, bitmask):
        self.lnp.fill_next_token_bitmask(m, bitmask)

    def accept(self, m, t: int) -> bool:
        return m.consume_token(t)


class XGR:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        data = json.loads(tokenizer_json)
        vocab = dict(data["model"]["vocab"])
        vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        encoded = [""] * (max(vocab.values()) + 1)
        for w, i in vocab.items():
            encoded[i] = w
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=len(encoded), stop_token_ids=eos,
                                 add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.tok_s = time.perf_counter() - t0
        self.n = len(encoded)
        self.fill(self.matcher({"type": "object"}), np.zeros((1, (self.n + 31) // 32), dtype=np.int32))  # warm-up

    def matcher(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)


def allowed(bitmask: np.ndarray, t: int) -> bool:
    return bool(bitmask.view(np.uint8)[0, t >> 3] >> (t & 7) & 1)


def walk(engine, schema: dict, tokens: list[int], eos: int | None) -> dict:
    """Compile, then mask/accept each token of a document (then check EOS is allowed at its end,
    unless eos is None: a document cut short); times in seconds; `bad`: tokens refused."""
    t0 = time.perf_counter()
    m = engine.matcher(schema)
    compile_s = time.perf_counter() - t0
    bitmask = np.zeros((1, (engine.n + 31) // 32), dtype=np.int32)
    fills, accepts, bad = [], [], 0
    for t in tokens + ([eos] if eos is not None else []):
        t0 = time.perf_counter()
        engine.fill(m, bitmask)
        fills.append(time.perf_counter() - t0)
        bad += not allowed(bitmask, t)
        if t == eos:
            break
        t0 = time.perf_counter()
        ok = engine.accept(m, t)
        accepts.append(time.perf_counter() - t0)
        if not ok:
            bad += 1
            break
    rest = np.array(fills[1:] or fills)
    return {"compile": compile_s, "first": fills[0], "mean": float(rest.mean()), "p99": float(np.percentile(rest, 99)),
            "accept": float(np.mean(accepts)), "steps": len(fills), "bad": bad}


def colibri_mask(tokenizer, schema: dict, tokens: list[int], vocab: int) -> dict:
    """colibri.grammar over the same walk: Grammar.compile (+ matcher) time, the first mask, and
    Matcher.mask() per token (llguidance fill + numpy apply on float32 logits) mean and p99,
    with the apply alone (mean)."""
    from colibri.grammar import Grammar

    t0 = time.perf_counter()
    m = Grammar.compile(tokenizer, {"json_schema": schema, "strict": True}, vocab).matcher()
    compile_s = time.perf_counter() - t0
    logits = np.random.default_rng(0).standard_normal(vocab).astype(np.float32)
    z = np.empty_like(logits)  # one logits buffer, as the engine's
    totals, applies = [], []
    for i, t in enumerate(tokens):
        np.copyto(z, logits)
        t0 = time.perf_counter()
        m.mask(z)
        totals.append(time.perf_counter() - t0)
        if i:  # the mask is fresh now: a second call times the apply alone
            np.copyto(z, logits)
            t0 = time.perf_counter()
            m.mask(z)
            applies.append(time.perf_counter() - t0)
        m.accept(t)
    rest = np.array(totals[1:])
    return {"compile": compile_s, "first": totals[0], "mean": float(rest.mean()),
            "p99": float(np.percentile(rest, 99)), "apply": float(np.mean(applies))}


class quiet_stderr:
    """fd 2 to /dev/null (xgrammar's C++ logs a warning per keyword it ignores)."""

    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


def coverage(engine, encode, eos: int) -> tuple[int, int, int, list[str]]:
    compiled = accepted = enforced = 0
    failures = []
    for name, schema, good, bad in COVERAGE:
        try:
            with quiet_stderr():
                engine.matcher(schema)
        except Exception as exc:
            failures.append(f"{name}: {' '.join(str(exc).split())[:100]}")
            continue
        compiled += 1
        with quiet_stderr():
            accepted += walk(engine, schema, encode(json.dumps(good)), eos)["bad"] == 0
            enforced += walk(engine, schema, encode(json.dumps(bad)), eos)["bad"] > 0
    return compiled, accepted, enforced, failures


# ---------------------------------------------------------------- main

def us(x: float) -> str:
    return f"{x * 1e6:8.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--steps", type=int, default=1000, help="at most this many tokens walked per document")
    add_json_arg(ap)
    args = ap.parse_args()
    print(machine_line())
    engines = [e for e in args.engines.split(",") if e]
    classes = {"llguidance": LLG, "xgrammar": XGR}
    import importlib.util

    for e in [e for e in engines if importlib.util.find_spec(e) is None]:
        print(f"{e} is not installed: skipped (pip install llguidance / xgrammar==0.2.9)")
        engines.remove(e)

    from colibri.default_model import default_model_dir
    from colibri.tokenizer import Tokenizer

    t_all = time.perf_counter()
    smol = Tokenizer.from_dir(default_model_dir(progress=True))
    base_json = smol.backend.to_str()
    eos = sorted(smol.eos_token_ids)
    t0 = time.perf_counter()
    ext_json = extended_tokenizer_json(base_json)
    ext = Tokenizer.from_json(ext_json, {"eos_token": smol.eos_token}, {"eos_token_id": eos})
    print(f"~150k vocabulary: {ext.vocab_size} tokens, built in {time.perf_counter() - t0:.1f}s "
          f"(SmolLM2's {smol.vocab_size} + {ext.vocab_size - smol.vocab_size} stdlib text fragments)")

    print("\nimport cost (fresh interpreter):")
    torch_free = {}
    for e in engines:
        s, torch = import_cost({"llguidance": "llguidance, llguidance.numpy", "xgrammar": "xgrammar"}[e])
        torch_free[e] = not torch
        print(f"  {e:11s} {s:6.2f}s  imports torch: {'yes' if torch else 'no'}")

    header = (f"{'vocab':>5} {'engine':11} {'schema':16} {'tok s':>5} {'compile ms':>10} {'first us':>8} "
              f"{'mask us':>8} {'p99 us':>8} {'accept us':>9} {'steps':>5} {'bad':>3}")
    print("\nper-token figures: mask = the engine's bitmask fill; colibri rows = Matcher.mask() (fill + apply)")
    print(header + "\n" + "-" * len(header))
    summary: dict = collections.defaultdict(list)
    for label, tokenizer, tok_json in (("49k", smol, base_json), ("150k", ext, ext_json)):
        docs = {name: tokenizer.encode(json.dumps(timed_doc(name)), add_special_tokens=False)[:args.steps]
                for name in TIMED}
        for e in engines:
            engine = classes[e](tok_json, eos)
            for name, schema in TIMED.items():
                whole = len(docs[name]) < args.steps  # cut short: no EOS check at the end
                r = walk(engine, schema, docs[name], eos[0] if whole else None)
                summary[(label, e)].append(r)
                print(f"{label:>5} {e:11} {name:16} {engine.tok_s:5.2f} {r['compile'] * 1e3:10.1f} {us(r['first'])} "
                      f"{us(r['mean'])} {us(r['p99'])} {us(r['accept']):>9} {r['steps']:5d} {r['bad']:3d}")
        if "llguidance" in engines:
            from colibri.grammar import _ll_tokenizer

            t0 = time.perf_counter()
            _ll_tokenizer(tokenizer)  # built once per Tokenizer, warm-up included
            tok_s = time.perf_counter() - t0
            for name, schema in TIMED.items():
                r = colibri_mask(tokenizer, schema, docs[name], tokenizer.vocab_size)
                summary[(label, "colibri")].append(r)
                print(f"{label:>5} {'colibri':11} {name:16} {tok_s:5.2f} {r['compile'] * 1e3:10.1f} {us(r['first'])} "
                      f"{us(r['mean'])} {us(r['p99'])}   (apply alone {r['apply'] * 1e6:.0f} us)")

    print(f"\nschema coverage at 49k, of {len(COVERAGE)} schemas: compiled / accepts a valid instance / "
          "rejects an invalid one (llguidance as colibri's strict mode: unsupported = error)")
    enc = lambda s: smol.encode(s, add_special_tokens=False)  # noqa: E731
    cov = {}
    for e in engines:
        engine = classes[e](base_json, eos)
        compiled, accepted, enforced, failures = coverage(engine, enc, eos[0])
        cov[e] = (compiled, accepted, enforced)
        print(f"  {e:11s} {compiled:2d} / {accepted:2d} / {enforced:2d}")
        for f in failures:
            print(f"      not compiled: {f}")

    print("\nmeans over the four schemas:")
    for (label, e), rows in summary.items():
        print(f"  {label:>5} {e:11s} compile {np.mean([r['compile'] for r in rows]) * 1e3:6.1f} ms   first mask "
              f"{np.mean([r['first'] for r in rows]) * 1e6:6.0f} us   per-token mask "
              f"{np.mean([r['mean'] for r in rows]) * 1e6:5.0f} us   worst p99 {max(r['p99'] for r in rows) * 1e6:6.0f} us")
    if len(engines) == 2:
        # The pick: an engine that imports torch is out (torch is test-only for colibri); among
        # the rest, the most schemas compiled and enforced; then the lower worst p99 at 150k.
        ok = [e for e in engines if torch_free[e]] or engines
        best = max(cov[e][0] + cov[e][2] for e in ok)
        ok = [e for e in ok if cov[e][0] + cov[e][2] == best]
        chosen = min(ok, key=lambda e: max(r["p99"] for r in summary[("150k", e)]))
        print(f"\nchosen engine: {chosen}  (torch-free at run time: "
              f"{', '.join(e for e in engines if torch_free[e]) or 'none'}; compiled + enforced: "
              f"{', '.join(f'{e} {cov[e][0]} + {cov[e][2]}' for e in engines)})")
    print(f"total {time.perf_counter() - t_all:.0f}s")
    write_json(args.json, {"per_schema": [{"vocab": label, "engine": e, "rows": rows} for (label, e), rows in summary.items()],
                           "coverage": {e: dict(zip(("compiled", "accepted", "enforced"), v)) for e, v in cov.items()},
                           "torch_free": torch_free}, args=args)


if __name__ == "__main__":
    main()
