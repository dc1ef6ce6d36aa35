"""Constrained decoding as a token mask: a JSON schema, "any JSON object", a regular expression
or a Lark grammar turned into the set of tokens allowed at each step, applied to numpy logits.

The engine is llguidance (an Earley parser over a lazily built derivative lexer, as used by
vLLM, SGLang and llama.cpp; a Rust wheel with no torch). bench/kernels/grammar_mask.py picked it over
xgrammar: xgrammar imports torch and transformers when it is imported (2.5-4 s here, and torch
is only a test dependency of colibri) and compiles a schema in 5-170 ms against llguidance's
1-4 ms; its masks are faster per token, but both are far below a decode step; and it
silently ignores keywords it cannot enforce where llguidance says so.

    grammar = Grammar.compile(tokenizer, {"json_schema": schema, "strict": True}, vocab_size)
    m = grammar.matcher()                  # one per generation; compile once, match many
    while True:
        logits = model(...)
        m.mask(logits)                     # -inf on every forbidden id (EOS until complete)
        if m.dead: stop("grammar_dead_end")
        token = sample(logits)
        if token in eos: stop("stop")
        m.accept(token)
        if m.done: stop("stop")           # complete, and nothing but EOS could follow

Where the grammar forces text (a key, a const, the punctuation between them), llguidance allows
only the tokenizer's own tokenization of it, so the model sees token sequences it was trained on.

JSON schema semantics (`strict` as OpenAI's response_format json_schema.strict):
- strict true: the schema is enforced exactly and a keyword or format the engine cannot enforce
  is an error (GrammarError) instead of being dropped silently. An object schema that lists
  `properties` and says nothing about extra keys gets `additionalProperties: false`, which
  OpenAI requires of every object in strict mode (it answers 400 without it); objects combined
  through allOf/anyOf/oneOf/$ref with sibling `properties` are left as written, since closing
  them would reject the keys the other part of the intersection defines.
- strict false (OpenAI's default, where OpenAI only asks the model nicely): the output is still
  constrained, but leniently: unsupported keywords and formats are ignored (llguidance
  `lenient`, listed in Grammar.warnings), `oneOf` is read as `anyOf`, and objects follow JSON
  Schema (extra keys allowed unless the schema says otherwise).
Both: object properties come in the order `properties` lists them (llguidance's rule); JSON
whitespace between tokens is free but at most 32 characters in one run (so a model cannot
loop on newlines forever), none before the value or after it. A schema's own top-level
"x-guidance" object may override these defaults (llguidance's JSON options).
"""
from __future__ import annotations

import json
import threading
import time
import weakref

import numpy as np

from colibri.errors import ColibriError

# JSON whitespace allowed between tokens: one run of at most this many characters. Enough for
# pretty-printed JSON nested ~8 deep with 4-space indents; caps the "\n\n\n..." loop small models
# fall into when whitespace is unbounded.
MAX_WHITESPACE_RUN = 32
_JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,%d}" % MAX_WHITESPACE_RUN}
_MAX_MESSAGE = 600


class GrammarError(ColibriError):
    """An invalid or unsupported grammar spec (bad schema, regex or Lark), or a token the
    grammar does not allow. The message names what is wrong."""


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401  (the bitmask fill)
    except ImportError:  # pragma: no cover - a dependency of colibri
        raise GrammarError("constrained decoding needs the llguidance package: pip install 'llguidance>=1.9'") from None
    return llguidance


# ---------------------------------------------------------------- per-tokenizer engine object

_ENGINES: "weakref.WeakKeyDictionary[object, object]" = weakref.WeakKeyDictionary()
_ENGINES_LOCK = threading.Lock()


