"""Tokenizer: a `tokenizers` backend read from a Hugging Face model directory, with the chat
template and stop tokens, behaving as transformers' AutoTokenizer does on the same files."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from colibri.chat_template import render_chat_template
from colibri.errors import ColibriError

_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, backend: Backend, tokenizer_config: dict | None = None,
                 generation_config: dict | None = None, config: dict | None = None):
        self.backend = backend
        tokenizer_config = tokenizer_config or {}
        self.special_tokens = {k: _token_text(tokenizer_config.get(k)) for k in _NAMED_SPECIAL}
        self.chat_template = _pick_chat_template(tokenizer_config.get("chat_template"))
        self._add_named_special_tokens()
        if "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config:
            # transformers rebuilds the post-processor when the config states either flag
            self._set_post_processor(bool(tokenizer_config.get("add_bos_token")),
                                     bool(tokenizer_config.get("add_eos_token")))
        eos = set()
        for source in (generation_config or {}, config or {}):
            eos |= _ids(source.get("eos_token_id"))
        if self.eos_token is not None and (i := backend.token_to_id(self.eos_token)) is not None:
            eos.add(i)
        self._eos_ids = frozenset(eos)

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        """Read tokenizer.json, tokenizer_config.json and, where present, chat_template.jinja,
        generation_config.json and config.json (for the stop tokens)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ColibriError(f"{model_dir} has no tokenizer.json; colibri needs the Hugging Face fast-tokenizer file")
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:
            raise ColibriError(f"{path} is not a readable tokenizer.json ({' '.join(str(exc).split())})") from None
        tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        if (model_dir / "chat_template.jinja").is_file():  # transformers >= 4.43 saves it apart
            tokenizer_config["chat_template"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        elif "chat_template" not in tokenizer_config and (model_dir / "chat_template.json").is_file():
            tokenizer_config["chat_template"] = _read_json(model_dir / "chat_template.json").get("chat_template")
        return cls(backend, tokenizer_config, _read_json(model_dir / "generation_config.json"),
                   _read_json(model_dir / "config.json"))

    @classmethod
    def from_json(cls, tokenizer_json: str, tokenizer_config: dict | None = None,
                  generation_config: dict | None = None, config: dict | None = None) -> "Tokenizer":
        """From in-memory parts (e.g. a GGUFCheckpoint's) without writing a directory."""
        return cls(Backend.from_str(tokenizer_json), dict(tokenizer_config or {}), generation_config, config)

    def _add_named_special_tokens(self) -> None:
        # As transformers does: a named special token the backend does not yet treat as an added
        # token becomes one, so it is matched whole in text. Tokens outside the vocabulary are
        # not added (that would grow the vocabulary past the model's embedding).
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        missing = [t for t in self.special_tokens.values()
                   if t is not None and t not in added and self.backend.token_to_id(t) is not None]
        if missing:
            tokens = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)]
            self.backend.add_special_tokens(tokens)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.bos_token, self.eos_token
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = [(t, self.backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    # ---------------------------------------------------------------- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. Special tokens written in the text ("<|im_start|>") become their ids;
        add_special_tokens adds what the post-processor adds (BOS for many models)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens["eos_token"]

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (the model's vocab may be padded larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> set[int]:
        """Ids that end generation: generation_config's, config.json's and the tokenizer's eos."""
        return set(self._eos_ids)

    # ---------------------------------------------------------------- chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) renders it.
        kwargs reach the template as variables (tools=[...], enable_thinking=False, ...)."""
        if not self.chat_template:
            raise ColibriError("this model's tokenizer has no chat template; pass raw=True or token ids")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    special_tokens=self.special_tokens, **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """The prompt ids, as transformers' apply_chat_template(tokenize=True): the template writes
        its own special tokens, so none are added on top (no double BOS)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


class IncrementalDecoder:
    """Turns a stream of ids into text deltas whose concatenation is decode(all ids).

    Each step decodes a short window from `prefix` (the start of the last emitted piece) twice,
    without and with the new ids, and emits the difference. Decoding from a window rather than
    per token keeps SentencePiece's leading-space rule and multi-token characters right. A
    window ending in U+FFFD is held back: the next token may complete a UTF-8 sequence
    (an emoji spread over byte tokens).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0   # window start
        self._read = 0     # ids before this are emitted
        self._prefix_text = ""

    def feed(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(self._prefix_text) and not text.endswith("\ufffd"):
            return self._advance(text)
        return ""

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end comes out as U+FFFD)."""
        text = self._decode(self._ids[self._prefix:])
        return self._advance(text) if len(text) > len(self._prefix_text) else ""

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return delta


def _token_text(value) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value) -> str | None:
    # Older configs hold a list of named templates; the "default" one is the chat template.
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value or None


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ColibriError(f"{path} is not valid JSON ({' '.join(str(exc).split())})") from None
    if not isinstance(data, dict):  # the readers call .get on it
        raise ColibriError(f"{path} holds a JSON {type(data).__name__}, not an object; restore the file")
    return data