def _ll_tokenizer(tokenizer):
    """The llguidance tokenizer (token trie + byte strings) for a colibri Tokenizer, built once per
    Tokenizer instance: ~0.5 s at 49k tokens, more at 150k."""
    with _ENGINES_LOCK:
        llt = _ENGINES.get(tokenizer)
        if llt is None:
            llg = _llguidance()
            data = json.loads(tokenizer.backend.to_str())
            data["padding"] = None      # as llguidance.hf does: a padded/truncated copy would
            data["truncation"] = None   # change what the token strings decode to
            eos = sorted(tokenizer.eos_token_ids) or None
            try:
                llt = llg.LLTokenizer(json.dumps(data), eos_token=eos)
            except Exception as exc:
                raise GrammarError(f"the grammar engine cannot read this tokenizer: {_clip(exc)}") from None
            # llguidance sets up its token trie walk on the first mask ever computed (~2-5 ms):
            # here, not in the first request's time to first token
            warm = llg.LLMatcher(llt, llg.LLMatcher.grammar_from_regex("[a-z]+"), log_level=0)
            _first_mask(warm, llt.vocab_size)
            _ENGINES[tokenizer] = llt
        return llt


def _first_mask(matcher, n_tokens: int) -> None:
    import llguidance.numpy as lnp

    lnp.fill_next_token_bitmask(matcher, np.zeros((1, (n_tokens + 31) // 32), dtype=np.int32))


# ---------------------------------------------------------------- compile

class Grammar:
    """A grammar compiled for one tokenizer and logits length. Immutable and shareable between
    threads; matcher() gives the per-generation state."""

    def __init__(self, template, n_tokens: int, vocab_size: int, kind: str, warnings: list[str],
                 compile_seconds: float):
        self._template = template        # an LLMatcher at the start state, deep-copied per matcher
        self.n_tokens = n_tokens         # ids the tokenizer defines (the mask's width)
        self.vocab_size = vocab_size     # logits length
        self.kind = kind
        self.warnings = warnings         # keywords/formats ignored (strict false), engine warnings
        self.compile_seconds = compile_seconds

    @classmethod
    def compile(cls, tokenizer, spec: dict, vocab_size: int) -> "Grammar":
        """spec: {"json_schema": {...}, "strict": bool}, {"json_object": True}, {"regex": "..."}
        or {"lark": "..."}. vocab_size is the model's logits length; ids the tokenizer does not
        define are always masked."""
        t0 = time.perf_counter()
        llg = _llguidance()
        if not isinstance(vocab_size, (int, np.integer)) or vocab_size <= 0:
            raise GrammarError(f"vocab_size must be a positive integer, not {vocab_size!r}")
        kind, grammar = _grammar_text(llg, spec)
        llt = _ll_tokenizer(tokenizer)
        template = llg.LLMatcher(llt, grammar, log_level=0)
        if not template.is_error():
            # the lexer states of the start, built once here and shared by every deep copy
            _first_mask(template, llt.vocab_size)
        if template.is_error():
            raise GrammarError(_describe(kind, template.get_error(), spec))
        warnings = list(template.get_grammar_warnings())
        return cls(template, int(llt.vocab_size), int(vocab_size), kind, warnings,
                   time.perf_counter() - t0)

    def matcher(self) -> "Matcher":
        return Matcher(self)


def _grammar_text(llg, spec) -> tuple[str, str]:
    if not isinstance(spec, dict):
        raise GrammarError(f"a grammar spec is a dict, not {type(spec).__name__}")
    kinds = [k for k in ("json_schema", "json_object", "regex", "lark") if k in spec]
    extra = set(spec) - {"json_schema", "json_object", "regex", "lark", "strict"}
    if len(kinds) != 1 or extra:
        raise GrammarError("a grammar spec has exactly one of json_schema, json_object, regex, lark "
                           f"(and strict with json_schema); got keys {sorted(spec)}")
    kind = kinds[0]
    value = spec[kind]
    if "strict" in spec and (kind != "json_schema" or not isinstance(spec["strict"], bool)):
        raise GrammarError("strict is a true/false option of json_schema")
    M = llg.LLMatcher
    try:
        if kind == "json_schema":
            if value is True:                    # JSON Schema: true allows any value
                value = {}
            if value is False:
                raise GrammarError("invalid JSON schema: false allows no value at all")
            if not isinstance(value, dict):
                raise GrammarError(f"json_schema must be a JSON object, not {type(value).__name__}")
            strict = bool(spec.get("strict", False))
            schema = close_objects(value) if strict else value
            return kind, M.grammar_from_json_schema(schema, defaults={**_JSON_DEFAULTS, "lenient": not strict})
        if kind == "json_object":
            if value is not True:
                raise GrammarError("json_object takes true")
            return kind, M.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)
        if not isinstance(value, str) or not value:
            raise GrammarError(f"{kind} must be a non-empty string")
        return kind, (M.grammar_from_regex(value) if kind == "regex" else M.grammar_from_lark(value))
    except (ValueError, TypeError) as exc:  # not JSON-serializable, not an object
        raise GrammarError(f"invalid {kind.replace('_', ' ')}: {_clip(exc)}") from None


# markers in llguidance's messages for "valid but not implemented" (vs. plainly invalid)
_UNSUPPORTED = ("Unimplemented", "Unknown format", "not supported", "unsupported", "Unsupported")


def _describe(kind: str, message: str, spec: dict) -> str:
    if "panic" in message:  # the engine's own assertion, with a Rust backtrace: no use to a client
        message = "the grammar engine cannot build it (too large or too complex)"
    message = _clip(message)
    if kind == "json_schema":
        if any(m in message for m in _UNSUPPORTED):
            hint = "" if not spec.get("strict") else " (with strict false such keywords are ignored instead)"
            return f"JSON schema uses a feature the grammar engine does not support: {message}{hint}"
        return f"invalid JSON schema: {message}"
    if kind == "regex":
        return f"invalid regex: {message}"
    if kind == "lark":
        return f"invalid Lark grammar: {message}"
    return f"invalid grammar: {message}"


def _clip(message) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= _MAX_MESSAGE else text[:_MAX_MESSAGE] + "..."


# ---------------------------------------------------------------- strict: close objects

_SCHEMA_KEYS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
                "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
              "allOf", "anyOf", "oneOf", "$ref")


def close_objects(schema, _combined: bool = False):
    """A copy of `schema` where each object schema that lists `properties` and says nothing on
    extra keys gets additionalProperties: false (OpenAI strict mode). Left as written: objects
    with allOf/anyOf/oneOf/$ref beside their properties, and the members of such combinations
    (`_combined`), where closing one part would reject the keys another part defines."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    has_props = isinstance(out.get("properties"), dict)
    for key in _SCHEMA_LIST_KEYS:
        if isinstance(out.get(key), list):
            combined = key == "allOf" or (key in ("anyOf", "oneOf") and has_props)
            out[key] = [close_objects(s, combined) for s in out[key]]
    for key in _SCHEMA_MAP_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    if has_props and not _combined and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


# ---------------------------------------------------------------- matching

class Matcher:
    """One generation's grammar state. Not thread-safe (one generation runs on one thread)."""

    def __init__(self, grammar: Grammar):
        import llguidance.numpy as lnp

        self._fill = lnp.fill_next_token_bitmask
        self._grammar = grammar
        self._m = grammar._template.deep_copy()
        self._bitmask = np.zeros((1, (grammar.n_tokens + 31) // 32), dtype=np.int32)
        self._words = self._bitmask[0]
        self._bytes = self._bitmask.view(np.uint8).reshape(-1)
        self._live = min(grammar.n_tokens, grammar.vocab_size)     # ids both real and in the logits
        self._scratch: np.ndarray | None = None
        self._fresh = False      # the bitmask is this state's
        self._dead = False
        self._mask_seconds = 0.0

    # ---- state

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing but EOS may follow (or EOS was accepted)."""
        return self._m.is_stopped() and not self._m.is_error()

    @property
    def dead(self) -> bool:
        """No id in the logits is allowed here: generation cannot go on under this grammar."""
        if self._m.is_error():
            return True
        if not self._fresh:
            self._compute()
        return self._dead

    @property
    def error(self) -> str:
        """The engine's reason when it stopped in error (a resource limit), else ''."""
        return self._m.get_error()

    @property
    def mask_seconds(self) -> float:
        """Time spent computing and applying masks so far (mask(), and a `dead` check)."""
        return self._mask_seconds

    # ---- per step

    def mask(self, logits: np.ndarray) -> None:
        """Set logits (shape [..., vocab_size]) to -inf on every id the grammar forbids now:
        EOS unless the grammar may end here, and always the ids past the tokenizer's."""
        if logits.shape[-1] != self._grammar.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} entries, the grammar was compiled "
                             f"for vocab_size {self._grammar.vocab_size}")
        if not self._fresh:
            self._compute()
        t0 = time.perf_counter()
        if self._dead:
            logits.fill(-np.inf)
        else:
            if self._scratch is None:
                self._scratch = np.empty((self._words.size * 4, 8), dtype=np.float32)
            apply_bitmask(logits, self._words, self._live, self._scratch)
        self._mask_seconds += time.perf_counter() - t0

    def accept(self, token: int) -> None:
        """Advance over `token`; GrammarError if the grammar does not allow it (the state is
        left unchanged then)."""
        t = int(token)
        if not 0 <= t < self._live:
            raise GrammarError(f"token id {t} is outside the vocabulary the grammar allows (0..{self._live - 1})")
        if self._m.is_error():
            raise GrammarError(f"the grammar stopped in error: {_clip(self._m.get_error())}")
        if self._fresh:
            ok = bool(self._bytes[t >> 3] >> (t & 7) & 1)
        else:
            ok = self._m.validate_tokens([t]) == 1
        if not ok:
            raise GrammarError(f"token {t} is not allowed by the grammar here")
        if not self._m.consume_token(t):
            raise GrammarError(f"the grammar rejected token {t}: {_clip(self._m.get_error())}")
        self._fresh = False

    def _compute(self) -> None:
        """This state's bitmask, filled by llguidance into our buffer."""
        t0 = time.perf_counter()
        if self._m.is_error():
            self._words[:] = 0
        else:
            self._fill(self._m, self._bitmask)
        self._dead = self._m.is_error() or not _any_bit(self._words, self._live)
        self._fresh = True
        self._mask_seconds += time.perf_counter() - t0


# ---------------------------------------------------------------- the bitmask onto logits

# byte -> 8 floats: +inf where the bit is set (minimum() keeps the logit), -inf where it is clear
_BYTE_CAP = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little").astype(bool),
    np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)


def apply_bitmask(logits: np.ndarray, words: np.ndarray, live: int, scratch: np.ndarray | None = None) -> None:
    """logits[..., i] = -inf for every i < live whose bit in `words` (int32, little-endian bits,
    llguidance's layout) is clear, and for every i >= live. Vectorized three ways, picked per
    step by how many 32-id words are mixed: a few allowed ids (structure: keys, punctuation) ->
    fill -inf and put the allowed logits back; a few forbidden ids (inside a string) -> scatter
    -inf over them; otherwise a byte -> 8 x (+inf|-inf) table row gather and one minimum().
    scratch: (len(words) * 4, 8) float32 for the last case (allocated when None)."""
    nw = words.size
    if np.count_nonzero(words) * 4 <= nw:            # few words hold an allowed id
        on = (words != 0).nonzero()[0]
        ids = _bit_ids(on, words[on])
        ids = ids[ids < live]
        keep = logits[..., ids]
        logits.fill(-np.inf)                          # (fill: ~2x faster than logits[...] = x)
        logits[..., ids] = keep
        return
    off = (words != -1).nonzero()[0]                 # words with a forbidden id
    if off.size * 4 <= nw:
        ids = _bit_ids(off, ~words[off])
        logits[..., ids[ids < live]] = -np.inf
    else:
        if scratch is None:
            scratch = np.empty((nw * 4, 8), dtype=np.float32)
        np.take(_BYTE_CAP, words.view(np.uint8), axis=0, out=scratch)
        head = logits[..., :live]
        np.minimum(head, scratch.reshape(-1)[:live], out=head)
    if live < logits.shape[-1]:
        logits[..., live:] = -np.inf


def _bit_ids(index: np.ndarray, words: np.ndarray) -> np.ndarray:
    """The ids of the set bits of `words` (int32), word k standing for ids 32*index[k]...+31."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")
    pos = np.flatnonzero(bits.view(bool))  # (on a bool view: ~4x faster than on uint8)
    return index[pos >> 5] * 32 + (pos & 31)


def _any_bit(words: np.ndarray, n: int) -> bool:
    """Whether any of the first n bits of the little-endian bitmask is set."""
    full, rest = divmod(n, 32)
    if words[:full].any():
        return True
    return bool(rest and int(words[full]) & ((1 << rest) - 1))
